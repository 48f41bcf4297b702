"""LongBench v1 (Bai et al., 2023; hub dataset THUDM/LongBench): its 21 subsets with the official prompts
(config/dataset2prompt.json), generation budgets (config/dataset2maxlen.json), metrics (metrics.py, eval.py)
and post-processing, so kvlab numbers line up with published LongBench tables.

Faithfulness notes (where LongBench's behaviour comes from a library we do not depend on):
- `rouge_score` ports the `rouge` package (1.0.1) that LongBench calls: texts are split into sentences at ".",
  ROUGE-L is the summary-level union-LCS F-measure, and words are counted as *sets* (its default
  exclusive=True), so repeated words count once. The package reconstructs the LCS recursively and, past
  Python's recursion limit (a sentence pair over ~1000 words), LongBench's bare `except` scores 0; we compute
  the score instead.
- `code_sim_score` uses fuzzywuzzy's `fuzz.ratio` as it runs without python-Levenshtein:
  round(100 * difflib.SequenceMatcher ratio) / 100, with its "equal strings -> 100, one empty -> 0" guards.
- Chinese metrics tokenize with `jieba` (as LongBench does) when it is importable. Without it (kvlab does not
  depend on it) they fall back to `zh_tokens`' deterministic rule: every Han character (and every other
  non-space character) is a token, except runs of ASCII letters/digits, which stay whole as jieba keeps them.
  Scores then differ somewhat from jieba's (words of 2+ characters become several tokens).
- `classification_score` keeps LongBench's rule exactly, including its removal-while-iterating loop (which
  can skip a class) and without its unreachable fallback branch (`if em_match_list != 0` is always true).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import string
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvlab.tasks.base import Example, GenerationTask, render_prompt
from kvlab.tokenizer import Tokenizer

try:  # LongBench's Chinese word segmenter; optional (see the module docstring)
    import jieba  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    jieba = None

HUB_REPO = "THUDM/LongBench"
HUB_FILE = "data.zip"
ENV_DIR = "KVLAB_LONGBENCH_DIR"

# config/dataset2prompt.json of LongBench v1, verbatim.
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# config/dataset2maxlen.json: new tokens to generate.
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# eval.py's dataset2metric, by metric name.
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

SUBSETS: tuple[str, ...] = tuple(DATASET2PROMPT)
# pred.py: "chat models are better off without build prompts on these tasks" (few-shot and code completion).
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# eval.py's scorer: for these the prediction is cut at its first line (after leading newlines).
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})


# ---------------------------------------------------------------------------------------------- metrics


def normalize_answer(s: str) -> str:
    """SQuAD normalization (LongBench's): lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_EN_PUNCTUATION = frozenset(string.punctuation)
_CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_ZH_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)
_ZH_FALLBACK_TOKEN = re.compile(r"[A-Za-z0-9]+|\S")


def normalize_zh_answer(s: str) -> str:
    """LongBench's Chinese normalization: lower case, no (ASCII or CJK) punctuation, no whitespace at all."""
    return "".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION and not ch.isspace())


def zh_tokens(text: str) -> list[str]:
    """Words of a Chinese text: jieba's (accurate mode, as LongBench) when installed, else the deterministic
    fallback: each non-space character alone, except runs of ASCII letters/digits, kept whole like jieba does."""
    if jieba is not None:
        return list(jieba.cut(text, cut_all=False))
    return _ZH_FALLBACK_TOKEN.findall(text)


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Token-multiset F1."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(prediction), num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """F1 of the normalized whitespace tokens."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """F1 of the Chinese words, each normalized, empty ones dropped."""

    def words(text: str) -> list[str]:
        return [w for w in map(normalize_zh_answer, zh_tokens(text)) if w]

    return f1_score(words(prediction), words(ground_truth))


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """The words of the LCS the `rouge` package reconstructs (same DP and tie-breaking), iteratively."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev, word = table[i], table[i - 1], ref[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if word == hyp[j - 1] else max(prev[j], row[j - 1])
    words: set[str] = set()
    i, j = n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_sentences(text: str) -> list[list[str]]:
    """The `rouge` package's preprocessing: sentences split at ".", whitespace collapsed, words split at " "."""
    return [" ".join(s.split()).split(" ") for s in text.split(".") if len(s) > 0]


def rouge_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L F as LongBench gets it from `rouge.Rouge().get_scores(...)["rouge-l"]["f"]`: summary-level
    union LCS over "."-sentences, with unique-word counts; 0 when either side has no sentence."""
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        return 0.0  # the package raises ("Hypothesis is empty."), LongBench catches it as 0
    n = len({w for s in hyp for w in s})
    m = len({w for s in ref for w in s})
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L over Chinese words joined by spaces."""
    return rouge_score(" ".join(zh_tokens(prediction)), " ".join(zh_tokens(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """LongBench's rule: the classes named in the prediction (substring match), minus those that are a strict
    substring of the ground truth; 1/len(matches) when the ground truth is among them, else 0."""
    matches = [c for c in all_classes or () if c in prediction]
    i = 0
    while i < len(matches):  # LongBench removes from the list it iterates over, which skips the next class
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_share(prediction: str, target: str) -> float:
    """The share of the numbers in the prediction that equal the target."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """passage_count: the share of the numbers in the prediction that are the count."""
    return _number_share(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """passage_retrieval_en: the share of the numbers in the prediction equal to N of "Paragraph N"."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    return _number_share(prediction, found[0]) if found else 0.0


def retrieval_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """passage_retrieval_zh: as retrieval_score, for "段落N"."""
    found = re.findall(r"段落(\d+)", ground_truth)
    return _number_share(prediction, found[0]) if found else 0.0


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's `fuzz.ratio` without python-Levenshtein: 0..100."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """The first predicted line that is not a code fence or comment (no `, #, //), compared by fuzz.ratio."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    return fuzz_ratio(line, ground_truth) / 100


Metric = Callable[..., float]
METRICS: dict[str, Metric] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}


def score_prediction(subset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """eval.py's per-example score (0..1): first-line post-processing where LongBench applies it, then the
    best metric value over the reference answers."""
    _check_subset(subset)
    if subset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[DATASET2METRIC[subset]]
    return max((metric(prediction, gt, all_classes=all_classes) for gt in answers), default=0.0)


# ---------------------------------------------------------------------------------------------- data


def _check_subset(subset: str) -> None:
    if subset not in DATASET2PROMPT:
        raise ValueError(f"unknown LongBench subset {subset!r}; choose one of: {', '.join(SUBSETS)}")


def default_data_dir() -> Path:
    """Where downloaded subsets live: $KVLAB_LONGBENCH_DIR, else ~/.cache/kvlab/longbench."""
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvlab" / "longbench"


def _find(data_dir: Path, subset: str) -> Path | None:
    """The subset's jsonl in the dir, or in its data/ subfolder (data.zip unzipped as is)."""
    for path in (data_dir / f"{subset}.jsonl", data_dir / "data" / f"{subset}.jsonl"):
        if path.is_file():
            return path
    return None


def _offline_help(data_dir: Path) -> str:
    return (
        f"LongBench is the Hugging Face hub dataset {HUB_REPO} (file {HUB_FILE}, holding data/<subset>.jsonl). "
        f"To provide it offline: download https://huggingface.co/datasets/{HUB_REPO}/resolve/main/{HUB_FILE} on a machine "
        f"with internet, unzip it into a directory, and set {ENV_DIR}=<that directory> or pass data_dir=<that directory> "
        f"(the <subset>.jsonl files may sit in it or in its data/ subfolder); the default directory is {data_dir}."
    )


def _download(data_dir: Path) -> None:
    """Fetch data.zip from the hub and extract every jsonl into data_dir (flat, atomically per file)."""
    import huggingface_hub  # looked up at call time, so tests can monkeypatch hf_hub_download

    archive = huggingface_hub.hf_hub_download(repo_id=HUB_REPO, filename=HUB_FILE, repo_type="dataset")
    data_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            name = Path(member.filename).name  # flatten: no path from the archive reaches the file system
            if member.is_dir() or not name.endswith(".jsonl"):
                continue
            tmp = data_dir / f".{name}.part"
            with zf.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(tmp, data_dir / name)


def subset_path(subset: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Path of a subset's jsonl. With data_dir None, the default dir, downloading data.zip there if needed;
    an explicit data_dir is only read, never downloaded into."""
    _check_subset(subset)
    if data_dir is not None:
        directory = Path(data_dir).expanduser()
        path = _find(directory, subset)
        if path is None:
            raise ValueError(f"LongBench subset {subset!r}: no {subset}.jsonl in {directory} (nor in its data/ subfolder). {_offline_help(default_data_dir())}")
        return path
    directory = default_data_dir()
    path = _find(directory, subset)
    if path is not None:
        return path
    try:
        _download(directory)
    except Exception as err:  # offline, hub errors, a broken archive: all mean "provide the data yourself"
        raise ValueError(
            f"LongBench subset {subset!r}: {directory / (subset + '.jsonl')} is missing and downloading {HUB_FILE} from the hub "
            f"failed ({type(err).__name__}: {err}). {_offline_help(directory)}"
        ) from err
    path = _find(directory, subset)
    if path is None:
        raise ValueError(f"LongBench subset {subset!r}: the hub's {HUB_FILE} has no {subset}.jsonl. {_offline_help(directory)}")
    return path


def _read_jsonl(path: Path, limit: int | None = None) -> Iterator[dict]:
    """The records of a jsonl file in order, stopping after `limit` (the first n need not read a whole subset)."""
    if limit is not None and limit <= 0:
        return
    count = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
                count += 1
                if count == limit:
                    return


def load_longbench(subset: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """All examples of a subset, in file order, as LongBench's dicts (input, context, answers, length,
    dataset, language, all_classes, _id)."""
    return list(_read_jsonl(subset_path(subset, data_dir)))


# ---------------------------------------------------------------------------------------------- prompts


def truncate_middle(tokenizer: Tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """pred.py's truncation: over max_tokens, keep the first and last max_tokens // 2 tokens (the instructions
    sit at both ends) and decode them back to text. If re-encoding the joined halves ever comes out longer
    (a merge across the seam), the halves shrink until it fits. Returns (text, whether it was cut)."""
    ids = tokenizer.encode(text)
    if len(ids) <= max_tokens:
        return text, False
    half = max_tokens // 2
    while True:
        cut = tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - half :])
        excess = len(tokenizer.encode(cut)) - max_tokens
        if excess <= 0 or half == 0:
            return cut, True
        half = max(0, half - (excess + 1) // 2)


class LongBenchTask(GenerationTask):
    """One LongBench subset: the first n examples of its test file (LongBench scores the whole file, unsampled)."""

    family = "longbench"

    def __init__(self, name: str, data_dir: str | os.PathLike | None = None) -> None:
        _check_subset(name)
        self.name = name
        self.metric = DATASET2METRIC[name]
        self.template = DATASET2PROMPT[name]
        self.max_new_tokens = DATASET2MAXLEN[name]
        self.uses_chat_template = name not in NO_CHAT_TEMPLATE
        self.data_dir = data_dir  # None: default_data_dir(), downloading on first use

    def __repr__(self) -> str:
        return f"LongBenchTask({self.name!r}, data_dir={self.data_dir!r})"

    def prompt(self, record: dict) -> str:
        """The official prompt: the subset's template filled with the record's context and input."""
        return self.template.format(context=record["context"], input=record["input"])

    def examples(self, tokenizer: Tokenizer, num_samples: int, seed: int = 0, context_length: int | None = None, chat: bool = True) -> list[Example]:
        """The first num_samples examples in file order (seed unused: nested and deterministic anyway); prompts
        cut in the middle to context_length tokens before the chat template, which applies where LongBench's does."""
        if context_length is not None and context_length < 1:
            raise ValueError(f"context_length must be positive or None, got {context_length}")
        out = []
        for record in _read_jsonl(subset_path(self.name, self.data_dir), limit=num_samples):
            text, truncated = self.prompt(record), False
            if context_length is not None:
                text, truncated = truncate_middle(tokenizer, text, context_length)
            info = {
                "dataset": record.get("dataset", self.name),
                "language": record.get("language"),
                "length": record.get("length"),
                "all_classes": record.get("all_classes"),
                "truncated": truncated,
            }
            ids = render_prompt(tokenizer, text, chat=chat and self.uses_chat_template)
            out.append(Example(f"{self.name}/{record['_id']}", ids, list(record["answers"]), self.max_new_tokens, info))
        return out

    def score(self, prediction: str, example: Example) -> float:
        return score_prediction(self.name, prediction, example.answers, example.info.get("all_classes"))


TASKS: dict[str, LongBenchTask] = {name: LongBenchTask(name) for name in SUBSETS}


def set_data_dir(data_dir: str | os.PathLike | None) -> None:
    """Point every task in TASKS at a directory of <subset>.jsonl files (None: back to the default)."""
    for task in TASKS.values():
        task.data_dir = data_dir

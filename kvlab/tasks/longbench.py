"""LongBench v1 (Bai et al., 2023; hub dataset THUDM/LongBench): its 21 subsets with the official prompts
(config/dataset2prompt.json), generation budgets (config/dataset2maxlen.json), metrics (metrics.py, eval.py)
and post-processing, so kvlab numbers line up with published LongBench tables.

The metrics, and where they depart from the libraries LongBench calls, are in longbench_metrics.py.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvlab.tasks.base import Example, GenerationTask, render_prompt
from kvlab.tasks.longbench_metrics import METRICS
from kvlab.tokenizer import Tokenizer

HUB_REPO = "THUDM/LongBench"
HUB_FILE = "data.zip"
ENV_DIR = "KVLAB_LONGBENCH_DIR"

# config/dataset2prompt.json of LongBench v1, verbatim.
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. "
    "Answer the question as concisely as you can, using a single phrase if possible. Do not "
    "provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story "
    "as concisely as you can, using a single phrase if possible. Do not provide any "
    "explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, "
    "using a single phrase or sentence if possible. If the question cannot be answered based on the "
    'information in the article, write "unanswerable". If the question is a yes/no question, answer '
    '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer '
    "the question based on the above article as concisely as you can, using a single phrase or "
    "sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
    '"unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other "
    "words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
    "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n"
    "问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
    "the given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
    "{input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
    "the given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
    "{input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
    "the given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
    "{input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n"
    "问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the "
    "report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the "
    "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
    "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. "
    "\n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of "
    "questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any "
    "other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some "
    "examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
    "Please carefully read these paragraphs and determine how many unique paragraphs there are "
    "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
    "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
    "duplicates. The output format should only contain the number, such as 1, 2, 3, and so "
    "on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
    "which paragraph the abstract is from.\n\n{context}\n\nThe following is an "
    "abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract "
    'is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe '
    "answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n"
    "{context}\n\n下面是一个摘要\n\n{input}\n\n"
    '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
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


def score_prediction(
    subset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
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
        f"To provide it offline: download https://huggingface.co/datasets/{HUB_REPO}/resolve/main/{HUB_FILE} on "
        f"a machine with internet, unzip it into a directory, and set {ENV_DIR}=<that directory> or pass "
        "data_dir=<that directory> (the <subset>.jsonl files may sit in it or in its data/ subfolder); the "
        f"default directory is {data_dir}."
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
            raise ValueError(
                f"LongBench subset {subset!r}: no {subset}.jsonl in {directory} (nor in its data/ subfolder). "
                f"{_offline_help(default_data_dir())}"
            )
        return path
    directory = default_data_dir()
    path = _find(directory, subset)
    if path is not None:
        return path
    try:
        _download(directory)
    except Exception as err:  # offline, hub errors, a broken archive: all mean "provide the data yourself"
        raise ValueError(
            f"LongBench subset {subset!r}: {directory / (subset + '.jsonl')} is missing and downloading "
            f"{HUB_FILE} from the hub failed ({type(err).__name__}: {err}). {_offline_help(directory)}"
        ) from err
    path = _find(directory, subset)
    if path is None:
        raise ValueError(
            f"LongBench subset {subset!r}: the hub's {HUB_FILE} has no {subset}.jsonl. {_offline_help(directory)}"
        )
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

    def examples(
        self,
        tokenizer: Tokenizer,
        num_samples: int,
        seed: int = 0,
        context_length: int | None = None,
        chat: bool = True,
    ) -> list[Example]:
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

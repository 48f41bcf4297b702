"""LongBench v1's metrics (its metrics.py and eval.py), ported without its dependencies.

Where LongBench's behaviour comes from a library kvlab does not depend on:
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
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

try:  # LongBench's Chinese word segmenter; optional (see the module docstring)
    import jieba  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    jieba = None


def normalize_answer(s: str) -> str:
    """SQuAD normalization (LongBench's): lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_EN_PUNCTUATION = frozenset(string.punctuation)
_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～"
    "｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
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

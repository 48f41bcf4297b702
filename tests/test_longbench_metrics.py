"""LongBench's metrics as LongBench scores them: QA F1, ROUGE-L (the rouge package's), Chinese by characters
without jieba, classification's partial credit, retrieval, counting and code, and the first line of a prediction."""

from __future__ import annotations

import pytest
from test_longbench import TREC_CLASSES

from kvlab.tasks import Example
from kvlab.tasks import longbench_metrics as metrics
from kvlab.tasks.longbench import TASKS

# Independent copies of LongBench's eval.py dataset2metric and config/dataset2maxlen.json.


def test_qa_f1_normalizes_case_punctuation_and_articles():
    assert metrics.normalize_answer("The  Eiffel-Tower, in an  old city!") == "eiffeltower in old city"
    assert metrics.qa_f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    # {tower, in, paris} vs {eiffel, tower}: 1 common -> P 1/3, R 1/2, F1 2/5
    assert metrics.qa_f1_score("the tower in Paris", "Eiffel Tower") == pytest.approx(0.4)
    assert metrics.qa_f1_score("a an the", "the") == 0.0  # nothing left after normalization
    assert metrics.qa_f1_score("Paris Paris", "Paris") == pytest.approx(2 / 3)  # multiset: P 1/2, R 1


def test_rouge_l_is_lcs_f_measure():
    # LCS "police the gunman" = 3 of 4 words each side -> F 3/4
    assert metrics.rouge_score("police killed the gunman", "police kill the gunman") == pytest.approx(0.75)
    assert metrics.rouge_score("the cat sat", "the cat sat") == pytest.approx(1.0)
    assert metrics.rouge_score("dogs bark", "cats purr") == 0.0
    assert metrics.rouge_score("", "a summary") == 0.0 and metrics.rouge_score("...", "a summary") == 0.0  # no sentence


def test_rouge_l_follows_the_rouge_package_longbench_uses():
    # words are counted as sets: LCS "the cat on the mat" is {the, cat, on, mat} = 4 of 5 unique words each side
    assert metrics.rouge_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8)
    # summary level over "."-sentences: union of LCS(ref, c1) = {w1, w2} and LCS(ref, c2) = {w1, w3, w5} is 4 words;
    # R = 4/5, P = 4/8 (8 distinct hypothesis words) -> F = 2 * 0.4 / 1.3
    assert metrics.rouge_score("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5") == pytest.approx(0.8 / 1.3)


def test_chinese_metrics_fall_back_to_characters_without_jieba(monkeypatch):
    monkeypatch.setattr(metrics, "jieba", None)
    assert metrics.zh_tokens("我在2023年去了abc公司。") == [
        "我",
        "在",
        "2023",
        "年",
        "去",
        "了",
        "abc",
        "公",
        "司",
        "。",
    ]
    assert metrics.zh_tokens(" a  b ") == ["a", "b"]
    # 北 京 (。 dropped) vs 北 京 市: P 1, R 2/3 -> F1 4/5
    assert metrics.qa_f1_zh_score("北京。", "北京市") == pytest.approx(0.8)
    assert metrics.qa_f1_zh_score("2023年", "2023") == pytest.approx(2 / 3)  # the digit run is one token
    assert metrics.qa_f1_zh_score("，。！", "北京") == 0.0
    # LCS 今天天气 -> {今, 天, 气}; unique chars 5 on each side -> F 3/5
    assert metrics.rouge_zh_score("今天天气很好", "今天天气不错") == pytest.approx(0.6)


def test_classification_uses_longbench_partial_credit_rule():
    def score(pred: str, gt: str, classes: list[str] = TREC_CLASSES) -> float:
        return metrics.classification_score(pred, gt, all_classes=classes)

    assert score("City", "City") == 1.0
    assert score("City or Country", "City") == 0.5  # ground truth among 2 matched classes
    assert score("Country", "City") == 0.0
    assert score("Nothing", "City") == 0.0
    # a class that is a strict substring of the ground truth does not count against it: "location" in "Other location"
    assert score("Other location", "Other location", ["location", "Other location", "City"]) == 1.0
    # LongBench removes from the list it iterates, skipping the next class: "ab" survives -> 1/2
    assert score("abc", "abc", ["a", "ab", "abc"]) == 0.5


def test_retrieval_count_and_code_scores():
    assert metrics.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert metrics.retrieval_score("Paragraph 12, or maybe Paragraph 3", "Paragraph 12") == 0.5
    assert (
        metrics.retrieval_score("Paragraph 1", "Paragraph 12") == 0.0
        and metrics.retrieval_score("no idea", "Paragraph 12") == 0.0
    )
    assert (
        metrics.retrieval_zh_score("段落3", "段落3") == 1.0
        and metrics.retrieval_zh_score("答案是段落3和段落30", "段落3") == 0.5
    )
    assert metrics.count_score("There are 7 unique paragraphs", "7") == 1.0
    assert metrics.count_score("7 or 8", "7") == 0.5 and metrics.count_score("none", "7") == 0.0
    assert metrics.code_sim_score("\nx = foo(1)\nmore code", "x = foo(1)") == 1.0
    # fences and comments are skipped; "y = 2" vs "y = 3": 4 of 5 chars match -> ratio 8/10
    assert metrics.code_sim_score("```python\n# comment\n// note\ny = 2", "y = 3") == 0.8
    assert metrics.code_sim_score("abc", "abd") == 0.67  # round(100 * 4/6) / 100
    assert metrics.code_sim_score("# only a comment", "x = 1") == 0.0
    assert metrics.fuzz_ratio("", "") == 100 and metrics.fuzz_ratio("", "a") == 0


def example(answers: list[str], all_classes: list[str] | None = None) -> Example:
    return Example("t/0", [], answers, 32, {"all_classes": all_classes})


def test_score_takes_the_first_line_where_longbench_does_and_the_best_answer():
    trec = TASKS["trec"]
    assert trec.score("City\nCountry", example(["City"], TREC_CLASSES)) == 1.0  # the second line is dropped
    assert trec.score("\n\nCountry\nCity", example(["City"], TREC_CLASSES)) == 0.0
    assert TASKS["triviaqa"].score("paris\nThe answer is London", example(["London", "Paris"])) == 1.0
    assert TASKS["passage_count"].score("7\n8", example(["7"])) == 0.5  # no first-line cut here
    assert TASKS["hotpotqa"].score("Paris, France", example(["London", "Paris"])) == pytest.approx(2 / 3)  # P 1/2, R 1
    assert TASKS["hotpotqa"].score("anything", example([])) == 0.0
    summary = example(["A short summary. Of a report."])  # ROUGE-L: the first sentence matched whole gives P 1, R 1/2
    assert TASKS["gov_report"].score("", summary) == 0.0
    assert TASKS["gov_report"].score("a short summary", summary) == pytest.approx(2 / 3)
    assert TASKS["gov_report"].score("A short summary. Of a report.", summary) == pytest.approx(1.0)

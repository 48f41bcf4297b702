"""LongBench: loading, official prompts, middle truncation, metrics (values worked out by hand, matching
LongBench's metrics.py) and the hub download path, all on small jsonl fixtures written here."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from kvlab.tasks import longbench as lb
from kvlab.tasks import render_prompt
from kvlab.tasks.longbench import TASKS, LongBenchTask, load_longbench, truncate_middle

# Independent copies of LongBench's eval.py dataset2metric and config/dataset2maxlen.json.
EXPECTED = {
    "narrativeqa": ("qa_f1_score", 128),
    "qasper": ("qa_f1_score", 128),
    "multifieldqa_en": ("qa_f1_score", 64),
    "multifieldqa_zh": ("qa_f1_zh_score", 64),
    "hotpotqa": ("qa_f1_score", 32),
    "2wikimqa": ("qa_f1_score", 32),
    "musique": ("qa_f1_score", 32),
    "dureader": ("rouge_zh_score", 128),
    "gov_report": ("rouge_score", 512),
    "qmsum": ("rouge_score", 512),
    "multi_news": ("rouge_score", 512),
    "vcsum": ("rouge_zh_score", 512),
    "trec": ("classification_score", 64),
    "triviaqa": ("qa_f1_score", 32),
    "samsum": ("rouge_score", 128),
    "lsht": ("classification_score", 64),
    "passage_count": ("count_score", 32),
    "passage_retrieval_en": ("retrieval_score", 32),
    "passage_retrieval_zh": ("retrieval_zh_score", 32),
    "lcc": ("code_sim_score", 64),
    "repobench-p": ("code_sim_score", 64),
}
TREC_CLASSES = ["Abbreviation", "Expression abbreviated", "City", "Country", "Other location", "Individual"]


def record(
    subset: str,
    i: int,
    context: str,
    input: str,
    answers: list[str],
    language: str = "en",
    all_classes: list[str] | None = None,
) -> dict:
    """One line of a LongBench jsonl file, with all its fields."""
    return {
        "input": input,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": subset,
        "language": language,
        "all_classes": all_classes,
        "_id": f"{subset}-id-{i}",
    }


def write_jsonl(directory: Path, subset: str, records: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{subset}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def subset_records() -> dict[str, list[dict]]:
    """The fixture's records per subset: English QA, Chinese QA, classification, retrieval, counting, code."""
    return {
        "hotpotqa": [
            record(
                "hotpotqa",
                i,
                f"Passage {i}: The Eiffel Tower is in Paris.",
                f"Question {i}: where is the tower?",
                ["Paris", "in Paris"],
            )
            for i in range(4)
        ],
        "multifieldqa_zh": [
            record("multifieldqa_zh", 0, "北京是中国的首都。", "中国的首都是哪里？", ["北京"], language="zh")
        ],
        "trec": [
            record(
                "trec",
                i,
                "Question: What is the capital of France?\nType: City\n",
                f"Question: Who wrote Hamlet {i}?\nType:",
                ["Individual"],
                all_classes=TREC_CLASSES,
            )
            for i in range(3)
        ],
        "passage_retrieval_en": [
            record(
                "passage_retrieval_en",
                0,
                "Paragraph 1: Cats purr.\n\nParagraph 2: Dogs bark.",
                "Dogs make a noise.",
                ["Paragraph 2"],
            )
        ],
        "passage_count": [
            record("passage_count", 0, "Paragraph 1: A.\n\nParagraph 2: B.\n\nParagraph 3: A.", "", ["2"])
        ],
        "lcc": [record("lcc", 0, "def add(a, b):\n    return a + b\n\nx = ", "", ["x = add(1, 2)"], language="python")],
    }


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Fixture files for six subsets: English QA, Chinese QA, classification, retrieval, counting, code."""
    d = tmp_path / "longbench"
    for subset, records in subset_records().items():
        write_jsonl(d, subset, records)
    return d


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm[1]


# ---------------------------------------------------------------------------------------------- registry


def test_tasks_cover_the_21_subsets_with_longbench_metrics_and_budgets():
    assert list(TASKS) == list(EXPECTED)
    for name, (metric, max_new) in EXPECTED.items():
        task = TASKS[name]
        assert (task.name, task.family, task.metric, task.max_new_tokens) == (name, "longbench", metric, max_new)
        assert "{context}" in task.template
    no_chat = {n for n, t in TASKS.items() if not t.uses_chat_template}
    assert no_chat == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


def test_unknown_subset_lists_the_valid_names(data_dir):
    for call in (
        lambda: load_longbench("hotpot_qa", data_dir),
        lambda: LongBenchTask("passage_retrieval"),
        lambda: lb.score_prediction("nq", "x", ["x"]),
    ):
        with pytest.raises(ValueError, match="unknown LongBench subset") as info:
            call()
        assert all(name in str(info.value) for name in EXPECTED)


# ---------------------------------------------------------------------------------------------- loading and prompts


def test_load_longbench_reads_all_fields_in_file_order(data_dir):
    rows = load_longbench("trec", data_dir)
    assert [r["_id"] for r in rows] == ["trec-id-0", "trec-id-1", "trec-id-2"]
    assert set(rows[0]) == {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
    assert rows[1]["input"] == "Question: Who wrote Hamlet 1?\nType:" and rows[1]["all_classes"] == TREC_CLASSES


def test_load_finds_files_in_a_data_subfolder_as_data_zip_unzips(tmp_path):
    write_jsonl(tmp_path / "data", "lcc", [record("lcc", 0, "x = 1\n", "", ["y = 2"])])
    assert load_longbench("lcc", tmp_path)[0]["answers"] == ["y = 2"]


def test_qa_prompt_is_the_official_template_in_the_chat_template(tok, data_dir):
    task = LongBenchTask("hotpotqa", data_dir)
    (ex,) = task.examples(tok, 1)
    prompt = (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\nPassage 0: The Eiffel Tower is in Paris.\n\nAnswer the "
        "question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nQuestion: Question 0: where is the tower?\nAnswer:"
    )
    assert ex.input_ids == render_prompt(tok, prompt, chat=True)
    assert f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n" in tok.decode(ex.input_ids)
    assert (ex.id, ex.answers, ex.max_new_tokens) == ("hotpotqa/hotpotqa-id-0", ["Paris", "in Paris"], 32)
    assert (
        ex.info["dataset"] == "hotpotqa"
        and ex.info["length"] == 8
        and ex.info["all_classes"] is None
        and not ex.info["truncated"]
    )
    (plain,) = task.examples(tok, 1, chat=False)
    assert plain.input_ids == tok.encode(prompt, bos=tok.add_bos) and tok.decode(plain.input_ids) == prompt


def test_chinese_prompt(tok, data_dir):
    (ex,) = LongBenchTask("multifieldqa_zh", data_dir).examples(tok, 5)
    prompt = (
        "阅读以下文字并用中文简短回答：\n\n北京是中国的首都。\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：中国的首都是哪里？\n"
        "回答："
    )
    assert ex.input_ids == render_prompt(tok, prompt, chat=True) and prompt in tok.decode(ex.input_ids)
    assert ex.info["language"] == "zh" and ex.max_new_tokens == 64


@pytest.mark.parametrize(
    ("subset", "prompt"),
    [
        (
            "trec",
            "Please determine the type of the question below. Here are some examples of questions.\n\nQuestion: "
            "What is the capital of France?\nType: City\n\nQuestion: Who wrote Hamlet 0?\nType:",
        ),
        ("lcc", "Please complete the code given below. \ndef add(a, b):\n    return a + b\n\nx = Next line of code:\n"),
    ],
)
def test_few_shot_and_code_prompts_skip_the_chat_template(tok, data_dir, subset, prompt):
    """LongBench builds no chat prompt for trec, triviaqa, samsum, lsht, lcc, repobench-p, even for chat models."""
    ex = LongBenchTask(subset, data_dir).examples(tok, 1, chat=True)[0]
    assert ex.input_ids == tok.encode(prompt, bos=tok.add_bos)
    assert tok.decode(ex.input_ids) == prompt and tok.specials["<|im_start|>"] not in ex.input_ids


def test_examples_are_the_first_n_in_file_order_nested_and_seed_free(tok, data_dir):
    task = LongBenchTask("hotpotqa", data_dir)
    three = task.examples(tok, 3)
    assert [e.id for e in three] == [f"hotpotqa/hotpotqa-id-{i}" for i in range(3)]
    assert task.examples(tok, 2, seed=7) == three[:2]
    assert len(task.examples(tok, 100)) == 4  # fewer in the file than asked: all of them


def test_set_data_dir_points_every_registered_task_at_a_directory(tok, data_dir):
    try:
        lb.set_data_dir(data_dir)
        assert all(t.data_dir == data_dir for t in TASKS.values())
        assert TASKS["passage_count"].examples(tok, 1)[0].answers == ["2"]
    finally:
        lb.set_data_dir(None)
    assert TASKS["passage_count"].data_dir is None


# ---------------------------------------------------------------------------------------------- truncation


def test_truncate_middle_keeps_both_ends(tok):
    words = " ".join(f"w{i}" for i in range(2000))
    prompt = f"START of the prompt. {words} MIDDLE-MARKER {words} the END."
    ids = tok.encode(prompt)
    n = len(ids)
    assert n > 2000
    text, cut = truncate_middle(tok, prompt, 300)
    # pred.py: first and last max_length // 2 tokens
    assert cut and text == tok.decode(ids[:150]) + tok.decode(ids[-150:])
    assert 296 <= len(tok.encode(text)) <= 300
    assert text.startswith("START of the prompt. w0 w1 w2") and text.endswith("w1998 w1999 the END.")
    assert "MIDDLE-MARKER" not in text and "w1000" not in text
    assert truncate_middle(tok, prompt, n) == (prompt, False)


class CharTokenizer:
    """Greedy longest-match over a tiny vocabulary: re-encoding two decoded halves can take more tokens."""

    vocab = ["yzz", "xy", "a", "b", "x", "y", "z"]

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            k = next(k for k, v in enumerate(self.vocab) if text.startswith(v, i))
            ids.append(k)
            i += len(self.vocab[k])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def test_truncate_middle_takes_half_from_each_end_and_shrinks_past_seam_growth():
    t = CharTokenizer()
    assert truncate_middle(t, "abxyab", 4) == ("abab", True)  # a b xy a b -> a b | a b
    assert truncate_middle(t, "abxyab", 3) == ("ab", True)  # int(3 / 2) = 1 from each end, as LongBench
    # a x z z z yzz b: halves "ax" + "yzzb" re-encode as a xy z z b (5 > 4 tokens), so the halves shrink to 1
    assert t.encode("axzzzyzzb") == [2, 4, 6, 6, 6, 0, 3]
    assert truncate_middle(t, "axzzzyzzb", 4) == ("ab", True)


def test_examples_truncate_the_prompt_before_the_chat_template(tok, tmp_path):
    words = " ".join(f"w{i}" for i in range(1500))
    write_jsonl(
        tmp_path,
        "passage_retrieval_en",
        [record("passage_retrieval_en", 0, f"Paragraph 1: {words}", "An abstract.", ["Paragraph 1"])],
    )
    task = LongBenchTask("passage_retrieval_en", tmp_path)
    (full,) = task.examples(tok, 1)
    (ex,) = task.examples(tok, 1, context_length=256)
    prompt = task.prompt(load_longbench("passage_retrieval_en", tmp_path)[0])
    text, _ = truncate_middle(tok, prompt, 256)
    assert ex.info["truncated"] and not full.info["truncated"]
    assert ex.input_ids == render_prompt(tok, text, chat=True) and len(ex.input_ids) < len(full.input_ids) // 4
    decoded = tok.decode(ex.input_ids)
    assert "user\nHere are 30 paragraphs from Wikipedia" in decoded  # the start survives, inside the user turn
    # so does the end
    assert 'like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: <|im_end|>\n<|im_start|>assistant\n' in decoded
    assert task.examples(tok, 1, context_length=10**6) == [full]
    with pytest.raises(ValueError, match="context_length"):
        task.examples(tok, 1, context_length=0)


# ---------------------------------------------------------------------------------------------- metrics


# ---------------------------------------------------------------------------------------------- the hub


def make_data_zip(path: Path) -> Path:
    """A data.zip shaped like the hub's: data/<subset>.jsonl, plus a hostile member name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("data/", "")
        zf.writestr(
            "data/trec.jsonl", json.dumps(record("trec", 0, "ctx", "q", ["City"], all_classes=TREC_CLASSES)) + "\n"
        )
        zf.writestr("data/lcc.jsonl", json.dumps(record("lcc", 0, "x = 1\n", "", ["y = 2"])) + "\n")
        zf.writestr("../../escape.jsonl", "{}\n")
    return path


def test_download_extracts_data_zip_into_the_cache_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "lb"
    monkeypatch.setenv("KVLAB_LONGBENCH_DIR", str(cache))
    archive = make_data_zip(tmp_path / "hub" / "data.zip")
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(archive)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    rows = load_longbench("trec")
    assert calls == [{"repo_id": "THUDM/LongBench", "filename": "data.zip", "repo_type": "dataset"}]
    assert rows[0]["_id"] == "trec-id-0" and rows[0]["answers"] == ["City"]
    # flattened, nothing outside
    assert sorted(p.name for p in cache.iterdir()) == ["escape.jsonl", "lcc.jsonl", "trec.jsonl"]
    assert not (tmp_path / "escape.jsonl").exists() and not (tmp_path / "cache" / "escape.jsonl").exists()
    assert load_longbench("lcc")[0]["answers"] == ["y = 2"] and len(calls) == 1  # already extracted: no second download


def test_offline_download_failure_says_how_to_provide_the_data(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_LONGBENCH_DIR", str(tmp_path / "empty"))

    def offline(**kwargs):
        raise LocalEntryNotFoundError("Cannot reach the Hugging Face Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ValueError) as info:
        load_longbench("qasper")
    message = str(info.value)
    for part in [
        "'qasper'",
        "qasper.jsonl",
        "THUDM/LongBench",
        "data.zip",
        "LocalEntryNotFoundError",
        "unzip",
        "KVLAB_LONGBENCH_DIR",
        "data_dir",
    ]:
        assert part in message, part
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_an_explicit_directory_is_never_downloaded_into(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: pytest.fail("downloaded"))
    with pytest.raises(ValueError, match=r"no musique\.jsonl in .*THUDM/LongBench"):
        load_longbench("musique", tmp_path)

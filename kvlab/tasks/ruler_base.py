"""What every RULER task shares: RULER's metrics (and needle_digits' partial credit), and the task base class that
sizes each example's prompt to the context and finds where its question starts."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from typing import Any

from kvlab.tasks.base import Example, GenerationTask
from kvlab.tasks.haystack import token_position
from kvlab.tasks.sizing import Budget, ContextTooShortError
from kvlab.tokenizer import Tokenizer


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: the share of references found in the prediction, ignoring case."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's metric for qa: 1 when any reference (one of several acceptable answers) is in the prediction."""
    return max(float(r.lower() in prediction.lower()) for r in references)


def needle_digits(prediction: str, references: list[str]) -> float:
    """The share of numeric needles' leading digits reproduced: partial credit where string_match_all gives
    a needle 0 unless every digit is right (a small model often answers "9." or "9294967295" for 9294187).

    A needle found whole in the prediction scores 1, as in string_match_all, so the share is never below the
    exact-match score. Otherwise, with k needles, the prediction's first k numbers (runs of digits, wherever
    they are) are its answers, and the needle scores the longest prefix it shares with one of them, over its
    length; the result is the mean over needles. With one needle: the first number anywhere in the answer.
    Anywhere, because the model wraps or restates its answer (' "3584427".', ': 85.', 'The special magic
    number for bees-ashtrays is: 85321'), which a number-at-the-start rule would score 0. The first k, not the
    best of all numbers, because a degenerate answer ("2018-2023-2024-...") would collect chance prefixes.
    """
    numbers = re.findall(r"[0-9]+", prediction)[: len(references)]
    shares = [
        1.0 if r in prediction else max((len(os.path.commonprefix([n, r])) for n in numbers), default=0) / len(r)
        for r in references
    ]
    return sum(shares) / len(shares)


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def question_of(template: str) -> str:
    """The fixed text opening a template's question: what follows its context, up to the first field."""
    return template.split("{context}")[1].split("{")[0]


class RulerTask(GenerationTask):
    family = "ruler"
    metric = "string_match_all"
    max_new_tokens: int  # RULER's tokens_to_generate
    # the text opening the question after the context (its last occurrence: vt and cwe repeat it in their example)
    question: str

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def examples(
        self,
        tokenizer: Tokenizer,
        num_samples: int,
        seed: int = 0,
        context_length: int | None = None,
        chat: bool = True,
    ) -> list[Example]:
        """Example i depends only on (seed, name, context_length, i), so smaller requests are prefixes of larger
        ones."""
        if context_length is None:
            raise ValueError(f"RULER task {self.name} needs a context_length: its prompts are sized to it")
        budget = Budget(tokenizer, chat, context_length, context_length - self.max_new_tokens)
        out = []
        for i in range(num_samples):
            rng = random.Random(f"{seed}:{self.name}:{context_length}:{i}")
            try:
                input_ids, answers, info = self.generate(budget, rng, i)
            except ContextTooShortError as e:
                raise ContextTooShortError(
                    f"context_length {context_length} is too short for RULER task {self.name}: {e}"
                ) from e
            question_start = token_position(tokenizer, input_ids, self.question, last=True)
            out.append(
                Example(
                    f"{self.name}/{context_length}/{i}", input_ids, answers, self.max_new_tokens, info, question_start
                )
            )
        return out

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        """Prompt token ids, references and info of example `index`, drawing all randomness from `rng`."""
        raise NotImplementedError

    def score(self, prediction: str, example: Example) -> float:
        return METRICS[self.metric](prediction, example.answers)

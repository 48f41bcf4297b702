"""The task interface: examples and documents, and how a task input becomes a prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.tokenizer import Tokenizer


@dataclass
class Example:
    id: str  # stable across runs and sample counts, e.g. "niah_single_2/2048/7"
    input_ids: list[int]  # the whole prompt, chat template and answer prefix included
    answers: list[str]  # references: which must appear, or be matched, depends on the task's metric
    max_new_tokens: int
    info: dict[str, Any] = field(default_factory=dict)  # task-specific facts (e.g. where the needle is)
    # the first token after the context (question, end of turn, answer prefix); None: no split
    question_start: int | None = None


@dataclass
class Document:
    id: str
    input_ids: list[int]
    checkpoints: list[int]  # report perplexity after these many scored tokens (e.g. 500, 1000, ...)


class GenerationTask:
    name: str
    family: str
    metric: str  # the metric's name, for tables

    def examples(
        self,
        tokenizer: Tokenizer,
        num_samples: int,
        seed: int = 0,
        context_length: int | None = None,
        chat: bool = True,
    ) -> list[Example]:
        raise NotImplementedError

    def score(self, prediction: str, example: Example) -> float:
        raise NotImplementedError

    def extra_scores(self, prediction: str, example: Example) -> dict[str, float]:
        """Further per-example metrics in [0, 1], recorded next to the score (RULER's needle_digits)."""
        return {}


class PerplexityTask:
    name: str
    family: str
    metric = "perplexity"

    def documents(self, tokenizer: Tokenizer, num_samples: int, length: int) -> list[Document]:
        raise NotImplementedError


def render_prompt(tokenizer: Tokenizer, text: str, answer_prefix: str = "", chat: bool = True) -> list[int]:
    """Token ids of a task input: in the model's chat template as the user's turn (chat=True), else
    plain text (with BOS when the model wants one); then the answer prefix the model continues from."""
    if chat and tokenizer.chat_template is not None:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    else:
        ids = tokenizer.encode(text, bos=tokenizer.add_bos)
    return ids + (tokenizer.encode(answer_prefix) if answer_prefix else [])

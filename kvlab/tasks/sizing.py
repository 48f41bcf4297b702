"""Prompts sized to a context length: the largest haystack whose prompt fits a token budget (by bisection),
and the shortest context length at which a task can build its examples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.tasks.base import GenerationTask, render_prompt
from kvlab.tokenizer import Tokenizer


class ContextTooShortError(ValueError):
    """The context length cannot hold the task's prompt even with an empty haystack."""


def fit(length: Callable[[int], int], budget: int, hi: int, lo: int = 0) -> int:
    """The largest n in [lo, hi] with length(n) <= budget. Prompt length grows with the haystack size n, so
    bisection costs O(log hi) encodes per example instead of one per haystack unit."""
    shortest = length(lo)
    if shortest > budget:
        raise ContextTooShortError(f"the shortest prompt takes {shortest} tokens, over the {budget} available")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def minimum_context_length(
    task: GenerationTask, tokenizer: Tokenizer, num_samples: int, seed: int, chat: bool, too_short: int, limit: int
) -> int | None:
    """The smallest context length in (too_short, limit] at which `task` builds its first `num_samples`
    examples, or None when even `limit` is too short. Examples are drawn per context length, so fitting
    need not grow monotonically with it: doubling, then bisection, finds a length that fits and whose
    predecessor does not."""

    def fits(context_length: int) -> bool:
        try:
            task.examples(tokenizer, num_samples, seed, context_length, chat)
        except ContextTooShortError:
            return False
        return True

    lo, hi = too_short, min(2 * too_short, limit)
    while not fits(hi):
        if hi == limit:
            return None
        lo, hi = hi, min(2 * hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@dataclass
class Budget:
    """What one example is built for: its tokenizer and prompt style, and the tokens its prompt may take."""

    tokenizer: Tokenizer
    chat: bool
    context_length: int
    tokens: int

    def render(self, text: str, answer_prefix: str) -> list[int]:
        return render_prompt(self.tokenizer, text, answer_prefix, self.chat)

    def fill(self, text: Callable[[int], str], answer_prefix: str, hi: int, lo: int = 0) -> tuple[int, list[int]]:
        """The largest haystack size n in [lo, hi] whose prompt fits, and that prompt's token ids."""
        n = fit(lambda n: len(self.render(text(n), answer_prefix)), self.tokens, hi, lo)
        return n, self.render(text(n), answer_prefix)

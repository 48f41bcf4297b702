"""The needle-in-a-haystack grid (Kamradt's test, worded as RULER's niah_single_2): one seven-digit number hidden in
the Paul Graham essays at a fixed depth, one task per depth (`needle_depth_0` ... `needle_depth_100`, family
`needle`), so one sweep over methods and ratios fills the usual depth x ratio picture (scripts/needle_heatmap.py).

A prompt fills the context as RULER's do, its needle `depth` percent of the way through the haystack's sentences;
the score is RULER's string_match_all (1 when the number is in the answer), with needle_digits beside it."""

from __future__ import annotations

from kvlab.tasks.base import GenerationTask
from kvlab.tasks.ruler import NeedleInAHaystack

DEPTHS = tuple(range(0, 101, 10))  # percent of the haystack before the needle


class NeedleAtDepth(NeedleInAHaystack):
    """niah_single_2 with its needle at `depth` percent of the haystack in every example."""

    family = "needle"

    def __init__(self, depth: int) -> None:
        super().__init__(f"needle_depth_{depth}", "essay", depth=depth)


TASKS: dict[str, GenerationTask] = {t.name: t for t in (NeedleAtDepth(d) for d in DEPTHS)}

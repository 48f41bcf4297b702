"""Evaluation tasks, by name and by family (`eval.py --tasks niah_single_2 ruler needle book`).

Two kinds:
- a `GenerationTask` yields `Example`s (a prompt as token ids, reference answers, a generation
  budget) and scores a model's answer against them, from 0 to 1;
- a `PerplexityTask` yields `Document`s (long token sequences) that eval.py decodes token by token
  *through the compressed cache*, so eviction decisions change the loss.

Examples are deterministic per (seed, index), independent of how many are asked for: the first n of
a larger request are the same n examples (nested samples), so runs with different --num_samples share
their common examples.
"""

from __future__ import annotations

from kvlab.tasks import book, longbench, needle, ruler
from kvlab.tasks.base import Document, Example, GenerationTask, PerplexityTask, render_prompt

__all__ = ["Document", "Example", "GenerationTask", "PerplexityTask", "all_tasks", "render_prompt", "resolve_tasks"]


def all_tasks() -> dict[str, GenerationTask | PerplexityTask]:
    """Every task by name."""
    return {**ruler.TASKS, **needle.TASKS, **longbench.TASKS, **book.TASKS}


def resolve_tasks(names: list[str]) -> list[GenerationTask | PerplexityTask]:
    """Task names, family names (ruler, needle, longbench, book) or `all`, in the order given, without repeats."""
    tasks = all_tasks()
    families = sorted({t.family for t in tasks.values()})
    chosen: dict[str, GenerationTask | PerplexityTask] = {}
    for name in names:
        if name == "all":
            chosen |= tasks
        elif name in families:
            chosen |= {n: t for n, t in tasks.items() if t.family == name}
        elif name in tasks:
            chosen[name] = tasks[name]
        else:
            raise ValueError(
                f"unknown task {name!r}; choose task names, a family ({', '.join(families)}) or all; tasks: "
                f"{', '.join(tasks)}"
            )
    return list(chosen.values())

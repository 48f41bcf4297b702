"""A sweep's unit of work: one task at one context length with all its (config, size) jobs, cut into batches
of the same width; and a job's metrics from its finished examples."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvlab.config import CacheSpec
from kvlab.jobs import Job
from kvlab.tasks import GenerationTask, PerplexityTask


def batch_width(batch_size: int, examples: int, ranks: int) -> int:
    """A task's rows per batch: --batch_size, or a rank's share of the task's examples if that is less, so a
    task with few examples decodes no copies of them."""
    return min(batch_size, -(-examples // ranks))


@dataclass
class Group:
    """One task at one context length with all its (config, size) jobs: they share each batch of its
    examples, and in generation tasks the batch's prefill."""

    task: GenerationTask | PerplexityTask
    examples: list[Any]  # Examples, or a perplexity task's Documents
    runs: list[tuple[Job, CacheSpec]]  # each job with its cache spec
    done: dict[Job, dict[str, dict[str, Any]]]  # each job's finished examples by id, from every rank's file
    width: int  # a batch's rows, the same in every batch so shapes stay static (batch_width)

    def todo(self) -> list[Any]:
        """The examples some job still misses, in order."""
        return [e for e in self.examples if any(e.id not in self.done[job] for job, _ in self.runs)]

    def batches(self) -> Iterator[list[Any]]:
        """The examples still to do, `width` at a time (the last batch may hold fewer)."""
        todo = self.todo()
        for start in range(0, len(todo), self.width):
            yield todo[start : start + self.width]

    def padded(self, batch: list[Any]) -> list[Any]:
        """`batch` filled to `width` rows with copies of its last example, whose results are dropped."""
        return batch + batch[-1:] * (self.width - len(batch))

    def pending(self, batch: list[Any]) -> list[tuple[Job, CacheSpec]]:
        """The runs missing one of `batch`'s examples."""
        return [(job, spec) for job, spec in self.runs if any(e.id not in self.done[job] for e in batch)]


def summarize_job(task: GenerationTask | PerplexityTask, records: list[dict[str, Any]]) -> dict[str, Any]:
    """A task's metrics from its examples: mean score (x100) and needle digits (%), or perplexity over all scored
    tokens."""
    metrics: dict[str, Any] = dict(
        metric=task.metric, n=len(records), compression=sum(r["compression"] for r in records) / len(records)
    )
    if isinstance(task, PerplexityTask):
        metrics["value"] = math.exp(sum(r["nll_sum"] for r in records) / sum(r["tokens"] for r in records))
        metrics["checkpoints"] = {
            c: sum(r["checkpoints"][c] for r in records) / len(records) for c in records[0]["checkpoints"]
        }
    else:
        metrics["value"] = 100 * sum(r["score"] for r in records) / len(records)
        if all("needle_digits" in r for r in records):  # RULER's numeric needles, in % as the score
            metrics["needle_digits"] = 100 * sum(r["needle_digits"] for r in records) / len(records)
    for key in ("attention_loss", "topb_recall"):  # with --attention_metrics
        if all(key in r for r in records):
            metrics[key] = sum(r[key] for r in records) / len(records)
    metrics["seconds"] = sum(r["seconds"] for r in records)
    return metrics

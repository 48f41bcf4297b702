"""What the eval.py tests share: a task that needs no data, a small sweep run in-process, and readers of
the records and metrics it writes."""

from __future__ import annotations

import eval as kv_eval
from kvlab import evaluate
from kvlab.results import RECORDS, config_dirs, read_config_records, read_records, read_runs
from kvlab.tasks import Example, GenerationTask

M = "SmolLM2-135M-Instruct"


def use_echo_task(monkeypatch) -> None:
    """Both the CLI (which plans the jobs) and the harness (which runs them) resolve task names."""
    for module in (kv_eval, evaluate):
        monkeypatch.setattr(module, "resolve_tasks", lambda names: [EchoTask()])


class EchoTask(GenerationTask):
    """A generation task needing no data: score 1 when the answer contains the prompt's last word."""

    name, family, metric = "echo", "test", "contains"

    def examples(self, tokenizer, num_samples, seed=0, context_length=None, chat=True):
        words = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano"]
        return [
            Example(
                f"echo/{i}",
                tokenizer.encode(
                    f"Here is a word to remember for later, so please repeat it exactly once: {words[i % len(words)]}."
                ),
                [words[i % len(words)]],
                4,
            )
            for i in range(num_samples)
        ]

    def score(self, prediction, example):
        return float(example.answers[0] in prediction.lower())


def run_eval(tmp_path, *extra):
    kv_eval.main(["--out_dir", str(tmp_path), "--context_lengths", "64", "--batch_size", "2", *extra])


def job_records(config_dir, run: str, job: str) -> list[dict]:
    """One job's records in the config's records.jsonl, in file order."""
    return [r for r in read_records(config_dir / RECORDS) if (r["run"], r["job"]) == (run, job)]


def task_metrics(config_dir, run: str, job: str) -> dict:
    return read_runs(config_dir)[run]["tasks"][job]


def jobs_under(out_dir) -> list[tuple[str, str, str]]:
    """(config directory, run, job) of every job with records under out_dir."""
    return sorted(
        (d.relative_to(out_dir).as_posix(), *key) for d in config_dirs(out_dir) for key in read_config_records(d)
    )


KJV = ["--tasks", "book_kjv", "--cache_config", "full", "--num_samples", "1", "--context_lengths", "32"]

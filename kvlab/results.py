"""Results on disk, one directory per model and cache config: records.jsonl, one JSON line per finished example of
any of the config's runs (appended and synced as it finishes, so an interrupted sweep resumes where it stopped), and
runs.json, each run's settings and finished tasks' metrics; summaries over every finished task of a results
directory."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import math
import os
import shutil
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FULL = "full"


@contextlib.contextmanager
def removed_unless_results(out_dir: Path) -> Iterator[None]:
    """A results directory this run creates is removed again if the run stops before any example is
    recorded (a refused setting, Ctrl-C while starting): nothing is left behind. Once a record exists
    it stays, so the same command resumes."""
    new = not out_dir.exists()
    try:
        yield
    except BaseException:
        if new and out_dir.is_dir() and not any(out_dir.rglob("*.jsonl")):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


RECORDS = "records.jsonl"  # <out_dir>/<model>/<config>/records.jsonl: every example of every run of the config
RUNS = "runs.json"  # beside it: each run's settings ("args") and its finished tasks' metrics ("tasks")
RUN_FIELDS = ("run", "job", "id")  # every record names its run (size+flags), its job (task@ctx) and its example


@contextlib.contextmanager
def locked_out_dir(out_dir: Path):
    """Create --out_dir and hold an exclusive lock on it for the run: two sweeps writing one directory would interleave
    records."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out_dir {out_dir} is a file, not a directory; choose a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = (out_dir / ".lock").open("a")
    except OSError as e:
        raise ValueError(f"--out_dir {out_dir} is not writable ({e.strerror}); choose a writable directory") from None
    with lock:
        if not os.access(out_dir, os.W_OK):
            raise ValueError(f"--out_dir {out_dir} is not writable; choose a writable directory")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"another eval.py is writing to {out_dir}; wait for it, or choose another --out_dir"
            ) from None
        yield


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one .jsonl in order; a last line cut short by a kill is dropped (and redone). Any other line
    that is not a JSON record with a run, a job and an id is an error: the file is not one this harness wrote."""
    records = []
    lines = path.read_text().splitlines() if path.exists() else []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # torn by a kill mid-write
            raise ValueError(
                f"{path} line {number}: not a JSON record ({line[:60]!r}); fix or remove the line, or the file, "
                "to redo it"
            ) from None
        if not isinstance(record, dict) or any(k not in record for k in RUN_FIELDS):
            raise ValueError(
                f"{path} line {number}: a record without {', '.join(RUN_FIELDS)} ({line[:60]!r}); fix or remove "
                "the line, or the file, to redo it"
            )
        records.append(record)
    return records


def rank_file(config_dir: Path, rank: int, world: int) -> Path:
    """The .jsonl one process appends to: the config's records.jsonl in a sweep run by one process,
    records.rank<r>.jsonl beside it when `world` processes share the sweep (one writer per file)."""
    return config_dir / (RECORDS if world == 1 else f"records.rank{rank}.jsonl")


def config_dirs(out_dir: Path) -> list[Path]:
    """The <model>/<config> directories under out_dir that hold records, in order."""
    return sorted({p.parent for p in out_dir.glob("*/*/records*.jsonl")})


def read_config_records(config_dir: Path) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """A config's finished examples by (run, job) and id, from records.jsonl and every rank's file beside it, whatever
    the number of processes that wrote them, so a sweep resumes with any number of ranks."""
    jobs: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for path in [config_dir / RECORDS, *sorted(config_dir.glob("records.rank*.jsonl"))]:
        for record in read_records(path):
            jobs[record["run"], record["job"]][record["id"]] = record
    return jobs


def rewrite_complete_lines(path: Path) -> None:
    """Drop a torn last line before appending, so the file stays one JSON object per line. Replaced in one
    step: another rank may be reading the file for its own resume."""
    records = read_records(path)
    if path.exists() and len(path.read_text().splitlines()) != len(records):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(path)


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_runs(config_dir: Path) -> dict[str, dict[str, Any]]:
    """A config's runs.json: {run: {"args": the run's settings, "tasks": {job: metrics}}}, refused in one line when
    damaged."""
    path = config_dir / RUNS
    if not path.exists():
        return {}
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); remove it, or choose another --out_dir") from None
    if not isinstance(runs, dict) or not all(isinstance(r, dict) for r in runs.values()):
        raise ValueError(f"{path}: not a JSON object of runs; remove it, or choose another --out_dir")
    return runs


def write_runs(config_dir: Path, runs: dict[str, dict[str, Any]]) -> None:
    """runs.json replaced in one step, runs and tasks in sorted order (a stable diff)."""
    ordered = {run: {**runs[run], "tasks": dict(sorted(runs[run].get("tasks", {}).items()))} for run in sorted(runs)}
    tmp = config_dir / (RUNS + ".tmp")
    tmp.write_text(json.dumps(ordered, indent=1) + "\n")
    tmp.replace(config_dir / RUNS)


TASK_METRICS = ("metric", "value", "n", "compression")  # every finished task's metrics hold them


def checked_task_metrics(where: str, metrics: Any) -> dict[str, Any]:
    """A finished task's metrics from runs.json, refused in one line when incomplete."""
    missing = [k for k in TASK_METRICS if not isinstance(metrics, dict) or k not in metrics]
    if missing:
        raise ValueError(
            f"{where}: no {', '.join(missing)}; remove that task from it and rerun the same command to "
            "recompute the task"
        )
    return metrics


def finished_tasks(out_dir: Path) -> Iterator[tuple[Path, str, str, dict[str, Any]]]:
    """(runs.json, run, job, metrics) of every finished task under out_dir, in order."""
    for path in sorted(out_dir.glob(f"*/*/{RUNS}")):
        for run, entry in read_runs(path.parent).items():
            for job, metrics in entry.get("tasks", {}).items():
                yield path, run, job, checked_task_metrics(f"{path} {run} {job}", metrics)


def write_summary(out_dir: Path) -> list[dict[str, Any]]:
    """summary.csv and summary.md over every finished task in out_dir, each score also relative to the
    full cache of the same model, task and context length."""
    rows = []
    for path, run, job, metrics in finished_tasks(out_dir):
        model_name, config = path.parts[-3:-1]
        size, *flags = run.split("+")  # "ratio0.5+query_agnostic+prefill_chunk512"
        chunk = next((int(f.removeprefix("prefill_chunk")) for f in flags if f.startswith("prefill_chunk")), None)
        task, ctx = job.split("@")
        rows.append(
            dict(
                model=model_name,
                config=config,
                size=size,
                query_agnostic="query_agnostic" in flags,
                prefill_chunk=chunk,
                task=task,
                context_length=int(ctx),
                **{k: metrics[k] for k in ("metric", "value")},
                needle_digits=metrics.get("needle_digits"),
                **{k: metrics[k] for k in ("n", "compression")},
                **{k: metrics.get(k) for k in ("attention_loss", "topb_recall")},
            )
        )
    full = {(r["model"], r["task"], r["context_length"]): r["value"] for r in rows if r["size"] == FULL}
    for r in rows:
        reference = full.get((r["model"], r["task"], r["context_length"]))
        r["relative_to_full"] = r["value"] / reference if reference else None
    if rows:
        with (out_dir / "summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (out_dir / "summary.md").write_text(markdown_table(rows))
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows: task@context (metric); columns: config@size (+query_agnostic, +prefill_chunkN); cells: value (relative to
    full), and the needle digits reproduced (%) where recorded."""

    def column(r: dict[str, Any]) -> str:
        chunk = f"+prefill_chunk{r['prefill_chunk']}" if r.get("prefill_chunk") else ""
        return f"{r['config']}@{r['size']}" + ("+query_agnostic" if r.get("query_agnostic") else "") + chunk

    columns = list(dict.fromkeys(column(r) for r in rows))
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    for r in rows:
        relative = "" if r["relative_to_full"] is None or r["size"] == FULL else f" ({r['relative_to_full']:.2f})"
        digits = "" if r["needle_digits"] is None else f", digits {r['needle_digits']:.1f}%"
        cells[f"{r['task']}@{r['context_length']} ({r['metric']}, n={r['n']})"][column(r)] = (
            f"{r['value']:.2f}{relative}{digits}"
        )
    lines = ["| task | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(values.get(c, "") for c in columns) + " |" for name, values in cells.items()]
    return "\n".join(lines) + "\n"


def paired_difference(before: list[float], after: list[float]) -> dict[str, float]:
    """Two runs' per-example values on the same examples: each mean, the mean paired difference (after - before)
    and its standard error, all x100 (scores 0-1 read as 0-100)."""
    diffs = [a - b for b, a in zip(before, after, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {
        "before": 100 * statistics.fmean(before),
        "after": 100 * statistics.fmean(after),
        "diff": 100 * statistics.fmean(diffs),
        "se": 100 * se,
    }

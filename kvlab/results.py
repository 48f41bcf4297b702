"""Results on disk: one JSON line per finished example (appended and synced as it finishes, so an
interrupted sweep resumes where it stopped), and summaries over every finished task of a results directory."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
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


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """Finished examples of a .jsonl by id; a last line cut short by a kill is dropped (and redone). Any
    other line that is not a JSON record with an "id" is an error: the file is not one this harness wrote."""
    records = {}
    if path.exists():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    continue  # torn by a kill mid-write
                raise ValueError(f"{path} line {number}: not a JSON record ({line[:60]!r}); fix or remove the line, or the file, to redo it") from None
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f'{path} line {number}: a record with no "id" ({line[:60]!r}); fix or remove the line, or the file, to redo it')
            records[record["id"]] = record
    return records


def rank_file(path: Path, rank: int, world: int) -> Path:
    """The .jsonl one process appends a job's records to: the job's `path` itself in a sweep run by one
    process, `<task>@<ctx>.rank<r>.jsonl` beside it when `world` processes share the sweep (one writer per file)."""
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}.jsonl")


def read_job_records(path: Path) -> dict[str, dict[str, Any]]:
    """A job's finished examples from its `path` and every rank's file beside it, whatever the number of
    processes that wrote them, so a sweep resumes with any number of ranks."""
    records = read_records(path)
    for part in sorted(path.parent.glob(f"{path.stem}.rank*.jsonl")):
        records |= read_records(part)
    return records


def rewrite_complete_lines(path: Path, records: dict[str, dict[str, Any]]) -> None:
    """Drop a torn last line before appending, so the file stays one JSON object per line. Replaced in one
    step: another rank may be reading the file for its own resume."""
    if path.exists() and len(path.read_text().splitlines()) != len(records):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
        tmp.replace(path)


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


TASK_METRICS = ("metric", "value", "n", "compression")  # every task@ctx.json holds them


def read_task_metrics(path: Path) -> dict[str, Any]:
    """A finished task's metrics file, refused in one line when damaged or incomplete."""
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it and rerun the same command to recompute the task") from None
    missing = [k for k in TASK_METRICS if not isinstance(metrics, dict) or k not in metrics]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}; delete it and rerun the same command to recompute the task")
    return metrics


def write_summary(out_dir: Path) -> list[dict[str, Any]]:
    """summary.csv and summary.md over every finished task in out_dir, each score also relative to the
    full cache of the same model, task and context length."""
    rows = []
    for path in sorted(out_dir.glob("*/*/*/*@*.json")):
        model_name, config, run = path.parts[-4:-1]
        size, *flags = run.split("+")  # "ratio0.5+query_agnostic+prefill_chunk512"
        chunk = next((int(f.removeprefix("prefill_chunk")) for f in flags if f.startswith("prefill_chunk")), None)
        task, ctx = path.stem.split("@")
        metrics = read_task_metrics(path)
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
    """Rows: task@context (metric); columns: config@size (+query_agnostic, +prefill_chunkN); cells: value (relative to full),
    and the needle digits reproduced (%) where recorded."""

    def column(r: dict[str, Any]) -> str:
        chunk = f"+prefill_chunk{r['prefill_chunk']}" if r.get("prefill_chunk") else ""
        return f"{r['config']}@{r['size']}" + ("+query_agnostic" if r.get("query_agnostic") else "") + chunk

    columns = list(dict.fromkeys(column(r) for r in rows))
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    for r in rows:
        relative = "" if r["relative_to_full"] is None or r["size"] == FULL else f" ({r['relative_to_full']:.2f})"
        digits = "" if r["needle_digits"] is None else f", digits {r['needle_digits']:.1f}%"
        cells[f"{r['task']}@{r['context_length']} ({r['metric']}, n={r['n']})"][column(r)] = f"{r['value']:.2f}{relative}{digits}"
    lines = ["| task | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(values.get(c, "") for c in columns) + " |" for name, values in cells.items()]
    return "\n".join(lines) + "\n"

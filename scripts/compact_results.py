"""Rewrite eval.py results kept one directory per run (<model>/<config>/<size>/ with args.json, <task>@<ctx>.jsonl
records, rank files and <task>@<ctx>.json metrics) into the compact form eval.py writes and resumes: one records.jsonl
and one runs.json per <model>/<config> (kvlab/results.py). Nothing is lost: every record gains its run and job names.

    python scripts/compact_results.py results docs/sweeps/*
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from kvlab.cli import ArgumentParser, run_cli
from kvlab.results import RECORDS, append_record, read_runs, write_runs

RANK = re.compile(r"\.rank\d+$")


def old_records(path: Path) -> list[dict[str, Any]]:
    """A run directory's .jsonl lines (a line torn by a kill is dropped, as eval.py would redo it)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def compact_run(run_dir: Path, runs: dict[str, dict[str, Any]]) -> None:
    """One run directory's settings and metrics into `runs`, its records appended to the config's records.jsonl."""
    run = run_dir.name
    if run in runs:
        raise ValueError(f"{run_dir}: its config's runs.json already holds run {run!r}; keep one of the two")
    entry: dict[str, Any] = {"tasks": {}}
    if (run_dir / "args.json").exists():
        entry["args"] = json.loads((run_dir / "args.json").read_text())
        key = entry["args"].get("key")
        # older runs stored the checkpoint's full path
        if isinstance(key, dict) and isinstance(key.get("checkpoint"), str):
            key["checkpoint"] = Path(key["checkpoint"]).name
    by_job: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(run_dir.glob("*@*.jsonl")):
        by_job.setdefault(RANK.sub("", path.stem), {}).update({r["id"]: r for r in old_records(path)})
    for job, records in sorted(by_job.items()):
        for record in records.values():
            append_record(run_dir.parent / RECORDS, {"run": run, "job": job, **record})
    for path in sorted(run_dir.glob("*@*.json")):
        entry["tasks"][path.stem] = json.loads(path.read_text())
    runs[run] = entry


def compact(out_dir: Path) -> int:
    """Every run directory under out_dir compacted; returns how many."""
    count = 0
    for config_dir in sorted(
        {p.parent.parent for p in out_dir.glob("*/*/*/args.json")}
        | {p.parent.parent for p in out_dir.glob("*/*/*/*@*.jsonl")}
    ):
        runs = read_runs(config_dir)
        for run_dir in sorted(d for d in config_dir.iterdir() if d.is_dir()):
            compact_run(run_dir, runs)
            count += 1
        write_runs(config_dir, runs)
        for run_dir in sorted(d for d in config_dir.iterdir() if d.is_dir()):
            shutil.rmtree(run_dir)
    return count


def run(args: argparse.Namespace) -> None:
    for out_dir in args.out_dirs:
        if not out_dir.is_dir():
            raise ValueError(f"no directory {out_dir}: give eval.py --out_dir directories")
        print(f"{out_dir}: {compact(out_dir)} run directories compacted")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", type=Path, nargs="+", help="eval.py --out_dir directories")
    run_cli(run, p.parse_args(argv))


if __name__ == "__main__":
    main()

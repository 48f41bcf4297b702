"""Chunked prefill against one-shot prefill on the same examples: for every run directory of an eval.py sweep
made with --prefill_chunk N (`<size>+prefill_chunkN`) and its one-shot twin (`<size>`), the mean score of each,
their paired difference (chunked - one-shot) and its standard error over the examples both finished.

    python eval.py --tasks niah_single_2 --cache_config keydiff --compression_ratios 0.5 --query_agnostic \\
        --out_dir results/chunked
    python eval.py --tasks niah_single_2 --cache_config keydiff --compression_ratios 0.5 --query_agnostic \\
        --out_dir results/chunked --prefill_chunk 512
    python scripts/chunked_vs_oneshot.py results/chunked

Writes chunked_vs_oneshot.md and .json into the sweep's directory. Scores are 0-100 (the task's own per-example
score); RULER's needle tasks also get the share of the needle's digits reproduced.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvlab.cli import ArgumentParser, run_cli
from kvlab.jobs import CHUNKED
from kvlab.results import config_dirs, paired_difference, read_config_records

MEASURES = ("score", "needle_digits")


def comparisons(out_dir: Path) -> list[dict[str, Any]]:
    """One row per (config, size, chunk, task@context, measure) with examples in both runs."""
    rows = []
    for config_dir in config_dirs(out_dir):
        records = read_config_records(config_dir)
        for (run, task), chunked in sorted(records.items()):
            if CHUNKED not in run:
                continue
            size, _, chunk = run.partition(CHUNKED)
            oneshot = records.get((size, task), {})
            ids = sorted(set(chunked) & set(oneshot))
            for measure in MEASURES:
                if ids and all(measure in chunked[i] and measure in oneshot[i] for i in ids):
                    values = paired_difference([oneshot[i][measure] for i in ids], [chunked[i][measure] for i in ids])
                    rows.append(
                        {
                            "config": config_dir.name,
                            "size": size,
                            "chunk": int(chunk),
                            "task": task,
                            "measure": measure,
                            "n": len(ids),
                            "oneshot": values["before"],
                            "chunked": values["after"],
                            "diff": values["diff"],
                            "se": values["se"],
                        }
                    )
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| task | config | size | chunk | measure | n | one-shot | chunked | chunked - one-shot (SE) |",
        "|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["task"], r["measure"], r["size"], r["config"])):
        cells = [
            r["task"],
            r["config"],
            r["size"],
            r["chunk"],
            r["measure"],
            r["n"],
            f"{r['oneshot']:.1f}",
            f"{r['chunked']:.1f}",
            f"{r['diff']:+.1f} ({r['se']:.1f})",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def report(args) -> None:
    if not args.out_dir.is_dir():
        raise ValueError(f"{args.out_dir}: no such directory; give an eval.py --out_dir")
    rows = comparisons(args.out_dir)
    if not rows:
        raise ValueError(f"{args.out_dir}: no --prefill_chunk run with a one-shot twin holding the same examples")
    (args.out_dir / "chunked_vs_oneshot.md").write_text("\n".join(markdown(rows)) + "\n")
    (args.out_dir / "chunked_vs_oneshot.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(markdown(rows)))


def main() -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="an eval.py --out_dir holding one-shot and --prefill_chunk runs")
    run_cli(report, p.parse_args())


if __name__ == "__main__":
    main()

"""The share of the needle's leading digits reproduced (`needle_digits`, kvlab/tasks/ruler_base.py), recomputed
from the predictions stored in eval.py results, for every RULER task with numeric needles.

    python scripts/needle_digits.py docs/sweeps/smollm2_2k docs/sweeps/smollm2_4k

eval.py records the metric per example and averages it in summary.csv; this script recomputes it for
results written before it did (docs/sweeps), and prints one table per results directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sweep_tables import run_metrics  # scripts/ is on the path

from kvlab.cli import ArgumentParser, run_cli
from kvlab.results import config_dirs, read_config_records


def table(results: Path) -> str:
    """One row per config, run and task with numeric needles: examples, exact-match score and needle digits, in %."""
    lines = ["| model | config | size | task | n | score | needle digits (%) |", "|---|---|---|---|---|---|---|"]
    for config_dir in config_dirs(results):
        for (run, job), by_id in sorted(read_config_records(config_dir).items()):
            metrics = run_metrics(list(by_id.values()), job) if by_id else {}
            if "digits" in metrics:
                model_name, config = config_dir.parts[-2:]
                lines.append(
                    f"| {model_name} | {config} | {run} | {job} | {len(by_id)} | {metrics['score']:.0f} | "
                    f"{metrics['digits']:.1f} |"
                )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    for results in args.results:
        if not results.is_dir():
            raise ValueError(f"no directory {results}: give eval.py --out_dir directories")
        print(f"{results}:\n\n{table(results)}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="eval.py --out_dir directories")
    run_cli(run, p.parse_args(argv))


if __name__ == "__main__":
    main()

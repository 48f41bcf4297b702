"""Plot eval.py results: score against compression ratio, one panel per task, one line per cache config.

    python scripts/plot.py results/            # writes results/plot.png
    python scripts/plot.py results/ --out docs/results.png

Reads <results>/summary.csv (written by eval.py). The full cache is the dashed line at 1x; each
compressing config is a line through its cache sizes, at the compression it actually reached.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

from kvlab.cli import ArgumentParser, run_cli

COLUMNS = ("config", "task", "context_length", "metric", "value", "compression")


def read_summary(summary: Path) -> list[dict[str, str]]:
    """summary.csv's rows, checked: every column the plot reads, numbers where it needs numbers."""
    if not summary.is_file():
        raise ValueError(f"no {summary}: run eval.py first (it writes summary.csv into its --out_dir)")
    with summary.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{summary}: missing column(s) {', '.join(missing)} (has: "
                f"{', '.join(reader.fieldnames or []) or 'nothing'}); rerun eval.py to rewrite it"
            )
        rows = list(reader)
    for line, r in enumerate(rows, 2):
        for column in ("value", "compression"):
            try:
                number = float(r[column])
            except (TypeError, ValueError):
                raise ValueError(f"{summary} line {line}: {column} {r[column]!r} is not a number") from None
            if not math.isfinite(number) or (column == "compression" and number <= 0):
                raise ValueError(
                    f"{summary} line {line}: {column} {r[column]!r} cannot be plotted (a finite "
                    f"number{', > 0' if column == 'compression' else ''})"
                )
    if not rows:
        raise ValueError(f"{summary} has no rows: no finished task to plot")
    return rows


def plot(summary: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_summary(summary)
    panels = sorted({(r["task"], r["context_length"], r["metric"]) for r in rows})
    configs = sorted({r["config"] for r in rows} - {"full"})
    colors = {c: plt.get_cmap("tab20")(i % 20) for i, c in enumerate(configs)}  # one colour per config in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (task, ctx, metric) in zip(axes[0], panels, strict=True):
        lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rows:
            if (r["task"], r["context_length"], r["metric"]) == (task, ctx, metric):
                lines[r["config"]].append((float(r["compression"]), float(r["value"])))
        for config, points in sorted(lines.items()):
            points.sort()
            if config == "full":
                ax.axhline(points[0][1], color="black", linestyle="--", label="full")
            else:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config, color=colors[config])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task} @ {ctx} tokens")
        ax.set_xlabel("compression (sequence / tokens held)")
        ax.set_ylabel(metric)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "results", type=Path, nargs="?", default=Path("results"), help="eval.py --out_dir (default: results/)"
    )
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: <results>/plot.png)")
    args = p.parse_args(argv)
    run_cli(lambda a: plot(a.results / "summary.csv", a.out or a.results / "plot.png"), args)


if __name__ == "__main__":
    main()

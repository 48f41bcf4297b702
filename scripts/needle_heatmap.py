"""Where each method loses the needle: the needle-in-a-haystack grid (one number hidden in the essays at depths 0%
to 100%, kvlab/tasks/needle.py) at one context length, every method at each compression ratio, drawn as the usual
heatmap, one picture per method: depth down, compression ratio across (the full cache's column first), the share
of examples whose answer holds the needle in each cell.

    python scripts/needle_heatmap.py --context_length 8192 --processes 2
    python scripts/needle_heatmap.py --methods kvzip snapkv --ratios 0.75 --depths 0 50 100 --num_samples 1

The runs are ordinary eval.py sweeps under --out_dir (resumable: rerun the command after an interruption), as
scripts/leaderboard.py runs them; this script then writes needle.md and needle.json there ({method: {protocol:
{ratio: {depth: score}}}}) and needle_<k>k_<method>.png under --figures_dir.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from leaderboard import (  # scripts/ is on the path
    SUMMARY_COLUMNS,
    add_eval_flags,
    checked_ratio,
    protocol_cell,
    summary_rows,
    swept_summary,
)

from kvlab.cli import ArgumentParser, positive_int, run_cli
from kvlab.jobs import PROTOCOLS as MODES
from kvlab.results import FULL
from kvlab.tasks.needle import DEPTHS

# the six: the full cache, the best oracle (steered by the reference answer), the leading methods
METHODS = ("configs/eval/oracle_reference.yaml", "kvzip", "snapkv", "ada_expected_attention", "duo_attention")
RATIOS = ("0.5", "0.75", "0.875")
Grid = dict[str, dict[str, dict[str, dict[int, float]]]]  # method -> protocol -> ratio -> depth -> score


def depth(text: str) -> int:
    """A depth of the grid (a percentage among kvlab.tasks.needle.DEPTHS)."""
    if not text.isdigit() or int(text) not in DEPTHS:
        raise argparse.ArgumentTypeError(f"depth {text!r} is not one of the grid's: {' '.join(map(str, DEPTHS))}")
    return int(text)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        help=f"cache configs (names in configs/ or YAML paths), beside the full cache (default: {' '.join(METHODS)})",
    )
    p.add_argument(
        "--ratios", nargs="+", type=checked_ratio, default=list(RATIOS), help=f"(default: {' '.join(RATIOS)})"
    )
    p.add_argument(
        "--depths",
        nargs="+",
        type=depth,
        default=list(DEPTHS),
        help=f"needle depths in percent (default: {' '.join(map(str, DEPTHS))})",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=["query_agnostic"],
        help="protocols (default: query_agnostic, kvpress's: the haystack compressed before the question is seen)",
    )
    p.add_argument("--context_length", type=int, default=8192, help="prompt tokens with the answer (default: 8192)")
    p.add_argument("--num_samples", type=positive_int, default=2, help="examples per depth (default: 2)")
    p.add_argument(
        "--out_dir", type=Path, default=Path("results/needle"), help="results directory (default: results/needle)"
    )
    p.add_argument("--figures_dir", type=Path, default=None, help="where the pictures go (default: --out_dir)")
    p.add_argument("--table_only", action="store_true", help="only (re)write the tables and pictures from --out_dir")
    add_eval_flags(p)
    return p


def grid(summary: Path, context_length: int, methods: list[str], depths: list[int]) -> Grid:
    """Each method's score (percent) by protocol, ratio and depth from eval.py's summary.csv; the full cache under
    ratio "0" of both protocols."""
    names = {FULL, *(Path(m).stem for m in methods)}
    tasks = {f"needle_depth_{d}": d for d in depths}
    out: Grid = defaultdict(lambda: defaultdict(dict))
    for r in summary_rows(summary, (*SUMMARY_COLUMNS, "task")):
        if r["config"] not in names or r["task"] not in tasks or int(r["context_length"]) != context_length:
            continue
        ratio, modes = protocol_cell(r) or ("", [])
        for mode in modes:
            out[r["config"]][mode].setdefault(ratio, {})[tasks[r["task"]]] = float(r["value"])
    return {m: dict(v) for m, v in out.items()}


def columns(table: Grid, method: str, mode: str) -> list[str]:
    """A picture's ratios: the full cache's first, then the method's, ascending."""
    mine = sorted((x for x in table.get(method, {}).get(mode, {}) if x != "0"), key=float)
    return (["0"] if "0" in table.get(FULL, {}).get(mode, {}) else []) + mine


def cell(table: Grid, method: str, mode: str, ratio: str, at: int) -> float | None:
    source = FULL if ratio == "0" else method
    return table.get(source, {}).get(mode, {}).get(ratio, {}).get(at)


def markdown(table: Grid, methods: list[str], depths: list[int]) -> str:
    """Per protocol: one row per (method, ratio), the score at each depth and the mean over depths."""
    out = []
    for mode in MODES:
        rows = [(m, x) for m in [FULL, *methods] for x in columns(table, m, mode) if m == FULL or x != "0"]
        if not any(m != FULL for m, _ in rows):
            continue
        out += [
            f"**{mode}** (share of examples whose answer holds the needle, percent; depth in % of the haystack)",
            "",
        ]
        out += ["| method | ratio | " + " | ".join(f"{d}%" for d in depths) + " | mean |"]
        out += ["|---|---|" + "---|" * (len(depths) + 1)]
        for m, x in rows:
            scores = [cell(table, m, mode, x, d) for d in depths]
            known = [s for s in scores if s is not None]
            mean = f"{sum(known) / len(known):.0f}" if known else ""
            out += [f"| {m} | {x} | " + " | ".join("" if s is None else f"{s:.0f}" for s in scores) + f" | {mean} |"]
        out += [""]
    return "\n".join(out)


def plot(table: Grid, method: str, mode: str, depths: list[int], path: Path) -> None:
    """The heatmap of one method: depth down, ratio across (the full cache first), the score in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ratios = columns(table, method, mode)
    values = np.array([[cell(table, method, mode, x, d) for x in ratios] for d in depths], dtype=float)
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * len(ratios), 0.5 * len(depths) + 1.4))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, "" if np.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(ratios)), ["full" if x == "0" else x for x in ratios])
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set(xlabel="compression ratio", ylabel="needle depth", title=f"{method} ({mode})")
    fig.colorbar(image, ax=ax, label="needle found (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> None:
    args.tasks = [f"needle_depth_{d}" for d in args.depths]  # what leaderboard's sweeps run
    summary = swept_summary(args)
    table = grid(summary, args.context_length, args.methods, args.depths)
    methods = [Path(m).stem for m in args.methods]
    if not set(methods) & set(table):
        raise ValueError(
            f"{summary} holds no needle_depth_* run of --methods at --context_length {args.context_length}"
        )
    text = markdown(table, methods, args.depths)
    (args.out_dir / "needle.md").write_text(text)
    (args.out_dir / "needle.json").write_text(json.dumps(table, indent=1) + "\n")
    figures = args.figures_dir or args.out_dir
    figures.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        for method in [FULL, *methods]:
            if method in table:
                plot(table, method, mode, args.depths, figures / picture_name(args.context_length, method, mode))
    print(text, end="")


def picture_name(context_length: int, method: str, mode: str) -> str:
    """needle_8k_kvzip.png for kvpress's protocol, needle_8k_kvzip_query_aware.png for the other."""
    return f"needle_{context_length // 1024}k_{method}" + ("" if mode == "query_agnostic" else f"_{mode}") + ".png"


def main(argv: list[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

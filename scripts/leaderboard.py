"""kvpress's leaderboard protocol on any kvlab checkpoint: RULER (all 13 tasks) at one context length,
every method at compression ratios 0.25 / 0.5 / 0.75 / 0.875 (the share of the prompt's KVs removed at
prefill; every later token kept), query-agnostic (the context compressed before the question is seen,
kvpress's default) and query-aware. Each cell is the mean RULER score over the tasks, as kvpress reports it.

    python scripts/leaderboard.py --checkpoint_path checkpoints/Llama-3.1-8B-Instruct --context_length 4096
    python scripts/leaderboard.py --methods snapkv kvzip --ratios 0.5 --tasks niah_single_1 vt --num_samples 10
    python scripts/leaderboard.py --context_length 1024 --processes 2   # a 2-core CPU: one process per core

The runs are ordinary eval.py sweeps under --out_dir (resumable: rerun the command after an interruption);
this script then writes leaderboard.md, leaderboard.csv, leaderboard.json and leaderboard.png there, and from the
records leaderboard_details.md (gaps to the full cache and between the protocols with paired standard errors, scores
per task).
leaderboard.json is {method: {protocol: {ratio: score}}} over the cells every task finished (the full cache at ratio 0).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from leaderboard_details import details_markdown  # scripts/ is on the path

from kvlab.cli import ArgumentParser, positive_int, run_cli
from kvlab.config_files import load_cache_config
from kvlab.jobs import PROTOCOLS as MODES
from kvlab.jobs import parse_ratio
from kvlab.results import FULL
from kvlab.strategies import CACHE_STRATEGIES

EVAL = Path(__file__).resolve().parent.parent / "eval.py"

# kvpress's leaderboard presses, by the shipped config that runs each here, best known first (DuoAttention's ratio: the
# share of heads that stream, as kvpress sets it); then SnapKV as its paper ran it, the oracles (uniform budgets,
# KVzip's model-wide ranking, Ada-KV's split; steered by the reference answer) and a recallable cache.
METHODS = (
    "kvzip",
    "ada_expected_attention",
    "expected_attention",
    "keydiff",
    "tova",
    "snapkv",
    "chunkkv",
    "critical_snapkv",
    "lagkv",
    "recent_global",
    "l2",
    "random",
    "duo_attention",
    "snapkv_paper",
    "oracle",
    "oracle_global",
    "oracle_adakv",
    "configs/eval/oracle_reference.yaml",
    "quest",
)
RATIOS = ("0.25", "0.5", "0.75", "0.875")


def checked_ratio(text: str) -> str:
    """A ratio for eval.py's --compression_ratios, refused here as eval.py would refuse it."""
    parse_ratio(text)
    return text


def add_eval_flags(p: ArgumentParser) -> None:
    """The flags passed through to eval.py's sweeps, and how many processes run them."""
    for flag in ("--checkpoint_path", "--device", "--dtype", "--batch_size"):
        p.add_argument(flag, default=None, help=f"passed to eval.py {flag} (default: eval.py's)")
    p.add_argument("--compile", action="store_true", help="passed to eval.py")
    p.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="run each sweep as N processes sharing its batches (eval.py under `python -m kvlab.launch "
        "--standalone`), each with "
        "its share of the cores or one GPU each; on a 2-core CPU, 2 processes took 0.87x the time of one, with "
        "the same predictions (docs/scaling.md) (default: 1)",
    )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        help="cache configs (names in configs/ or YAML paths); the table and plot show these and the full "
        f"cache, whatever else --out_dir holds (default: {' '.join(METHODS)})",
    )
    p.add_argument(
        "--ratios",
        nargs="+",
        type=checked_ratio,
        default=list(RATIOS),
        help=f"compression ratios, each in [0, 1) (default: {' '.join(RATIOS)})",
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="protocols (default: both)")
    p.add_argument("--tasks", nargs="+", default=["ruler"], help="RULER tasks (default: ruler, all 13)")
    p.add_argument(
        "--context_length", type=int, default=4096, help="RULER context length in tokens (default: 4096, kvpress's)"
    )
    p.add_argument("--num_samples", type=int, default=20, help="examples per task (default: 20)")
    p.add_argument(
        "--out_dir",
        type=Path,
        default=Path("results/leaderboard"),
        help="results directory (default: results/leaderboard)",
    )
    p.add_argument(
        "--table_only", action="store_true", help="only (re)write the table and plot from the runs already in --out_dir"
    )
    add_eval_flags(p)
    return p


def sweep_command(args: argparse.Namespace, query_agnostic: bool) -> list[str]:
    """The command of one protocol's sweep: eval.py, launched as --processes ranks when more than one."""
    launch = (
        ["-m", "kvlab.launch", "--standalone", "--nproc_per_node", str(args.processes)] if args.processes > 1 else []
    )
    return [sys.executable, *launch, str(EVAL), *sweep_args(args, query_agnostic)]


def sweep_args(args: argparse.Namespace, query_agnostic: bool) -> list[str]:
    argv = ["--tasks", *args.tasks, "--cache_config", FULL, *args.methods, "--compression_ratios", *args.ratios]
    argv += [
        "--context_lengths",
        str(args.context_length),
        "--num_samples",
        str(args.num_samples),
        "--out_dir",
        str(args.out_dir),
    ]
    argv += [
        x
        for flag in ("checkpoint_path", "device", "dtype", "batch_size")
        if getattr(args, flag) is not None
        for x in (f"--{flag}", str(getattr(args, flag)))
    ]
    return argv + ["--compile"] * args.compile + ["--query_agnostic"] * query_agnostic


# what the leaderboard reads of summary.csv
SUMMARY_COLUMNS = ("config", "size", "query_agnostic", "context_length", "value")


def summary_rows(summary: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """eval.py's summary.csv as rows, refused in one line when it lacks one of `columns`."""
    with summary.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{summary}: no column(s) {', '.join(missing)}; rerun the sweeps (or eval.py on --out_dir) to "
                "rewrite it"
            )
        return list(reader)


def protocol_cell(row: dict[str, str]) -> tuple[str, list[str]] | None:
    """A summary.csv row's ratio ("0": the full cache) and the protocols it counts in (the full cache is both
    protocols' reference), or None for a row kvpress's protocol does not rank (a chunked prefill, a cache size)."""
    if row.get("prefill_chunk") or not (row["size"] == FULL or row["size"].startswith("ratio")):
        return None
    if row["size"] == FULL:
        return "0", list(MODES)
    return row["size"].removeprefix("ratio"), ["query_agnostic" if row["query_agnostic"] == "True" else "query_aware"]


def leaderboard(summary: Path, context_length: int, methods: list[str]) -> list[dict[str, Any]]:
    """Rows (mode, method, ratio, score, tasks): the mean score over the RULER tasks each run finished, for
    `methods` and the full cache (an out_dir may also hold ablations and cache-size runs)."""
    names = {FULL, *(Path(m).stem for m in methods)}
    scores: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in summary_rows(summary, SUMMARY_COLUMNS):
        cell = protocol_cell(r)
        if int(r["context_length"]) != context_length or r["config"] not in names or cell is None:
            continue
        ratio, modes = cell
        for mode in modes:
            scores[mode, r["config"], ratio].append(float(r["value"]))
    return [
        dict(mode=m, method=c, ratio=float(x), score=sum(v) / len(v), tasks=len(v))
        for (m, c, x), v in sorted(scores.items())
    ]


def cell_text(row: dict[str, Any] | None, full: dict[str, Any] | None) -> str:
    """A cell's mean score, flagged when it covers fewer tasks than the full cache (a sweep still running)."""
    if row is None:
        return ""
    missing = full is not None and row["tasks"] < full["tasks"]
    return f"{row['score']:.1f}" + (f" ({row['tasks']}/{full['tasks']} tasks)" if missing else "")


def complete(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells over every task the full cache ran: a mean over fewer tasks would not be comparable."""
    full_tasks = {r["mode"]: r["tasks"] for r in rows if r["method"] == FULL}
    return [r for r in rows if r["tasks"] >= full_tasks.get(r["mode"], 0)]


RECALLABLE_NOTE = (
    "‡ recallable: nothing is evicted, every token's KVs stay in the slow tier (host-tier bytes: the full "
    "cache's), and the ratio sizes the tokens each decode step attends (the prompt's share, plus every token "
    "after it)"
)


def recallable(methods: list[str]) -> frozenset[str]:
    """The methods whose cache keeps every token and recalls what each step attends (ClusterKV, Quest)."""
    return frozenset(
        Path(m).stem
        for m in methods
        if CACHE_STRATEGIES[load_cache_config(m).get("cache_strategy", FULL)].keeps_history
    )


def markdown(rows: list[dict[str, Any]], recalling: frozenset[str] = frozenset()) -> str:
    """One table per protocol: methods by ratio, the full cache as the first row, methods by mean score; the
    recallable methods (`recalling`) last, marked, with what they keep stated."""
    out = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ratios = sorted({r["ratio"] for r in mine if r["method"] != FULL})
        if not ratios:  # this protocol was not run (only the shared full cache is there)
            continue
        cell = {(r["method"], r["ratio"]): r for r in mine}
        full = next((r for r in mine if r["method"] == FULL), None)
        methods = sorted(
            {r["method"] for r in mine if r["method"] != FULL},
            key=lambda m: (m in recalling, -sum(cell[m, x]["score"] for x in ratios if (m, x) in cell)),
        )
        full_score = "-" if full is None else f"{full['score']:.1f}"
        out += [f"**{mode}** (mean RULER score; full cache: {full_score})", ""]
        out += ["| method | " + " | ".join(f"{x:g}" for x in ratios) + " |", "|---|" + "---|" * len(ratios)]
        out += [
            f"| {m}{' ‡' * (m in recalling)} | " + " | ".join(cell_text(cell.get((m, x)), full) for x in ratios) + " |"
            for m in methods
        ]
        out += ["", RECALLABLE_NOTE, ""] if recalling & set(methods) else [""]
    return "\n".join(out)


def as_json(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {protocol: {ratio: mean score}}}, for a script to read or compare with kvpress's published numbers."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        table.setdefault(r["method"], {}).setdefault(r["mode"], {})[f"{r['ratio']:g}"] = round(r["score"], 2)
    return table


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """kvpress's figure: mean score against compression ratio, one line per method, one panel per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m and r["method"] != FULL for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False, sharey=True)
    # one colour and marker per method in every panel (tab20: up to 20 apart)
    methods = sorted({r["method"] for r in rows} - {FULL})
    for ax, mode in zip(axes[0], modes, strict=True):
        mine = [r for r in rows if r["mode"] == mode]
        full = [r["score"] for r in mine if r["method"] == FULL]
        for i, method in enumerate(methods):
            points = sorted((r["ratio"], r["score"]) for r in mine if r["method"] == method)
            if points:
                ax.plot(
                    [0.0, *(x for x, _ in points)],
                    full[:1] + [y for _, y in points],
                    marker="os^Dv"[i % 5],
                    color=plt.cm.tab20(i % 20),
                    label=method,
                )
        ax.set(title=mode, xlabel="compression ratio (share of the prompt removed)", ylabel="mean RULER score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def swept_summary(args: argparse.Namespace) -> Path:
    """Each protocol's sweep run (resumed) unless --table_only, then the summary.csv eval.py wrote in --out_dir."""
    if not args.table_only:
        for mode in args.modes:
            if subprocess.run(sweep_command(args, MODES[mode])).returncode:
                raise ValueError(f"the {mode} sweep stopped (eval.py's error above); rerun to resume it")
    summary = args.out_dir / "summary.csv"
    if not summary.is_file():
        raise ValueError(f"no {summary}: run the sweeps first (drop --table_only)")
    return summary


def run(args: argparse.Namespace) -> None:
    summary = swept_summary(args)
    rows = leaderboard(summary, args.context_length, args.methods)
    if all(r["method"] == FULL for r in rows):
        raise ValueError(
            f"{summary} holds no run of --methods at a ratio (size ratio<r>, prompt prefilled at once) with "
            f"--context_length {args.context_length}: nothing to rank; run the sweeps (drop --table_only), or "
            "give the methods and length it holds"
        )
    with (args.out_dir / "leaderboard.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "method", "ratio", "score", "tasks"])
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows, recallable(args.methods))
    (args.out_dir / "leaderboard.md").write_text(table)
    (args.out_dir / "leaderboard.json").write_text(json.dumps(as_json(complete(rows)), indent=1) + "\n")
    details = details_markdown(args.out_dir, args.context_length, args.methods, recallable(args.methods))
    (args.out_dir / "leaderboard_details.md").write_text(details)
    if any(r["method"] != FULL for r in complete(rows)):
        plot(complete(rows), args.out_dir / "leaderboard.png")
    else:
        print("no method's cell covers every task the full cache ran yet: no plot", file=sys.stderr)
    print(table, end="")


def main(argv: list[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

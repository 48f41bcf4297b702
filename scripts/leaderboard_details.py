"""The leaderboard's per-example tables, from the sweeps' records (`scripts/leaderboard.py` writes them into
leaderboard_details.md beside leaderboard.md): each method's gap to the full cache, the query-aware minus
query-agnostic difference and the best evicting method's gap to the best oracle, with the standard errors of the
paired differences over the examples both ran, and each cell's score per task.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from kvlab.jobs import AGNOSTIC, RATIO
from kvlab.jobs import PROTOCOLS as MODES
from kvlab.results import FULL, config_dirs, paired_difference, read_config_records

# RULER's task names as the tables' columns
SHORT = {
    "niah_single_": "s",
    "niah_multikey_": "mk",
    "niah_multivalue": "mv",
    "niah_multiquery": "mq",
    "qa_": "qa",
}

Cells = dict[tuple[str, str, float], dict[str, float]]


def example_scores(out_dir: Path, context_length: int, methods: set[str]) -> Cells:
    """{(protocol, method, ratio): {example id: score}} over the runs at `context_length` prefilled at once; the full
    cache (ratio 0) under both protocols."""
    cells: Cells = defaultdict(dict)
    for config_dir in config_dirs(out_dir):
        method = config_dir.name
        if method not in methods | {FULL}:
            continue
        for (run, job), records in read_config_records(config_dir).items():
            if not job.endswith(f"@{context_length}") or not (run == FULL or run.startswith(RATIO)):
                continue
            size, agnostic = run.removesuffix(AGNOSTIC), run.endswith(AGNOSTIC)
            if "+" in size:  # another kind of run (a chunked prefill)
                continue
            ratio = 0.0 if size == FULL else float(size.removeprefix(RATIO))
            modes = list(MODES) if size == FULL else ["query_agnostic" if agnostic else "query_aware"]
            for mode in modes:
                cells[mode, method, ratio] |= {i: r["score"] for i, r in records.items()}
    return cells


def ranked(cells: Cells, mode: str, ratios: list[float]) -> list[str]:
    """The protocol's methods by their mean score over the ratios, best first."""
    methods = {m for p, m, x in cells if p == mode and m != FULL}
    return sorted(
        methods, key=lambda m: -sum(statistics.fmean(cells.get((mode, m, x), {0: 0}).values()) for x in ratios)
    )


def difference(before: dict[str, float], after: dict[str, float]) -> str:
    """'after - before +- SE' over the examples both hold ('' when they share none)."""
    ids = sorted(set(before) & set(after))
    if not ids:
        return ""
    d = paired_difference([before[i] for i in ids], [after[i] for i in ids])
    return f"{d['diff']:+.1f} ± {d['se']:.1f}"


def gap_table(cells: Cells, mode: str, ratios: list[float]) -> list[str]:
    """Each method's mean score minus the full cache's at each ratio, with the paired standard error."""
    full = cells.get((mode, FULL, 0.0), {})
    lines = [
        f"**{mode}**: score - full cache ({statistics.fmean(full.values()) * 100:.1f}), paired SE",
        "",
        "| method | " + " | ".join(f"{x:g}" for x in ratios) + " |",
        "|---|" + "---:|" * len(ratios),
    ]
    for m in ranked(cells, mode, ratios):
        lines.append(f"| {m} | " + " | ".join(difference(full, cells.get((mode, m, x), {})) for x in ratios) + " |")
    return lines + [""]


def oracle_gap_table(cells: Cells, ratios: list[float], recalling: frozenset[str]) -> list[str]:
    """Per protocol and ratio: the best oracle (any method named oracle*), the best evicting method that is not one
    (recallable caches keep every token: left out), and that method minus the oracle, paired SE."""
    lines = [
        "**the best evicting method - the best oracle**, paired SE",
        "",
        "| protocol | ratio | oracle | score | method | score | method - oracle |",
        "|---|---:|---|---:|---|---:|---:|",
    ]
    for mode in MODES:
        for x in ratios:
            mine = {m: v for (p, m, r), v in cells.items() if p == mode and r == x and m not in recalling}
            oracles = [m for m in mine if m.startswith("oracle")]
            others = [m for m in mine if not m.startswith("oracle")]
            if not oracles or not others:
                continue
            oracle, best = (max(group, key=lambda m: statistics.fmean(mine[m].values())) for group in (oracles, others))
            score = [f"{100 * statistics.fmean(mine[m].values()):.1f}" for m in (oracle, best)]
            gap = difference(mine[oracle], mine[best])
            lines.append(f"| {mode} | {x:g} | {oracle} | {score[0]} | {best} | {score[1]} | {gap} |")
    return lines + [""]


def protocol_table(cells: Cells, ratios: list[float]) -> list[str]:
    """Query-aware minus query-agnostic per method and ratio: what seeing the question is worth."""
    lines = [
        "**query_aware - query_agnostic**, paired SE",
        "",
        "| method | " + " | ".join(f"{x:g}" for x in ratios) + " |",
        "|---|" + "---:|" * len(ratios),
    ]
    for m in ranked(cells, "query_agnostic", ratios):
        row = [
            difference(cells.get(("query_agnostic", m, x), {}), cells.get(("query_aware", m, x), {})) for x in ratios
        ]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return lines + [""]


def short(task: str) -> str:
    for prefix, abbreviation in SHORT.items():
        if task.startswith(prefix):
            return abbreviation + task.removeprefix(prefix)
    return task


def task_table(cells: Cells, mode: str, ratio: float, methods: list[str]) -> list[str]:
    """Each method's score per task (0-100) at one protocol and ratio, the full cache first; methods without a run
    there left out."""
    tasks = sorted({i.split("/")[0] for i in cells.get((mode, FULL, 0.0), {})})
    lines = [
        f"**{mode}, ratio {ratio:g}**: score per task",
        "",
        "| method | " + " | ".join(map(short, tasks)) + " | mean |",
        "|---|" + "---:|" * (len(tasks) + 1),
    ]
    for m, x in [(FULL, 0.0), *((m, ratio) for m in methods if (mode, m, ratio) in cells)]:
        scores = cells[mode, m, x]
        by_task = [[s for i, s in scores.items() if i.split("/")[0] == t] for t in tasks]
        means = [f"{100 * statistics.fmean(v):.0f}" if v else "" for v in by_task]
        lines.append(f"| {m} | " + " | ".join(means) + f" | {100 * statistics.fmean(scores.values()):.1f} |")
    return lines + [""]


def details_markdown(
    out_dir: Path, context_length: int, methods: list[str], recalling: frozenset[str] = frozenset()
) -> str:
    """leaderboard_details.md: the gap tables, the protocol table, the oracle's gap, then a per-task table per
    protocol and ratio; `recalling`: the recallable methods."""
    cells = example_scores(out_dir, context_length, {Path(m).stem for m in methods})
    ratios = sorted({x for _, m, x in cells if m != FULL})
    modes = [p for p in MODES if any(q == p and m != FULL for q, m, _ in cells)]
    lines = [f"# Leaderboard details: RULER at {context_length} tokens, per example", ""]
    for mode in modes:
        lines += gap_table(cells, mode, ratios)
    if len(modes) == 2:
        lines += protocol_table(cells, ratios)
    lines += oracle_gap_table(cells, ratios, recalling)
    for mode in modes:
        for ratio in ratios:
            lines += task_table(cells, mode, ratio, ranked(cells, mode, ratios))
    return "\n".join(lines)

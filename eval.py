"""Evaluate KV-cache compression: a sweep of tasks x cache configs x cache sizes, with results on disk.

    python eval.py --tasks niah_single_2 vt book_shakespeare --cache_config full recent_global heavy_hitter \\
        --cache_sizes 0.5 0.25 0.1 --context_lengths 2048 --num_samples 20

Under --out_dir (default results/), one directory per (model, config), whatever its sizes and tasks:
    <model>/<config>/records.jsonl   one line per finished example of any run (size, protocol) and task,
                                     written as it finishes
    <model>/<config>/runs.json       each run's settings, and each finished task's metrics over the requested
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

from kvlab import interrupts_quietly

with interrupts_quietly():  # Ctrl-C while torch loads: one line, not a traceback
    from kvlab import parallel
    from kvlab.cli import ArgumentParser, resolve_device_dtype, run_cli
    from kvlab.eval_flags import add_example_flags, add_run_flags, add_sweep_flags
    from kvlab.evaluate import SWEEP_TIMEOUT, Evaluator, on_rank0, open_out_dir
    from kvlab.jobs import jobs_for
    from kvlab.results import markdown_table, removed_unless_results, write_summary
    from kvlab.tasks import PerplexityTask, resolve_tasks


def build_parser() -> ArgumentParser:
    """What a sweep runs, on which examples, and how (kvlab/eval_flags.py)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_flags(p)
    add_example_flags(p)
    add_run_flags(p)
    return p


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

"""The paged KV-Compress cache's decode attention: a gathered view of each head's blocks (kvc_attention
gather) against FlexAttention straight over the pool from the block tables (kvc_attention flex), beside
the dense full cache, all compiled, in one run.

    python bench/bench_paged_attention.py                 # CPU: float32
    python bench/bench_paged_attention.py --device cuda

Writes bench/results/paged_attention_<device>.md. Both paths compress at prefill only
(kvc_compress_every 0: FlexAttention returns no probabilities for the continual metric), so they hold
the same KVs and generate the same tokens; only the attention differs.
"""

from __future__ import annotations

import argparse

import torch

from common import (
    Bench,
    after_warmup,
    bench_parser,
    load_bench,
    machine,
    median_decode_rate,
    parse_bench_args,
    row,
    table,
    write_results,
)
from kvlab.config import CacheSpec
from kvlab.engine import compile_decode_step, generate

PATHS = ("gather", "flex")


def decode_rate(
    bench: Bench, prompts: list[list[int]], spec: CacheSpec, step, args: argparse.Namespace
) -> tuple[float, list[list[int]]]:
    """Median decode tokens/s over the repeats after a warm-up (which compiles), and the tokens (the same in every
    run)."""
    new_tokens = args.new_tokens
    runs = after_warmup(
        lambda: generate(
            bench.model, prompts, new_tokens, spec, decode_step=step, max_seq_length=len(prompts[0]) + new_tokens
        ),
        args.repeats,
    )
    assert len({tuple(map(tuple, r.tokens)) for r in runs}) == 1, "repeated runs generated different tokens"
    return median_decode_rate(runs), runs[0].tokens


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument(
        "--prompt_lengths",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prompt tokens per sequence (default: 512 2048)",
    )
    p.add_argument("--batch_size", type=int, default=4, help="sequences decoded together (default: 4)")
    p.add_argument(
        "--rate", type=int, default=4, help="compression rate: each sequence keeps 1/rate of its KVs (default: 4)"
    )
    p.add_argument("--new_tokens", type=int, default=32, help="decoded tokens per run (default: 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point after a warm-up (default: 3)")
    args = parse_bench_args(p, "paged_attention")

    bench = load_bench(args.device, args.dtype)
    torch._dynamo.config.cache_size_limit = 64
    step = compile_decode_step(bench.device)
    rows = []
    for n in args.prompt_lengths:
        prompts = [bench.ids[i * n : (i + 1) * n] for i in range(args.batch_size)]
        full, _ = decode_rate(bench, prompts, bench.spec("full"), step, args)
        paged = {
            path: decode_rate(
                bench,
                prompts,
                bench.spec("kvcompress", 1 / args.rate, kvc_compress_every=0, kvc_attention=path),
                step,
                args,
            )
            for path in PATHS
        }
        assert paged["gather"][1] == paged["flex"][1], "the two attention paths generated different tokens"
        gather, flex = paged["gather"][0], paged["flex"][0]
        rows.append(
            row(n, f"{full:.1f}", f"{gather:.1f}", f"{flex:.1f}", f"{flex / gather:.2f}x", f"{gather / full:.2f}x")
        )
        print(rows[-1], flush=True)
    lines = [
        f"# Paged decode attention: {bench.config['name']} on {bench.device.type} ({machine(bench.device)}), "
        f"{bench.dtype_name}, compiled decode",
        "",
        f"Batch {args.batch_size}, {args.new_tokens} new tokens per run, median of {args.repeats} runs after a "
        f"warm-up; kvcompress keeps 1/{args.rate} of each sequence's KVs (compressed at prefill); decode "
        "steps/s (tokens/s of each sequence). Both paths generated the same tokens (checked).",
        "",
        *table(
            "prompt tokens | full cache | kvcompress gather | kvcompress flex | flex / gather | gather / full",
            rows,
            align="---:",
        ),
    ]
    write_results(lines, args.out, "paged_attention", bench.device)


if __name__ == "__main__":
    main()

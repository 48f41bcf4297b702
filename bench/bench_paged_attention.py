"""The paged KV-Compress cache's decode attention: torch's attention over a gathered view of each head's blocks,
kvlab's native paged attention reading the blocks in place through the block tables (the CPU default of
kvc_attention gather), and FlexAttention over the pool (kvc_attention flex), beside the dense full cache, compiled,
in one run; then, with KV-Compress's continual metric (every step's attention added to the pool's metrics), the
gathered view against the native kernel, eager as a server runs it.

    python bench/bench_paged_attention.py                 # CPU: float32
    python bench/bench_paged_attention.py --device cuda   # the gathered view against flex

Writes bench/results/paged_attention_<device>.md. The first table's paths compress at prefill only
(kvc_compress_every 0: FlexAttention returns no probabilities for the metric), so they hold the same KVs and generate
the same tokens; only the attention differs. The second table's compress every 16 steps.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

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
from kvlab import kernels
from kvlab.config import CacheSpec
from kvlab.engine import compile_decode_step, decode_one_token, generate

PATHS = ("gather", "native", "flex")  # the view's torch attention, the native kernel (kvc_attention gather), flex


@contextlib.contextmanager
def attention_on(path: str) -> Iterator[None]:
    """The decode attention `path` takes: the native kernels' switch held off for the gathered view's torch path."""
    taken = kernels.takes_attention
    if path == "gather":
        kernels.takes_attention = lambda *tensors: False
    try:
        yield
    finally:
        kernels.takes_attention = taken


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


def parse_args() -> argparse.Namespace:
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
    return parse_bench_args(p, "paged_attention")


def main() -> None:
    args = parse_args()

    bench = load_bench(args.device, args.dtype)
    torch._dynamo.config.cache_size_limit = 64
    step = compile_decode_step(bench.device)
    paths = PATHS if bench.device.type == "cpu" else ("gather", "flex")
    rows, continual = [], []
    for n in args.prompt_lengths:
        prompts = [bench.ids[i * n : (i + 1) * n] for i in range(args.batch_size)]
        full, _ = decode_rate(bench, prompts, bench.spec("full"), step, args)
        paged = {}
        for path in paths:
            spec = bench.spec(
                "kvcompress", 1 / args.rate, kvc_compress_every=0, kvc_attention="flex" if path == "flex" else "gather"
            )
            with attention_on(path):
                paged[path] = decode_rate(bench, prompts, spec, step, args)
        assert len({tuple(map(tuple, tokens)) for _, tokens in paged.values()}) == 1, "the paths generated other tokens"
        rates = [paged[path][0] for path in paths]
        rows.append(row(n, f"{full:.1f}", *(f"{r:.1f}" for r in rates), *(f"{r / rates[0]:.2f}x" for r in rates[1:])))
        print(rows[-1], flush=True)
        if bench.device.type == "cpu":
            spec = bench.spec("kvcompress", 1 / args.rate, kvc_compress_every=16)
            rates = []
            for path in ("gather", "native"):
                with attention_on(path):
                    rates.append(decode_rate(bench, prompts, spec, decode_one_token, args)[0])
            continual.append(row(n, *(f"{r:.1f}" for r in rates), f"{rates[1] / rates[0]:.2f}x"))
            print(continual[-1], flush=True)
    columns = " | ".join(f"kvcompress {p}" for p in paths) + " | " + " | ".join(f"{p} / gather" for p in paths[1:])
    lines = [
        f"# Paged decode attention: {bench.config['name']} on {bench.device.type} ({machine(bench.device)}), "
        f"{bench.dtype_name}",
        "",
        f"Batch {args.batch_size}, {args.new_tokens} new tokens per run, median of {args.repeats} runs after a "
        f"warm-up; kvcompress keeps 1/{args.rate} of each sequence's KVs; decode steps/s (tokens/s of each "
        "sequence). gather: torch's attention over the gathered view; native: kvlab's paged attention over the "
        "blocks in place. Compressed at prefill only, compiled decode; every path generated the same tokens "
        "(checked):",
        "",
        *table(f"prompt tokens | full cache | {columns}", rows, align="---:"),
    ]
    if continual:
        lines += [
            "",
            "With the continual metric (compressed every 16 steps), eager decode:",
            "",
            *table("prompt tokens | kvcompress gather | kvcompress native | native / gather", continual, align="---:"),
        ]
    write_results(lines, args.out, "paged_attention", bench.device)


if __name__ == "__main__":
    main()

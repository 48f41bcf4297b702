"""Decode speed of compressed caches as the prompt grows: full vs heavy_hitter and recent_global at a
fixed cache size, plus the per-step cost of eviction (compressed vs full at an equal cache size).

    python bench/bench_cache.py                     # CPU: float32, compiled decode
    python bench/bench_cache.py --device cuda
    python bench/bench_cache.py --weights int8      # int8 weights: bench/results/cache_int8_cpu.md

Writes bench/results/cache_<device>.md. A compressed cache's decode step reads a fixed number of
slots, so its speed should stay flat while the full cache slows with the prompt.
"""

from __future__ import annotations

import argparse

import torch

from common import (
    Bench,
    after_warmup,
    bench_parser,
    load_bench,
    median_decode_rate,
    parse_bench_args,
    row,
    table,
    write_results,
)
from kvlab.engine import compile_decode_step, decode_one_token, generate


def decode_speed(
    bench: Bench, prompt: list[int], new_tokens: int, strategy: str, cache_length: int | None, step, repeats: int
) -> float:
    """Median decode tokens/s over `repeats` runs after a warm-up run (which compiles)."""
    spec = bench.spec(strategy, cache_length)
    return median_decode_rate(
        after_warmup(
            lambda: generate(
                bench.model, [prompt], new_tokens, spec, decode_step=step, max_seq_length=len(prompt) + new_tokens
            ),
            repeats,
        )
    )


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__, weights=True)
    p.add_argument(
        "--prompt_lengths", type=int, nargs="+", default=[512, 2048, 4096, 8000], help="prompt lengths in tokens"
    )
    p.add_argument("--cache_length", type=int, default=512, help="slots of the compressed caches (default: 512)")
    p.add_argument(
        "--new_tokens", type=int, default=None, help="decoded tokens per run (default: 32 on CPU, 256 on CUDA)"
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point after a warm-up (default: 1)")
    p.add_argument("--eager", action="store_true", help="time the eager decode step instead of the compiled one")
    return parse_bench_args(p, "cache")


def main() -> None:
    args = parse_args()

    bench = load_bench(args.device, args.dtype, args.weights)
    device = bench.device
    # one decode graph per cache shape; the default 8 would silently fall back to eager
    torch._dynamo.config.cache_size_limit = 64
    new_tokens = args.new_tokens or (256 if device.type == "cuda" else 32)
    step = decode_one_token if args.eager else compile_decode_step(device)
    strategies = ["full", "recent_global", "heavy_hitter"]

    def speed(prompt: list[int], strategy: str) -> float:
        return decode_speed(
            bench, prompt, new_tokens, strategy, None if strategy == "full" else args.cache_length, step, args.repeats
        )

    speeds: dict[tuple[str, int], float] = {}
    for n in args.prompt_lengths:
        for strategy in strategies:
            speeds[strategy, n] = speed(bench.ids[:n], strategy)
            print(f"prompt {n}: {strategy} {speeds[strategy, n]:.1f} tok/s", flush=True)
    # Eviction overhead: the full cache holding exactly as many tokens as the compressed caches' slots.
    equal = args.cache_length - new_tokens
    overhead = {s: speed(bench.ids[:equal], s) for s in strategies}

    mode = "eager" if args.eager else "compiled"
    weights = "" if args.weights == "float" else f", {args.weights} weights"
    first, last = args.prompt_lengths[0], args.prompt_lengths[-1]
    lines = [
        f"# Decode speed vs prompt length: {bench.config['name']} on {device.type}, "
        f"{bench.dtype_name}{weights}, {mode} decode",
        "",
        f"Batch 1, {new_tokens} new tokens per run, median of {args.repeats} runs after a warm-up; compressed "
        f"caches hold {args.cache_length} slots per layer and KV head (4 sinks, window 10); tokens/s.",
        "",
        *table(
            " | ".join(["prompt tokens", *strategies, *(f"{s} / full" for s in strategies[1:])]),
            (
                row(
                    n,
                    *(f"{speeds[s, n]:.1f}" for s in strategies),
                    *(f"{speeds[s, n] / speeds['full', n]:.2f}x" for s in strategies[1:]),
                )
                for n in args.prompt_lengths
            ),
            align="---:",
        ),
        f"From {first} to {last} prompt tokens, decode speed changes by: "
        + ", ".join(f"{s} {speeds[s, last] / speeds[s, first]:.2f}x" for s in strategies)
        + ".",
        "",
        f"Eviction overhead at an equal cache size ({equal}-token prompt, so the full cache also holds "
        f"{args.cache_length} tokens): "
        + ", ".join(f"{s} {overhead[s]:.1f} tok/s ({overhead[s] / overhead['full']:.2f}x full)" for s in strategies)
        + ".",
        "",
    ]
    write_results(lines, args.out, "cache" if args.weights == "float" else f"cache_{args.weights}", device, show=False)


if __name__ == "__main__":
    main()

"""Does compression pay at decode? A compressed cache against kvlab's full cache, in one run.

    python bench/bench_compression_pays.py                       # prompts of 2048 and 8000 tokens, ratios 0.5 and 0.875
    python bench/bench_compression_pays.py --strategy recent_global --new_tokens 64

Compiled decode, float32, batch 1, on the kernels this machine runs (native where built). A cache at
compression ratio r (`--compression_ratio r`, kvpress's meaning) evicts the share r of the prompt's
tokens per layer and KV head at prefill and keeps every decoded token, so its decode step reads fewer
slots and scores nothing; the full cache keeps them all. Each row gives the decode rate, the KV bytes the step reads,
and what those bytes predict: the full step's time less the bytes saved at the machine's read bandwidth (summing 1 GiB,
measured in the same run). A measured speed-up close to the predicted one means the kernels turn saved bytes into saved
time. The full cache and the ratios run interleaved, round by round, each through a compiled step of its own: this
machine's bandwidth moves between runs by up to a third.

Writes bench/results/compression_pays_<device>.md and .json: {"<n>": {"<ratio>": {"tok_s", "kv_bytes",
"predicted_tok_s"}}}, with the full cache at ratio 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from common import (
    bench_parser,
    interleaved,
    load_bench,
    machine,
    median_decode_rate,
    parse_bench_args,
    read_bandwidth,
    row,
    table,
    write_results,
)
from kvlab import kernels
from kvlab.engine import compile_decode_step, generate
from kvlab.generation import Generation


def decode_run(bench, prompt: list[int], spec, new_tokens: int) -> Callable[[], Generation]:
    """One generate over `prompt` with `spec`, through a compiled step of its own."""
    step = compile_decode_step(bench.device)
    return lambda: generate(
        bench.model, [prompt], new_tokens, spec, decode_step=step, max_seq_length=len(prompt) + new_tokens
    )


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument(
        "--prompt_lengths",
        type=int,
        nargs="+",
        default=[2048, 8000],
        help="prompt lengths in tokens (default: 2048 8000)",
    )
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.5, 0.875],
        help="compression ratios, the share of the prompt evicted (default: 0.5 0.875)",
    )
    p.add_argument(
        "--strategy", default="keydiff", help="the compressing strategy (default: keydiff, scored from the keys alone)"
    )
    p.add_argument("--new_tokens", type=int, default=32, help="tokens decoded per run (default: 32)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds of every point, after a warm-up; medians are reported (default: 3)",
    )
    return parse_bench_args(p, "compression_pays")


def main() -> None:
    args = parse_args()
    kernels.load()
    bench = load_bench("cpu", "float32")
    bandwidth = read_bandwidth() * 1e9
    results, rows = {}, []
    for n in args.prompt_lengths:
        prompt = bench.ids[:n]
        specs = {0: bench.spec("full")} | {
            ratio: bench.spec(args.strategy, compression_ratio=ratio) for ratio in args.ratios
        }
        runs = interleaved(
            {ratio: decode_run(bench, prompt, spec, args.new_tokens) for ratio, spec in specs.items()}, args.repeats
        )
        full_rate, full_bytes = median_decode_rate(runs[0]), runs[0][0].kv_cache_bytes
        results[str(n)] = {"0": {"tok_s": full_rate, "kv_bytes": full_bytes, "predicted_tok_s": full_rate}}
        rows.append(row(n, "full", f"{full_bytes / 1e6:.0f}", f"{full_rate:.1f}", "1.00x", "1.00x"))
        for ratio in args.ratios:
            rate, kv_bytes = median_decode_rate(runs[ratio]), runs[ratio][0].kv_cache_bytes
            predicted = 1 / (1 / full_rate - (full_bytes - kv_bytes) / bandwidth)
            results[str(n)][str(ratio)] = {"tok_s": rate, "kv_bytes": kv_bytes, "predicted_tok_s": predicted}
            rows.append(
                row(
                    n,
                    f"{args.strategy} {ratio}",
                    f"{kv_bytes / 1e6:.0f}",
                    f"{rate:.1f}",
                    f"{rate / full_rate:.2f}x",
                    f"{predicted / full_rate:.2f}x",
                )
            )
            print(rows[-1], flush=True)
    lines = [
        f"# Compression at decode: {bench.config['name']}, float32 ({machine(bench.device)})",
        "",
        f"torch {torch.__version__}; kernels: {kernels.path()}; compiled decode, batch 1, {args.new_tokens} new "
        f"tokens; the full cache and each ratio interleaved, {args.repeats} rounds after a warm-up (medians), "
        f"each with a compiled step of its own; read bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB sum).",
        "",
        *table(
            "prompt tokens | cache | KV MB | decode tok/s | / full | predicted / full (bytes saved at bandwidth)",
            rows,
            align="---:",
        ),
    ]
    write_results(lines, args.out, "compression_pays", bench.device, results=results)


if __name__ == "__main__":
    main()

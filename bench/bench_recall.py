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

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_generate import bench_text  # noqa: E402
from checkpoint import default_checkpoint, load_checkpoint  # noqa: E402
from generate import RecordedPrefill, generate, resolve_device_dtype  # noqa: E402

RUNS = {  # name: (strategy, cache options)
    "clusterkv": ("clusterkv", {}),
    "quest": ("quest", {}),
    "snapkv": ("heavy_hitter", dict(prompt_compression_strategy="snapkv")),
    "heavy_hitter": ("heavy_hitter", {}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (default: auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--prompt_length", type=int, default=4000, help="prompt tokens (default: 4000)")
    p.add_argument("--new_tokens", type=int, default=32, help="decoded tokens (default: 32)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024], help="tokens attended per layer and head (default: 256 512 1024)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="strategies to compare (default: all)")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: bench/results/recall_<device>.md)")
    args = p.parse_args()

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    model, tokenizer, _ = load_checkpoint(default_checkpoint(), device, dtype)
    prompt = tokenizer.encode(bench_text())[: args.prompt_length]
    if len(prompt) < args.prompt_length:
        raise SystemExit(f"the benchmark text has {len(prompt)} tokens, fewer than --prompt_length {args.prompt_length}")
    shared = RecordedPrefill()  # prefill attention is exact for every cache: run it once, replay it into each
    full = generate(model, [prompt], args.new_tokens, "full", recorded=shared)
    rows = []
    for budget in args.budgets:
        for name in args.runs:
            strategy, options = RUNS[name]
            kwargs = dict(cache_length=budget, cache_options=options, recorded=shared)
            probed = generate(model, [prompt], args.new_tokens, strategy, attention_loss=True, **kwargs)
            timed = generate(model, [prompt], args.new_tokens, strategy, **kwargs)
            recall, loss = (sum(probed.attention_loss[k]) / len(probed.attention_loss[k]) for k in ("recall_per_step", "per_step"))
            speed = (timed.decode_steps - 1) / timed.decode_seconds / ((full.decode_steps - 1) / full.decode_seconds)
            fast = budget / full.sequence_length
            reuse = timed.cache_stats.get("recall: also selected in the previous reuse_steps", 0) / timed.cache_stats.get("recall: selected tokens", 1)
            rows.append(
                f"| {budget} | {name} | {recall:.3f} | {loss:.4f} | {speed:.2f}x | {fast:.3f} | {f'{reuse:.0%}' if 'recall: selected tokens' in timed.cache_stats else ''} |"
            )
            print(rows[-1], file=sys.stderr)
    table = "\n".join(
        [
            f"# Recall of top-B attention, SmolLM2-135M-Instruct, {device.type}, {str(dtype).removeprefix('torch.')}",
            "",
            f"A {len(prompt)}-token essay prompt, {args.new_tokens} greedy tokens, every layer compressed, batch 1. snapkv = SnapKV prompt "
            "compression feeding H2O; clusterkv and quest attend 16 sinks + selected tokens + unindexed recent tokens. Decode speed "
            f"is relative to the full cache in this run ({(full.decode_steps - 1) / full.decode_seconds:.1f} tokens/s, eager).",
            "",
            "| B | strategy | top-B recall | attention loss | decode speed vs full | fast-tier bytes / full | selections reused from the previous step |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = args.out or ROOT / "bench" / "results" / f"recall_{device.type}.md"
    out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()

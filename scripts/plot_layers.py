"""Plot what the layer budget planners see and decide for one prompt: each layer's measured importance
(SqueezeAttention's cosine similarity of the hidden state before and after the attention residual,
with its KMeans group) and each planner's slots per layer, all at the same total budget.

    python scripts/plot_layers.py --prompt essay.txt --max_cache_length 0.25 --out docs/layers.png

Prints the same numbers as a markdown table. One prefill is shared by every planner.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvlab.budget import LAYER_BUDGETS, kmeans_1d
from kvlab.checkpoint import load_checkpoint
from kvlab.cli import ArgumentParser, run_cli
from kvlab.config import cache_spec
from kvlab.convert import default_checkpoint
from kvlab.engine import generate
from kvlab.recording import RecordedPrefill


def read_prompt(value: str) -> str:
    """--prompt is literal text, or a path to a .txt file whose contents are the prompt (as generate.py reads it)."""
    if not value.endswith(".txt"):
        return value
    if not Path(value).is_file():
        raise ValueError(f"prompt file {value!r} does not exist")
    return Path(value).read_text()


def layer_plans(args: argparse.Namespace) -> tuple[list[float], dict[str, list[int]]]:
    """The prompt's per-layer similarity and each planner's per-layer slots."""
    model, tokenizer, _ = load_checkpoint(args.checkpoint_path or default_checkpoint(), "cpu", torch.float32)
    prompt = tokenizer.encode(read_prompt(args.prompt), bos=tokenizer.add_bos)
    recorded = RecordedPrefill()
    plans = {}
    for planner in args.planners:
        settings = dict(
            cache_strategy=args.cache_strategy, max_cache_length=args.max_cache_length, layer_budget=planner
        )
        result = generate(model, [prompt], 1, cache_spec(settings, model.config.n_layer, tokenizer), recorded=recorded)
        plans[planner] = result.layer_budgets[0] if result.layer_budgets else [int(h) for h in result.tokens_held]
    return recorded.similarity[0].tolist(), plans


def plot(similarity: list[float], plans: dict[str, list[int]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(len(similarity))
    groups = kmeans_1d(torch.tensor(similarity)).tolist()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(layers, similarity, color="0.6", zorder=1)
    top.scatter(layers, similarity, c=[("tab:red", "tab:orange", "tab:blue")[g] for g in groups], zorder=2)
    top.set_ylabel("cos(x, x + attention)")
    top.set_title("layer similarity (blue: least important KMeans group)")
    for planner, slots in plans.items():
        bottom.plot(layers, slots, marker=".", label=planner)
    bottom.set_xlabel("layer")
    bottom.set_ylabel("slots per KV head")
    bottom.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def run(args: argparse.Namespace) -> None:
    unknown = [p for p in args.planners if p not in LAYER_BUDGETS]
    if unknown:
        raise ValueError(f"unknown planner(s) {', '.join(unknown)}; choose from: {', '.join(LAYER_BUDGETS)}")
    similarity, plans = layer_plans(args)
    print("| layer | similarity | " + " | ".join(plans) + " |")
    print("|---|---|" + "---|" * len(plans))
    for layer, value in enumerate(similarity):
        print(f"| {layer} | {value:.3f} | " + " | ".join(str(slots[layer]) for slots in plans.values()) + " |")
    plot(similarity, plans, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="prompt text, or a path to a .txt file")
    p.add_argument(
        "--cache_strategy",
        default="heavy_hitter",
        help="the strategy inside each layer's budget (default: heavy_hitter)",
    )
    p.add_argument(
        "--max_cache_length",
        type=float,
        default=0.25,
        help="the uniform fraction that sets the total budget (default: 0.25)",
    )
    p.add_argument(
        "--planners",
        nargs="+",
        default=list(LAYER_BUDGETS),
        help=f"planners to compare (default: {' '.join(LAYER_BUDGETS)})",
    )
    p.add_argument(
        "--checkpoint_path", type=Path, default=None, help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--out", type=Path, default=Path("layers.png"), help="PNG to write (default: layers.png)")
    run_cli(run, p.parse_args(argv))


if __name__ == "__main__":
    main()

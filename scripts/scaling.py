"""How large a model and context each tensor-parallel setup holds, computed from the model shapes.

    python scripts/scaling.py --out bench/results/scaling_80gib.md   # 80 GiB GPUs, bfloat16: docs/scaling.md shows it
    python scripts/scaling.py --gpu_gib 141 --models Llama-3.1-70B Qwen2.5-7B

Per rank: the weights it keeps (parallel.shard_model: its share of attention heads and FFN units, plus
the embeddings, norms and LM head every rank keeps whole), and the KV bytes per token of its KV heads
(the rank with the most heads, when they do not divide). The context is what fits in the memory left
after the weights and a reserve for activations, as tokens of context over all sequences (batch x
context), and in brackets as sequences of the model's full context length; a cache keeping a fraction f
of the tokens (dense buffers sized by that fraction) holds 1/f times more.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from kvlab.checkpoint import KNOWN_MODELS
from kvlab.model import ModelArgs, Transformer
from kvlab.parallel import split
from kvlab.storage import make_storage

CACHES = (
    ("full", 1.0, None),
    ("0.5 (heavy_hitter, snapkv, ...)", 0.5, None),
    ("0.125", 0.125, None),
    ("4-bit, all tokens", 1.0, 4),
    ("4-bit x 0.25", 0.25, 4),
)


def weight_bytes_per_rank(args: ModelArgs, ranks: int, element: int) -> int:
    """The largest rank's weights: sharded attention and FFN, the rest whole."""
    with torch.device("meta"):
        model = Transformer(args)
    sharded = sum(
        p.numel() for layer in model.layers for p in (*layer.attention.parameters(), *layer.feed_forward.parameters())
    )
    whole = sum(p.numel() for p in model.parameters()) - sharded  # parameters() counts a tied LM head once
    share = max(split(args.n_local_heads, ranks)) / args.n_local_heads  # FFN units split at least as evenly
    return element * (whole + math.ceil(sharded * share))


def kv_bytes_per_token(args: ModelArgs, ranks: int, dtype: torch.dtype, bits: int | None) -> float:
    """Keys and values of one token on the rank with the most KV heads, as kvlab's storage allocates them."""
    heads, slots = max(split(args.n_local_heads, ranks)), 1024
    storage = make_storage((1, heads, slots, args.head_dim), dtype, torch.device("meta"), bits)
    return args.n_layer * storage.nbytes() / slots


def table(models: list[str], gpu_gib: float, reserve: float, rank_counts: list[int]) -> str:
    dtype = torch.bfloat16
    head = ["model (context)", "GPUs", "weights / GPU (GiB)", "KV / token / GPU (KiB)"] + [
        f"tokens held: {name}" for name, _, _ in CACHES
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in models:
        args = ModelArgs.from_dict(KNOWN_MODELS[name].args)
        for ranks in rank_counts:
            if ranks > args.n_local_heads:
                continue
            weights = weight_bytes_per_rank(args, ranks, dtype.itemsize)
            room = gpu_gib * 2**30 * (1 - reserve) - weights
            cells = []
            for _, fraction, bits in CACHES:
                tokens = room / (kv_bytes_per_token(args, ranks, dtype, bits) * fraction)
                cells.append("does not fit" if room <= 0 else f"{tokens / 1e3:,.0f}K ({tokens / args.block_size:.1f})")
            per_token = kv_bytes_per_token(args, ranks, dtype, None) / 2**10
            lines.append(
                f"| {name} ({args.block_size // 1024}K) | {ranks} | {weights / 2**30:.1f} | {per_token:.0f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        nargs="+",
        default=["Llama-3.1-8B", "Qwen2.5-7B", "Llama-3.1-70B"],
        choices=sorted(KNOWN_MODELS),
        metavar="MODEL",
        help="known models (default: Llama-3.1-8B Qwen2.5-7B Llama-3.1-70B)",
    )
    p.add_argument("--gpu_gib", type=float, default=80.0, help="memory of one GPU in GiB (default: 80, an H100)")
    p.add_argument(
        "--reserve", type=float, default=0.1, help="share of each GPU kept for activations and workspace (default: 0.1)"
    )
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="tensor-parallel sizes (default: 1 2 4 8; never more than the KV heads)",
    )
    p.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    args = p.parse_args()
    text = table(args.models, args.gpu_gib, args.reserve, args.ranks)
    if args.out is not None:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

"""Per-head budgets: how each layer's slots are split over its KV heads at prefill (`--head_budget`), Ada-KV's rules."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlab.options import choice, fraction

HEAD_BUDGETS = ("uniform", "adakv", "adakv_safeguard", "global")
ADAKV_BUDGETS = ("adakv", "adakv_safeguard")  # split within each layer, by `adakv_capacities`
DEFAULT_ADAKV_FLOOR = 0.2
HEAD_BUDGET_OPTIONS = (
    choice(
        "head_budget",
        HEAD_BUDGETS,
        "uniform",
        "split the budget over the KV heads at prefill, per prompt: uniform (every head the same), adakv "
        "(Ada-KV's official code: in each layer a head gets (1 - floor) x its tokens among the layer's top "
        "scores + floor x the even share), adakv_safeguard (kvpress's AdaKVPress: each head keeps its top floor "
        "x budget tokens, the rest go to the layer's top scores) or global (kvpress's KVzipPress: the scores of "
        "every layer and head ranked together; with --prefill_chunk, what is held and the chunk after each "
        "chunk, or for KVzip and the oracle the whole prompt, recorded in chunks); the prompt is stored in "
        "buffers as wide as the largest share (global: the whole sequence), then each head's share moves into "
        "rows of its own (--kv_store)",
    ),
    fraction(
        "adakv_floor",
        DEFAULT_ADAKV_FLOOR,
        "head_budget adakv*: the share of the uniform per-head budget every head is guaranteed",
        closed=True,
    ),
)


def adakv_capacities(
    scores: Tensor, n_prompt: Tensor, budget: Tensor, room: Tensor, capacity: int, rule: str, floor: float
) -> Tensor:
    """Ada-KV's split of a layer's H x budget slots over its heads, [B, H, 1], from protected prompt
    scores [B, H, T], prompt lengths [B, 1, 1], budgets and decode rooms [B, 1, 1] and the buffer's `capacity`:
    the top H x b scores over all heads together are counted per head (b = the budget's prompt part,
    min(budget - decode room, prompt)). With rule adakv, head h gets (1 - floor) x (count_h + budget - b) +
    floor x budget, so every head keeps `floor` of a uniform share and the decode room is shared evenly; whole
    slots by largest remainder (the sum stays exact). With adakv_safeguard, each head's own top
    max(1, int(floor x b)) count first, then the rest of the H x b go to the top scores of the layer, as
    kvpress's AdaKVPress prunes. A share beyond the buffer goes to the other heads in proportion to their room."""
    B, H, T = scores.shape
    budget = budget.double()
    prompt_part = torch.minimum(budget - room, n_prompt.double())
    if rule == "adakv_safeguard":
        safe = safeguard(prompt_part, floor)
        in_head = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        scores = scores.masked_fill(in_head < safe, float("inf"))
    rank = scores.flatten(1).argsort(dim=1, descending=True, stable=True).argsort(dim=1).view(B, H, T)
    count = (rank < H * prompt_part).sum(dim=-1, keepdim=True)
    if rule == "adakv_safeguard":
        share = count + budget - prompt_part
    else:
        share = (1 - floor) * (count + budget - prompt_part) + floor * budget
    spare = (capacity - share).clamp(min=0)
    excess = (share - capacity).clamp(min=0).sum(dim=1, keepdim=True)
    share = share.clamp(max=capacity) + excess * spare / spare.sum(dim=1, keepdim=True).clamp(min=1e-9)
    whole = share.floor()
    left = (H * budget - whole.sum(dim=1, keepdim=True)).round()
    by_fraction = (whole - share).argsort(dim=1, stable=True).argsort(dim=1)  # largest fraction first
    return (whole + (by_fraction < left)).long()


def safeguard(prompt_part: Tensor, floor: float) -> Tensor:
    """AdaKVPress's safeguard: the max(1, int(floor x b)) best prompt tokens each head keeps of a uniform share of b (0
    with floor 0)."""
    return (prompt_part * floor).floor().clamp(min=1 if floor > 0 else 0)


def adakv_slots(budget: int, n_heads: int, floor: float = DEFAULT_ADAKV_FLOOR, safeguard: bool = False) -> int:
    """The largest share Ada-KV can give one of `n_heads` heads with `budget` slots each: every prompt
    winner in that head (n_heads x budget) times (1 - floor), plus its floor share; with the safeguard
    (kvpress's), all of the layer's budget but the other heads' max(1, int(floor x budget)) safe tokens."""
    if safeguard:
        return n_heads * budget - (n_heads - 1) * (max(1, int(floor * budget)) if floor > 0 else 0)
    # rounded first: 10 x 2.6 is 26.000000000000004 in floats
    return math.ceil(round(budget * ((1 - floor) * n_heads + floor), 6))

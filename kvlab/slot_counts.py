"""How many slots each sequence keeps where: cache lengths as slot counts, kvpress's compression ratio per layer,
layer budgets planned per prompt (budget.py), the model-wide share of head_budget global; notices said once."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from kvlab import parallel
from kvlab.budget import DEFAULT_PYRAMID_BETA, plan_budgets, pyramid_ratio_schedule
from kvlab.cache import KVCache
from kvlab.config import CacheSpec, strategy_options
from kvlab.head_budget import DEFAULT_ADAKV_FLOOR, adakv_slots
from kvlab.model import Transformer
from kvlab.strategies import CACHE_STRATEGIES


def layer_options(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a layer of this strategy takes (a mixed config's options may be meant for its other layers)."""
    accepted = strategy_options(CACHE_STRATEGIES[strategy])
    return {k: v for k, v in options.items() if k in accepted}


def cache_slots(length: int | float | None, max_seq_length: int) -> int:
    """Slots for a cache length: a count, a fraction of max_seq_length, or None (every token)."""
    if length is None:
        return max_seq_length
    return min(round(length * max_seq_length) if isinstance(length, float) else length, max_seq_length)


def fitted_slots(strategy: str, options: dict[str, Any], length: int | float | None, whole: int) -> int:
    """cache_slots over `whole` tokens, raised to what the strategy needs (`min_slots`: its protected
    tokens + 1) when a fraction gives fewer, or when a large enough count is cut to a short sequence.
    A count below the need is left as it is: the cache refuses it, naming both numbers."""
    slots = cache_slots(length, whole)
    least = CACHE_STRATEGIES[strategy].min_slots(layer_options(strategy, options))
    if length is None or slots >= least or (isinstance(length, int) and length < least):
        return slots
    return least


def layer_slots(spec: CacheSpec, max_seq_length: int) -> list[int]:
    """Slots of each layer's buffer for sequences of up to max_seq_length tokens (fitted_slots), with
    one line saying so when a fraction was raised to the strategy's minimum."""
    slots = []
    for s, n in zip(spec.strategies, spec.lengths, strict=True):
        given, fitted = cache_slots(n, max_seq_length), fitted_slots(s, spec.options, n, max_seq_length)
        if isinstance(n, float) and fitted > given:
            outcome = "nothing is evicted" if fitted >= max_seq_length else f"using {fitted}"
            say_once(
                f"note: --max_cache_length {n} gives {given} of {max_seq_length} slots here; {s} needs at least "
                f"{fitted} (its protected tokens + 1), so {outcome}"
            )
        slots.append(fitted)
    return slots


_SAID: set[str] = set()
_QUIET = [False]


def say_once(line: str) -> None:
    """Print a notice to stderr the first time this process meets it (never inside `quiet_notices`)."""
    if line not in _SAID and not _QUIET[0]:
        _SAID.add(line)
        print(line, file=sys.stderr)


@contextlib.contextmanager
def quiet_notices() -> Iterator[None]:
    """No notices from the caches built inside: a warm-up's are about its own short prompts."""
    _QUIET[0] = True
    try:
        yield
    finally:
        _QUIET[0] = False


def ratio_keep(spec: CacheSpec, prefilled: Sequence[int]) -> list[list[int]]:
    """Prompt tokens each sequence keeps in each layer at spec.compression_ratio: int((1 - ratio) x its
    prefilled tokens) (with chunk_size, whole chunks: `chunk_ratio_keep`), or PyramidKVPress's per-layer counts
    (`pyramid_ratio_schedule`, over the compressing layers; reversed for funnel), each raised to what the layer's
    strategy needs (min_slots), with one line saying so. Full layers' entries are unused."""
    ratio, n_layer = spec.compression_ratio, len(spec.strategies)
    compressing = [i for i, n in enumerate(spec.lengths) if n is not None]
    least = [
        0 if n is None else CACHE_STRATEGIES[s].min_slots(layer_options(s, spec.options))
        for s, n in zip(spec.strategies, spec.lengths, strict=True)
    ]
    keep = []
    chunk = spec.options.get("chunk_size")
    for p in prefilled:
        row = [int((1 - ratio) * p) if chunk is None else chunk_ratio_keep(p, ratio, chunk)] * n_layer
        if spec.layer_budget in ("pyramid", "funnel"):
            window = spec.options.get("snapkv_window", max(least[i] for i in compressing) - 1)
            planned = pyramid_ratio_schedule(
                p, ratio, len(compressing), window, spec.budget_options.get("pyramid_beta", DEFAULT_PYRAMID_BETA)
            )
            for i, k in zip(compressing, planned[:: -1 if spec.layer_budget == "funnel" else 1], strict=True):
                row[i] = k
        keep.append(row)
    short = [
        (k, p, least[i])
        for row, p in zip(keep, prefilled, strict=True)
        for i in compressing
        if (k := row[i]) < least[i]
    ]
    if short:
        k, p, need = min(short)
        outcome = "nothing is evicted" if need >= p else f"keeping {need}"
        names = "/".join(dict.fromkeys(spec.strategies[i] for i in compressing))
        say_once(
            f"note: --compression_ratio {ratio} keeps {k} of {p} prompt tokens here; {names} needs at least "
            f"{need} (its protected tokens + 1), so {outcome}"
        )
    return [[max(k, need) for k, need in zip(row, least, strict=True)] for row in keep]


def chunk_ratio_keep(length: int, ratio: float, size: int) -> int:
    """kvpress's ChunkKVPress count: max(1, int((1 - ratio) x the chunks)) whole chunks of `size` of the
    `length` tokens, the newest (partial) chunk among them (it holds SnapKV's window and the protected newest
    token, so it is always kept); int((1 - ratio) x length) when no chunk is whole."""
    whole, rest = divmod(length, size)
    if whole == 0:
        return int((1 - ratio) * length)
    return max(1, int((whole + (rest > 0)) * (1 - ratio))) * size - (size - rest) * (rest > 0)


def head_slots(model: Transformer, budget: int, options: dict[str, Any]) -> int:
    """Buffer slots a compressing layer needs for a per-head `budget`: the budget itself, or with
    head_budget=adakv* the largest share Ada-KV may give one head (heads are query heads when snapkv_gqa=query),
    or with global the whole model's."""
    if options.get("head_budget", "uniform") == "uniform":
        return budget
    cfg = model.config
    heads = cfg.n_head if options.get("snapkv_gqa") == "query" else cfg.n_local_heads
    if options["head_budget"] == "global":
        return cfg.n_layer * heads * budget
    return adakv_slots(
        budget, heads, options.get("adakv_floor", DEFAULT_ADAKV_FLOOR), options["head_budget"] == "adakv_safeguard"
    )


def layer_floor(strategy: str, options: dict[str, Any]) -> int:
    """The fewest slots a layer of this strategy can work with: its protected tokens + 1."""
    return CACHE_STRATEGIES[strategy].protected_tokens(options) + 1


def plan_layer_budgets(spec: CacheSpec, lengths: Sequence[int], max_new_tokens: int, similarity: Tensor) -> Tensor:
    """[B, n_layer] slots per sequence and layer: each sequence's total over the compressing layers (as
    configured) split by `spec.layer_budget`; full layers get 0 (they keep every token anyway).
    similarity [B, n_layer] is the squeeze measure of every layer for every sequence."""
    compressing = [i for i, n in enumerate(spec.lengths) if n is not None]
    floor = [layer_floor(spec.strategies[i], spec.options) for i in compressing]
    rows = []
    for row, n in enumerate(lengths):
        own = n + max_new_tokens
        total = sum(cache_slots(spec.lengths[i], own) for i in compressing)
        if total < sum(floor):
            outcome = "nothing is evicted" if min(floor) >= own else "raising each layer to its minimum"
            say_once(
                f"note: the cache lengths give {total} slots over the compressing layers here; their strategies "
                f"need {sum(floor)}, so {outcome}"
            )
        planned = plan_budgets(
            spec.layer_budget, total, own, floor, similarity[row, compressing], **spec.budget_options
        )
        budgets = [0] * len(spec.lengths)
        for i, slots in zip(compressing, planned, strict=True):
            budgets[i] = slots
        rows.append(budgets)
    return torch.tensor(rows)


def share_over_model(
    caches: Sequence[KVCache], rankings: list[Tensor | None], ratio: float | None, prefilled: Sequence[int]
) -> None:
    """head_budget global, as kvpress's KVzipPress: the prompt tokens a sequence keeps over its L compressing layers
    and H KV heads (at a compression ratio, L x H x n - int(L x H x n x ratio) of its n prefilled tokens, as kvpress
    counts; else the sum of the layers' budgets) go to the top of their `rankings` ([B, H, T] per layer, None for a
    layer keeping every token) ranked together. A head's capacity: its count plus the slots its layer's budget leaves
    for later tokens (the decode room under a ratio), at least its protected tokens + 1."""
    layers = [i for i, r in enumerate(rankings) if r is not None]
    # [B, L, H, T], every rank's heads
    stacked = torch.stack([parallel.gather_heads(rankings[i]) for i in layers], dim=1)
    for row, n in enumerate(prefilled):
        # each layer's share of the prompt
        prompt_parts = [min(int(caches[i].row_budget[row] - caches[i].decode_room[row]), n) for i in layers]
        total = stacked.shape[1] * stacked.shape[2] * n
        kept = total - int(total * ratio) if ratio is not None else stacked.shape[2] * sum(prompt_parts)
        ranked = stacked[row, ..., :n]  # [L, H, n]: the prompt, or between prefill chunks the slots that hold it
        rank = ranked.flatten().argsort(descending=True, stable=True).argsort().view(ranked.shape)
        counts = parallel.local_heads((rank < kept).sum(dim=-1))  # [L, this rank's H]
        for j, i in enumerate(layers):
            cache = caches[i]
            # the slots its budget leaves for tokens after the prompt
            later = int(cache.row_budget[row]) - prompt_parts[j]
            cache.row_capacity[row, :, 0] = (counts[j] + later).clamp(
                min=cache.global_tokens + cache.recent_window + 1, max=cache.capacity
            )

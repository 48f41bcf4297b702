"""Caches from a `CacheSpec`: one cache per layer, buffers sized for the batch (static shapes), each
sequence limited to its own budget, and layer budgets planned per prompt (budget.py)."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from kvlab import parallel
from kvlab.budget import DEFAULT_PYRAMID_BETA, plan_budgets, pyramid_ratio_schedule
from kvlab.cache import KVCache
from kvlab.config import CacheSpec, strategy_options
from kvlab.eviction import EvictionCache
from kvlab.head_budget import DEFAULT_ADAKV_FLOOR, adakv_slots
from kvlab.model import Transformer
from kvlab.strategies import CACHE_STRATEGIES, COMPRESSOR_OPTIONS, PROMPT_COMPRESSORS, make_prompt_compressor


def make_caches(
    strategy: str,
    n_layer: int,
    batch_size: int,
    n_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    n_heads: int | None = None,
    history: int | None = None,
    token_classes: dict[str, tuple[int, ...]] | None = None,
    rope: tuple[Tensor, Tensor] | None = None,
    first_layer: int = 0,
    **options: Any,
) -> list[KVCache]:
    """One cache per layer for a named strategy, with the settings it declares (by flag name: storage,
    eviction, its prompt compressor's and its own). The builder passes what a cache's capabilities ask
    for: `history` (the longest sequence) and `n_heads` to caches that keep every token, the tokenizer's
    `token_classes` to caches that read token ids, its layer (from `first_layer`) to caches whose heads are
    calibrated per layer; snapkv_gqa=query needs `n_heads` (KVs per query head)."""
    if strategy not in CACHE_STRATEGIES:
        raise ValueError(f"unknown cache strategy {strategy!r}; choose from: {', '.join(CACHE_STRATEGIES)}")
    cls = CACHE_STRATEGIES[strategy]
    accepted = strategy_options(cls)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"cache strategy {strategy!r} does not take {', '.join(unknown)}; it takes: {', '.join(accepted)}"
        )
    if cls.shares_pool:  # one block pool for all the layers
        return cls.for_layers(n_layer, batch_size, n_kv_heads, capacity, head_dim, dtype, device, history, **options)
    kwargs: dict[str, Any] = {}
    if cls.takes_prompt_compressor:
        kwargs["rope"] = rope  # the model's RoPE cos/sin tables, for compressors that read positions from queries
        compressor_options = {k: options.pop(k) for k in list(options) if k in COMPRESSOR_OPTIONS}
        name = options.pop("prompt_compression_strategy", None)
        if compressor_options and name is None and strategy in PROMPT_COMPRESSORS:
            name = strategy  # its own prompt compressor takes its own options (lagkv with --lagkv_size)
        if compressor_options and name is None:
            raise ValueError(
                f"{', '.join(compressor_options)} apply to --prompt_compression_strategy "
                f"{', '.join({COMPRESSOR_OPTIONS[k] for k in compressor_options})}"
            )
        if name is not None:
            kwargs["prompt_compressor"] = make_prompt_compressor(name, **compressor_options)
        if compressor_options.get("snapkv_gqa") == "query":
            if n_heads is None:
                raise ValueError("snapkv_gqa='query' keeps tokens per query head: make_caches needs n_heads")
            kwargs["kv_repeat"] = n_heads // n_kv_heads
    kwargs |= {accepted[k].keyword: v for k, v in options.items()}
    if cls.keeps_history:
        kwargs |= dict(history=history, n_heads=n_heads)
    if cls.needs_tokens:
        kwargs |= token_classes or {}
    layers = [{"layer": first_layer + i} if cls.per_layer else {} for i in range(n_layer)]
    return [cls(batch_size, n_kv_heads, capacity, head_dim, dtype, device, **kwargs, **layer) for layer in layers]


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


def setup_caches(
    model: Transformer, spec: CacheSpec, batch_size: int, capacities: list[int], history: int
) -> list[KVCache]:
    """Attach one cache per layer (strategies per layer; each layer takes the options its strategy declares).
    Reuses the model's caches when they were built for the same spec and are still the ones attached (not
    caches a caller attached since), so a compiled decode step is not recompiled between calls."""
    # the model's dtype (quantized weights are integers); this rank's heads
    weight, attention = model.norm.weight, model.layers[0].attention
    key = (
        tuple(spec.strategies),
        batch_size,
        tuple(capacities),
        history,
        weight.dtype,
        sorted(spec.options.items()),
        sorted(spec.token_classes.items()),
    )
    current = [layer.attention.kv_cache for layer in model.layers]
    built = getattr(model, "cache_key", None)
    if built is not None and built[0] == key and all(c is b() for c, b in zip(current, built[1], strict=True)):
        for c in current:
            c.reset()
        return current
    caches: list[KVCache | None] = [None] * len(spec.strategies)
    shape, rope = (batch_size, attention.n_local_heads), (model.rope_cos, model.rope_sin)
    for s in dict.fromkeys(spec.strategies):
        layers = [i for i, name in enumerate(spec.strategies) if name == s]
        common = dict(
            n_heads=attention.n_head,
            history=history,
            token_classes=spec.token_classes,
            rope=rope,
            **layer_options(s, spec.options),
        )
        if CACHE_STRATEGIES[s].shares_pool:  # these layers share one block pool
            built = make_caches(
                s, len(layers), *shape, capacities[layers[0]], attention.head_dim, weight.dtype, weight.device, **common
            )
        else:
            built = [
                make_caches(
                    s,
                    1,
                    *shape,
                    capacities[i],
                    attention.head_dim,
                    weight.dtype,
                    weight.device,
                    first_layer=i,
                    **common,
                )[0]
                for i in layers
            ]
        for i, cache in zip(layers, built, strict=True):
            caches[i] = cache
            mark_slots_dynamic(cache)
            # CriticalKV weighs values through the layer's output projection
            if isinstance(cache, EvictionCache) and cache.value_weight == "wo_l1":
                cache.output_weight = model.layers[i].attention.wo.dequantize()
    model.setup_caches(caches)
    model.cache_key = (key, [weakref.ref(c) for c in caches])  # weak: a key keeps no replaced cache alive
    return caches


def build_caches(
    model: Transformer,
    spec: CacheSpec,
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    max_seq_length: int,
    budgets: Tensor | None = None,
    prefilled: Sequence[int] | None = None,
) -> list[KVCache]:
    """Caches for sequences of these prompt lengths: buffers sized by max_seq_length, and each sequence
    limited to its own fraction of prompt + max_new_tokens. With `budgets` [B, n_layer] (a planner's
    slots per sequence and layer, `plan_layer_budgets`), each compressing layer's buffer is sized to its
    largest row budget instead. With `spec.compression_ratio`, each sequence keeps that share of its
    `prefilled` prompt tokens (default: the whole prompt) plus room for every token decoded after them."""
    n_layer = model.config.n_layer
    if len(spec.strategies) != n_layer or len(spec.lengths) != n_layer:
        raise ValueError(
            f"per-layer cache settings need {n_layer} values, got {len(spec.strategies)} strategies and "
            f"{len(spec.lengths)} lengths"
        )
    if any(length is not None and s == "full" for s, length in zip(spec.strategies, spec.lengths, strict=True)):
        raise ValueError("the full cache keeps every token; a cache length needs a compressing --cache_strategy")
    if spec.compression_ratio is not None:
        return ratio_caches(model, spec, prompt_lengths, prefilled or prompt_lengths, max_new_tokens, max_seq_length)
    if budgets is None:
        slots = layer_slots(spec, max_seq_length)
    else:
        largest = budgets.max(dim=0).values.tolist()
        # m <= max(sequence, layer floor)
        slots = [max_seq_length if n is None else m for n, m in zip(spec.lengths, largest, strict=True)]
    capacities = [
        s if n is None else min(head_slots(model, s, layer_options(strategy, spec.options)), max(max_seq_length, s))
        for strategy, s, n in zip(spec.strategies, slots, spec.lengths, strict=True)
    ]
    caches = setup_caches(model, spec, len(prompt_lengths), capacities, max(max_seq_length, *capacities))
    for layer, (cache, strategy, length, most) in enumerate(
        zip(caches, spec.strategies, spec.lengths, slots, strict=True)
    ):
        if budgets is not None and length is not None:
            own = budgets[:, layer].tolist()
        elif budgets is not None:
            own = [most] * len(prompt_lengths)
        else:
            own = [
                fitted_slots(strategy, spec.options, length, n + max_new_tokens) if isinstance(length, float) else most
                for n in prompt_lengths
            ]
        cache.limit_rows(torch.tensor(own, device=model.tok_embeddings.weight.device))
    return caches


def ratio_caches(
    model: Transformer,
    spec: CacheSpec,
    prompt_lengths: Sequence[int],
    prefilled: Sequence[int],
    max_new_tokens: int,
    max_seq_length: int,
) -> list[KVCache]:
    """kvpress's compression ratio: a sequence keeps int((1 - ratio) x its prefilled tokens) of them in
    every compressing layer (with --layer_budget pyramid or funnel, kvpress's PyramidKVPress counts per
    layer), and its slots hold every token decoded afterwards (the prompt's remaining tokens, then all
    but the last generated one), so nothing is evicted after prefill. The slot axis is dynamic: one
    compiled step serves every batch."""
    keep = ratio_keep(spec, prefilled)
    room = [n - p + max_new_tokens - 1 for n, p in zip(prompt_lengths, prefilled, strict=True)]
    own = [[k + r for k in row] for row, r in zip(keep, room, strict=True)]
    most = max(max(row) for row in own)
    capacities = [
        max_seq_length
        if n is None
        else min(head_slots(model, most, layer_options(s, spec.options)), max(max_seq_length, most))
        for s, n in zip(spec.strategies, spec.lengths, strict=True)
    ]
    caches = setup_caches(model, spec, len(prompt_lengths), capacities, max(max_seq_length, *capacities))
    device = model.tok_embeddings.weight.device
    for layer, (cache, length) in enumerate(zip(caches, spec.lengths, strict=True)):
        if length is None:
            cache.limit_rows(torch.tensor([max_seq_length] * len(own), device=device))
        else:
            cache.limit_rows(
                torch.tensor([row[layer] for row in own], device=device), torch.tensor(room, device=device)
            )
    return caches


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


def mark_slots_dynamic(cache: KVCache) -> None:
    """Let the compiler treat a cache's slot axis (dim 2 of every [B, H, slots, ...] buffer, dim 1 of a
    [B, slots] one) as symbolic, so one compiled decode step serves every prompt length and every plan instead
    of compiling again for each (tested: one graph for several lengths and plans). A strategy whose step
    reads its slot count as a number is specialized to it, as before, rather than refused. Only once the compiler is
    loaded (torch.compile imports it, as `compile_decode_step` does before caches are built): an eager process never
    compiles, and importing it for the marks would cost it ~70 MB."""
    if "torch._dynamo" not in sys.modules:
        return
    if cache.shares_pool or cache.capacity < 2:  # block tables: no slot axis sized by the plan; 0 and 1 are specialized
        return
    for buffer in cache.buffers():
        if buffer.dim() >= 3 and buffer.shape[2] == cache.capacity:
            torch._dynamo.maybe_mark_dynamic(buffer, 2)
        elif buffer.dim() == 2 and buffer.shape[1] == cache.capacity:
            torch._dynamo.maybe_mark_dynamic(buffer, 1)


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

"""Caches from a `CacheSpec`: one cache per layer, buffers sized for the batch (static shapes), each
sequence limited to its own budget, and layer budgets planned per prompt (budget.py)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kvlab.cache import KVCache
from kvlab.config import CacheSpec, strategy_options
from kvlab.eviction import EvictionCache
from kvlab.model import Transformer
from kvlab.slot_counts import fitted_slots, head_slots, layer_options, layer_slots, ratio_keep
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
    current = reusable_caches(model, key)
    if current is not None:
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


def reusable_caches(model: Transformer, key: tuple) -> list[KVCache] | None:
    """The model's attached caches, reset, when they were built for `key` and are still the ones attached; else
    None."""
    current = [layer.attention.kv_cache for layer in model.layers]
    built = getattr(model, "cache_key", None)
    if built is None or built[0] != key or not all(c is b() for c, b in zip(current, built[1], strict=True)):
        return None
    for c in current:
        c.reset()
    return current


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

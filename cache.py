"""KV caches: the interface between attention and every compression strategy.

A cache is an `nn.Module` holding static-shape buffers for one layer. The attention layer calls:

    prefill(input_pos, k, v, q)      once per prompt, after exact attention over the prompt: store
                                     (or compress) the prompt's keys/values.
    update(input_pos, k, v, q)       each decode step: insert the step's keys/values, return
                                     (keys, values, key_pos) to attend over. key_pos holds each
                                     slot's token position, -1 for an empty slot; it is [B, S] when
                                     shared by all KV heads or [B, H_kv, S] when heads keep
                                     different tokens. The causal mask is derived from it.
    observe(probs)                   only if `needs_attention`: the step's attention probabilities
                                     [B, H_kv, group, T, S], for strategies that learn from them.

Shapes: input_pos [B, T] (position in its own sequence, -1 = padding); k, v [B, H_kv, T, D];
q [B, H, T, D] (for caches that select tokens per query). Everything stays static-shape so the
decode step compiles with `fullgraph=True`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from prompt_compression import PromptCompressor, make_prompt_compressor


class KVCache(nn.Module):
    needs_attention: bool = False
    positions_per_head: bool = False  # True when KV heads keep different tokens: pos is [B, H_kv, S]

    def __init__(self, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        pos_shape = (batch_size, n_kv_heads, capacity) if self.positions_per_head else (batch_size, capacity)
        self.register_buffer("pos", torch.full(pos_shape, -1, dtype=torch.long, device=device), persistent=False)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        raise NotImplementedError

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def observe(self, probs: Tensor) -> None:
        """Receive attention probabilities; only called when `needs_attention` is True."""

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values (the number a compression strategy shrinks)."""
        return self.k_cache.nbytes + self.v_cache.nbytes


class FullCache(KVCache):
    """No compression: token at position p lives in slot p. The reference every strategy is measured against."""

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        T = k.shape[2]
        if T > self.capacity:
            raise ValueError(f"prompt of {T} tokens does not fit a full cache of {self.capacity} slots")
        self.k_cache[:, :, :T] = k
        self.v_cache[:, :, :T] = v
        self.pos[:, :T] = input_pos

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        index = input_pos[:, None, :, None].expand_as(k)
        self.k_cache.scatter_(2, index, k)
        self.v_cache.scatter_(2, index, v)
        self.pos.scatter_(1, input_pos, input_pos)
        return self.k_cache, self.v_cache, self.pos


class EvictionCache(KVCache):
    """A fixed number of slots per (sequence, KV head). When the prompt is longer than the cache, the
    most important prompt tokens are kept; during decoding each new token replaces the least important
    slot. Subclasses only score slots (`_token_importances`, higher = keep; `_eviction_idx` to choose
    differently); prompt tokens are scored by a `PromptCompressor` (prompt_compression.py). The first
    `global_tokens` positions (attention sinks) and the newest `recent_window` positions, the incoming
    token included, are always protected. All choices are argmin/topk/scatter: static shapes, no data-
    dependent Python branching, so the decode step compiles with fullgraph=True."""

    positions_per_head = True
    default_global_tokens = 4
    default_prompt_compressor = "recent_global"

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        global_tokens: int | None = None,
        recent_window: int = 10,
        prompt_compressor: PromptCompressor | None = None,
    ) -> None:
        super().__init__(batch_size, n_kv_heads, capacity, head_dim, dtype, device)
        self.prompt_compressor = prompt_compressor or make_prompt_compressor(self.default_prompt_compressor)
        self.global_tokens = self.default_global_tokens if global_tokens is None else global_tokens
        self.recent_window = recent_window
        if self.global_tokens < 0 or recent_window < 1 or self.global_tokens + recent_window >= capacity:
            raise ValueError(
                f"{type(self).__name__}: need global_tokens >= 0, recent_window >= 1 and global_tokens + recent_window < cache length; "
                f"got {self.global_tokens} + {recent_window} for a cache of {capacity} slots"
            )

    def _token_importances(self) -> Tensor:
        """[B, H_kv, S] score of each filled slot; the lowest unprotected one is evicted."""
        raise NotImplementedError

    def _eviction_idx(self, input_pos: Tensor) -> Tensor:
        """[B, H_kv, 1] the slot each (sequence, KV head) gives to the incoming token: an empty one, else the least important."""
        return self._protect(self._token_importances(), self.pos, input_pos[:, :, None]).argmin(dim=-1, keepdim=True)

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        """Strategy state for newly written slots [B, H_kv, N]; `scores` are their prompt importances (None in decode)."""

    def _protect(self, scores: Tensor, pos: Tensor, current: Tensor) -> Tensor:
        """Empty slots go first (-inf), sinks and the recent window never (+inf). current: [B, 1, 1] newest position."""
        protected = (pos < self.global_tokens) | (pos > current - self.recent_window)
        scores = scores.float().masked_fill(protected, float("inf"))
        return scores.masked_fill(pos < 0, float("-inf"))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        B, H, T, D = k.shape
        if T > self.capacity and not self.prompt_compressor.compresses:
            raise ValueError(f"a prompt of {T} tokens does not fit a cache of {self.capacity} slots without a prompt compressor")
        n_keep = min(T, self.capacity)
        pos = input_pos[:, None, :].expand(B, H, T)
        scores = self.prompt_compressor(input_pos, k, q)
        last = input_pos.max(dim=-1).values[:, None, None]
        keep = self._protect(scores, pos, last).topk(n_keep, dim=-1).indices.sort(dim=-1).values  # [B, H, n_keep], in prompt order
        index = keep[..., None].expand(B, H, n_keep, D)
        self.k_cache[:, :, :n_keep] = k.gather(2, index)
        self.v_cache[:, :, :n_keep] = v.gather(2, index)
        self.pos[:, :, :n_keep] = pos.gather(2, keep)
        self._on_insert(torch.arange(n_keep, device=k.device).expand(B, H, n_keep), scores.gather(2, keep))

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, _, D = k.shape
        slot = self._eviction_idx(input_pos)
        self.k_cache.scatter_(2, slot[..., None].expand(B, H, 1, D), k)
        self.v_cache.scatter_(2, slot[..., None].expand(B, H, 1, D), v)
        self.pos.scatter_(2, slot, input_pos[:, None, :].expand(B, H, 1))
        self._on_insert(slot, None)
        return self.k_cache, self.v_cache, self.pos


class WindowCache(EvictionCache):
    """Sliding window: keep the most recent tokens (Beltagy et al., Longformer, 2020)."""

    default_global_tokens = 0

    def _token_importances(self) -> Tensor:
        return self.pos


class RecentGlobalCache(WindowCache):
    """StreamingLLM: attention sinks (the first tokens) + the most recent tokens (Xiao et al., 2023)."""

    default_global_tokens = 4


class RandomCache(EvictionCache):
    """Evict a random unprotected token: the baseline every importance score must beat."""

    default_prompt_compressor = "random"

    def _token_importances(self) -> Tensor:
        return torch.rand(self.pos.shape, device=self.pos.device)


class L2Cache(EvictionCache):
    """Keep keys with a low L2 norm, which draw high attention (Devoto et al., 2024)."""

    default_prompt_compressor = "l2"

    def _token_importances(self) -> Tensor:
        return -self.k_cache.float().norm(dim=-1)


class AttentionScoredCache(EvictionCache):
    """Base for strategies that score slots from attention probabilities, kept in `scores` [B, H_kv, S]."""

    needs_attention = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("scores", torch.zeros(self.pos.shape, device=self.pos.device), persistent=False)

    def reset(self) -> None:
        super().reset()
        self.scores.zero_()

    def _token_importances(self) -> Tensor:
        return self.scores

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        if scores is None:
            self.scores.scatter_(2, slots, 0.0)
            return
        # A compressor marks tokens it always keeps (SnapKV's window) with +inf: they start as their head's top token.
        finite = scores.isfinite()
        top = scores.masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True).clamp(min=0)
        self.scores.scatter_(2, slots, torch.where(finite, scores, top).float())


class HeavyHitterCache(AttentionScoredCache):
    """H2O: keep the tokens with the largest attention accumulated over all queries so far (Zhang et al., 2023).
    Scores are summed over the query heads sharing a KV head."""

    default_prompt_compressor = "heavy_hitter"

    def observe(self, probs: Tensor) -> None:
        self.scores += probs.sum(dim=(2, 3))


class TOVACache(AttentionScoredCache):
    """TOVA: evict the token the current query attends to least (Oren et al., 2024)."""

    default_prompt_compressor = "tova"

    def observe(self, probs: Tensor) -> None:
        self.scores.copy_(probs[:, :, :, -1].sum(dim=2))


CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "window": WindowCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "heavy_hitter": HeavyHitterCache,
    "tova": TOVACache,
}


def make_caches(
    strategy: str,
    n_layer: int,
    batch_size: int,
    n_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    prompt_compression_strategy: str | None = None,
    **options,
) -> list[KVCache]:
    """One cache per layer for a named strategy. `options` are the eviction settings (global_tokens,
    recent_window) and the prompt compressor's (snapkv_window, snapkv_kernel, snapkv_pooling, snapkv_gqa)."""
    if strategy not in CACHE_STRATEGIES:
        raise ValueError(f"unknown cache strategy {strategy!r}; choose from: {', '.join(CACHE_STRATEGIES)}")
    cls = CACHE_STRATEGIES[strategy]
    if not issubclass(cls, EvictionCache):
        if options or prompt_compression_strategy not in (None, "full"):
            raise ValueError(f"cache strategy {strategy!r} keeps every token: it takes no eviction or prompt compression options")
        return [cls(batch_size, n_kv_heads, capacity, head_dim, dtype, device) for _ in range(n_layer)]
    snapkv = {k.removeprefix("snapkv_"): options.pop(k) for k in list(options) if k.startswith("snapkv_")}
    compressor = make_prompt_compressor(prompt_compression_strategy or cls.default_prompt_compressor, **snapkv)
    return [cls(batch_size, n_kv_heads, capacity, head_dim, dtype, device, prompt_compressor=compressor, **options) for _ in range(n_layer)]

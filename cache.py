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


class KVCache(nn.Module):
    needs_attention: bool = False

    def __init__(self, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("pos", torch.full((batch_size, capacity), -1, dtype=torch.long, device=device), persistent=False)

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


CACHE_STRATEGIES: dict[str, type[KVCache]] = {"full": FullCache}


def make_caches(
    strategy: str, n_layer: int, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device | None = None
) -> list[KVCache]:
    """One cache per layer for a named strategy."""
    if strategy not in CACHE_STRATEGIES:
        raise ValueError(f"unknown cache strategy {strategy!r}; choose from: {', '.join(CACHE_STRATEGIES)}")
    cls = CACHE_STRATEGIES[strategy]
    return [cls(batch_size, n_kv_heads, capacity, head_dim, dtype, device) for _ in range(n_layer)]

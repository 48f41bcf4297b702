"""The KV cache interface: what attention calls, and the state every cache shares.

A cache is an `nn.Module` holding static-shape buffers for one layer. The attention layer calls:

    prefill(input_pos, k, v, q)      once per prompt, after exact attention over the prompt: store
                                     (or compress) the prompt's keys/values.
    update(input_pos, k, v, q)       each decode step: insert the step's keys/values, return
                                     (keys, values, key_pos) to attend over. key_pos holds each
                                     slot's token position, -1 for an empty slot; it is [B, S] when
                                     shared by all KV heads or [B, H_kv, S] when heads keep
                                     different tokens ([B, H, S] with keys per query head). The
                                     causal mask is derived from it.
    observe(probs)                   only if `needs_attention`: the step's attention probabilities
                                     [B, H_kv, group, T, S], for strategies that learn from them.
    maintain()                       on the host after every decode step, outside the compiled step: upkeep
                                     on a schedule (ClusterKV clusters the newest tokens every m steps).
    limit_rows(capacities)           per-sequence slot limits [B] (a fraction of each sequence's own
                                     length, per KV head); caches that keep every token ignore them.

Caches with `needs_tokens` also receive the token ids [B, T] as `tokens=` in prefill and update.

Shapes: input_pos [B, T] (position in its own sequence, -1 = padding); k, v [B, H_kv, T, D];
q [B, H, T, D] (for caches that select tokens per query). Everything stays static-shape so the
decode step compiles with `fullgraph=True`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from storage import make_storage


class KVCache(nn.Module):
    needs_attention: bool = False
    needs_tokens: bool = False
    options: tuple[str, ...] = ("cache_bits", "key_quant_axis")  # settings `make_caches` accepts for this strategy
    positions_per_head: bool = False  # True when KV heads keep different tokens: pos is [B, H_kv, S]

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        cache_bits: int | None = None,
        key_quant_axis: str | None = None,
    ) -> None:
        super().__init__()
        self.capacity = capacity
        self.storage = make_storage((batch_size, n_kv_heads, capacity, head_dim), dtype, device, cache_bits, key_quant_axis)
        pos_shape = (batch_size, n_kv_heads, capacity) if self.positions_per_head else (batch_size, capacity)
        self.register_buffer("pos", torch.full(pos_shape, -1, dtype=torch.long, device=device), persistent=False)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        raise NotImplementedError

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def observe(self, probs: Tensor) -> None:
        """Receive attention probabilities; only called when `needs_attention` is True."""

    def maintain(self) -> None:
        """Host-side upkeep after each decode step (most caches need none)."""

    def limit_rows(self, capacities: Tensor) -> None:
        """Slots each sequence may fill, [B] (<= capacity); only caches that evict use it."""

    def stats(self) -> dict[str, int]:
        """Counts worth reporting at the end of a run (e.g. hybrid's heads per policy)."""
        return {}

    def head_budgets(self) -> Tensor | None:
        """[B, H_kv] slots each sequence's KV heads may fill, or None where every token is kept."""
        return None

    def tokens_held(self) -> Tensor:
        """[B] tokens each sequence holds now, per KV head (mean over heads)."""
        filled = (self.pos >= 0).flatten(1).sum(dim=1)
        return filled / (self.pos.shape[1] if self.positions_per_head else 1)

    def reset(self) -> None:
        self.storage.reset()
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values (the number a compression strategy shrinks)."""
        return self.storage.nbytes()

"""Diagnostics that compare a compressed cache with a full cache run alongside it.

Attention loss (Cold Compress): at each decode step, the probability mass that full attention puts on
tokens the compressed cache no longer holds, 1 - sum(p_full over kept tokens). It is 0 for the full
cache and grows as eviction discards tokens the model would have attended to.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from cache import FullCache, KVCache


class AttentionLossProbe(nn.Module):
    """Wraps any cache, with the same interface: the model attends over the wrapped (compressed) cache
    exactly as without the probe, while a full cache of every token measures what compression lost.
    Records one value per decode step: the loss averaged over query heads, [B]. Eager only (it keeps a
    Python list)."""

    def __init__(self, inner: KVCache, full: FullCache) -> None:
        super().__init__()
        self.inner, self.full = inner, full
        self.needs_attention, self.needs_tokens = inner.needs_attention, inner.needs_tokens
        self.capacity = inner.capacity
        self.losses: list[Tensor] = []

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **token_ids: Tensor) -> None:
        self.inner.prefill(input_pos, k, v, q, **token_ids)
        self.full.prefill(input_pos, k, v, q)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **token_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        keys, values, key_pos = self.inner.update(input_pos, k, v, q, **token_ids)
        full_keys, _, full_pos = self.full.update(input_pos, k, v, q)
        B, H, T, D = q.shape
        n_kv = full_keys.shape[1]
        scores = (q.reshape(B, n_kv, H // n_kv, T, D) @ full_keys[:, :, None].transpose(-1, -2)).float() / math.sqrt(D)
        visible = (full_pos >= 0) & (full_pos <= input_pos[:, -1:])  # [B, S]
        probs = scores.masked_fill(~visible[:, None, None, None, :], float("-inf")).softmax(dim=-1)  # [B, H_kv, group, T, S]
        inner_pos = key_pos if key_pos.dim() == 3 else key_pos[:, None, :]  # [B, 1, H_kv or H, S']
        kept = (inner_pos[..., None] == full_pos[:, None, None, :]).any(dim=2) & visible[:, None, :]  # [B, 1 or H_kv or H, S]
        kept = kept.view(B, -1, kept.shape[1] // n_kv if kept.shape[1] > n_kv else 1, 1, kept.shape[-1])  # per KV head, or per query head
        retained = (probs * kept).sum(dim=-1)
        self.losses.append(1 - retained.mean(dim=(1, 2, 3)))
        return keys, values, key_pos

    def observe(self, probs: Tensor) -> None:
        self.inner.observe(probs)

    def limit_rows(self, capacities: Tensor) -> None:
        self.inner.limit_rows(capacities)

    def tokens_held(self) -> Tensor:
        return self.inner.tokens_held()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def reset(self) -> None:
        self.inner.reset()
        self.full.reset()
        self.losses.clear()

    def nbytes(self) -> int:
        return self.inner.nbytes()


def attention_loss_summary(probes: list[AttentionLossProbe]) -> dict[str, list[float]]:
    """Per layer (mean over steps and sequences) and over time (mean over layers and sequences, per step)."""
    per_step = torch.stack([torch.stack(p.losses) for p in probes])  # [layers, steps, B]
    return {"per_layer": per_step.mean(dim=(1, 2)).tolist(), "per_step": per_step.mean(dim=(0, 2)).tolist()}

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
        self.needs_attention = inner.needs_attention
        self.capacity = inner.capacity
        self.losses: list[Tensor] = []

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        self.inner.prefill(input_pos, k, v, q)
        self.full.prefill(input_pos, k, v, q)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        keys, values, key_pos = self.inner.update(input_pos, k, v, q)
        full_keys, _, full_pos = self.full.update(input_pos, k, v, q)
        B, H, T, D = q.shape
        n_kv = full_keys.shape[1]
        scores = (q.reshape(B, n_kv, H // n_kv * T, D) @ full_keys.transpose(-1, -2)).float() / math.sqrt(D)
        visible = (full_pos >= 0) & (full_pos <= input_pos[:, -1:])  # [B, S]
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(dim=-1)  # [B, H_kv, group*T, S]
        inner_pos = key_pos if key_pos.dim() == 3 else key_pos[:, None, :].expand(B, n_kv, -1)
        kept = (inner_pos[:, :, :, None] == full_pos[:, None, None, :]).any(dim=2) & visible[:, None, :]  # [B, H_kv, S]
        retained = (probs * kept[:, :, None, :]).sum(dim=-1)
        self.losses.append(1 - retained.mean(dim=(1, 2)))
        return keys, values, key_pos

    def observe(self, probs: Tensor) -> None:
        self.inner.observe(probs)

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

"""Diagnostics that compare a compressed cache with a full cache run alongside it.

Attention loss (Cold Compress): at each decode step, the probability mass that full attention puts on
tokens the compressed cache no longer holds, 1 - sum(p_full over kept tokens). It is 0 for the full
cache and grows as eviction discards tokens the model would have attended to.

Top-B recall (ClusterKV): at each decode step and for each query head, the share of the B tokens with
the largest full attention that the compressed cache attends, B being the number of tokens it attends
(its budget; every token it holds for an evicting cache, the selected ones for a recallable cache).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.cache import FullCache, KVCache


class AttentionLossProbe(KVCache):
    """Wraps any cache, with the same interface: the model attends over the wrapped (compressed) cache
    exactly as without the probe, while a full cache of every token measures what compression lost.
    Records per decode step the loss and the top-B recall, averaged over query heads, [B] each. Eager
    only (it keeps Python lists)."""

    def __init__(self, inner: KVCache, full: FullCache) -> None:
        nn.Module.__init__(self)  # no storage of its own: it wraps one
        self.inner, self.full = inner, full
        self.needs_attention, self.needs_tokens, self.needs_prompt_lse = (
            inner.needs_attention,
            inner.needs_tokens,
            inner.needs_prompt_lse,
        )
        self.capacity = inner.capacity
        self.losses: list[Tensor] = []
        self.recalls: list[Tensor] = []

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **extra: Tensor) -> None:
        self.inner.prefill(input_pos, k, v, q, **extra)
        self.full.prefill(input_pos, k, v, q)

    def update(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **token_ids: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        keys, values, key_pos = self.inner.update(input_pos, k, v, q, **token_ids)
        full_keys, _, full_pos = self.full.update(input_pos, k, v, q)
        B, H, T, D = q.shape
        n_kv = full_keys.shape[1]
        scores = (q.reshape(B, n_kv, H // n_kv, T, D) @ full_keys[:, :, None].transpose(-1, -2)).float() / math.sqrt(D)
        visible = (full_pos >= 0) & (full_pos <= input_pos[:, -1:])  # [B, S]
        # [B, H_kv, group, T, S]
        probs = scores.masked_fill(~visible[:, None, None, None, :], float("-inf")).softmax(dim=-1)
        inner_pos = key_pos if key_pos.dim() == 3 else key_pos[:, None, :]  # [B, 1, H_kv or H, S']
        # [B, 1 or H_kv or H, S]
        kept = (inner_pos[..., None] == full_pos[:, None, None, :]).any(dim=2) & visible[:, None, :]
        # per KV head, or per query head
        kept = kept.view(B, -1, kept.shape[1] // n_kv if kept.shape[1] > n_kv else 1, 1, kept.shape[-1])
        retained = (probs * kept).sum(dim=-1)
        self.losses.append(1 - retained.mean(dim=(1, 2, 3)))
        budget = kept.sum(dim=-1, keepdim=True)  # tokens attended, per head
        # each query head's top-B full-attention tokens
        top = probs.argsort(dim=-1, descending=True).argsort(dim=-1) < budget
        self.recalls.append(((top & kept).sum(dim=-1) / budget[..., 0].clamp(min=1)).mean(dim=(1, 2, 3)))
        return keys, values, key_pos

    def observe(self, probs: Tensor) -> None:
        self.inner.observe(probs)

    def limit_rows(self, capacities: Tensor, decode_room: Tensor | None = None) -> None:
        self.inner.limit_rows(capacities, decode_room)

    def maintain(self) -> None:
        self.inner.maintain()

    def compact(self) -> None:
        self.inner.compact()

    def tokens_held(self) -> Tensor:
        return self.inner.tokens_held()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def reset(self) -> None:
        self.inner.reset()
        self.full.reset()
        self.losses.clear()
        self.recalls.clear()

    def nbytes(self) -> int:
        return self.inner.nbytes()


def attention_loss_summary(probes: list[AttentionLossProbe]) -> dict[str, list[float]]:
    """Attention loss and top-B recall per layer (mean over steps and sequences) and over time (mean over
    layers and sequences, per step) and per sequence (mean over layers and steps): keys per_layer, per_step,
    per_sequence, and the same prefixed recall_."""
    summary = {}
    for name, values in (("", [p.losses for p in probes]), ("recall_", [p.recalls for p in probes])):
        per_step = torch.stack([torch.stack(v) for v in values])  # [layers, steps, B]
        for key, dims in (("per_layer", (1, 2)), ("per_step", (0, 2)), ("per_sequence", (0, 1))):
            summary[f"{name}{key}"] = per_step.mean(dim=dims).tolist()
    return summary

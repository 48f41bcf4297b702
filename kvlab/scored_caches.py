"""The two scored families of evicting caches: a strategy whose score reads the keys alone (`KeyScoredCache`) and one
whose score is the attention its slots receive (`AttentionScoredCache`); the slots, budgets and protection are
`EvictionCache`'s (eviction.py), each score is written once in scores.py."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.eviction import EvictionCache
from kvlab.prompt_compression import AttentionScores, KeyScores, PromptCompressor
from kvlab.scores import attention_mass, layer_attention_mass
from kvlab.storage import rows_and_heads


class KeyScoredCache(EvictionCache):
    """A strategy whose score reads the keys alone (`key_score`, from scores.py): the same function
    ranks the prompt at prefill and the cached slots at every decode step."""

    key_score: Callable[[Tensor, Tensor], Tensor]

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        return KeyScores(cls.key_score)

    def _token_importances(self) -> Tensor:
        return self.key_score(self.storage.read()[0], self.pos)


class AttentionScoredCache(EvictionCache):
    """A strategy that scores slots by the attention they receive (`attention_mass`), kept in `scores`
    [B, H_kv, S]. At prefill the prompt is scored by the attention of its last `observed_queries`
    queries (None: all of them); while decoding, each step's attention is added (`accumulate`, H2O)
    or replaces the scores (TOVA). With `shared_heads`, the attention is averaged over every query head of the
    layer, so each KV head keeps the same tokens in the same slots (TOVA's paper and kvpress)."""

    needs_attention = True
    observed_queries: int | None = None
    accumulate = True
    shared_heads = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("scores", torch.zeros(self.pos.shape, device=self.pos.device), persistent=False)

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        return AttentionScores(cls.observed_queries, shared_heads=cls.shared_heads)

    def reset(self) -> None:
        super().reset()
        self.scores.zero_()

    def _token_importances(self) -> Tensor:
        return self.scores

    def _with_running_scores(self, scores: Tensor, order: Tensor) -> Tensor:
        if not self.accumulate:
            return scores
        return scores + F.pad(self.scores, (0, order.shape[-1] - self.scores.shape[-1])).gather(2, order)

    def observe(self, probs: Tensor) -> None:
        mass = layer_attention_mass(probs) if self.shared_heads else attention_mass(probs)
        if self.accumulate:
            self.scores += mass
        else:
            self.scores.copy_(mass)

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        if scores is None:
            zero = torch.zeros((), device=slots.device)
            self.scores.index_put_(rows_and_heads(slots) + (slots,), zero)  # in place when compiled, as scatter_ is not
            return
        # A compressor marks tokens it always keeps (SnapKV's window) with +inf: they start as their head's top token.
        finite = scores.isfinite()
        top = scores.masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True).clamp(min=0)
        self.scores.scatter_(2, slots, torch.where(finite, scores, top).float())

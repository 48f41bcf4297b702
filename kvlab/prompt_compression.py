"""Prompt compressors: score every prompt token once, at prefill, so that a cache shorter than the
prompt keeps the most important ones (the cache itself protects sinks and the recent window).

A compressor maps the prompt's (input_pos [B, T], keys [B, H_kv, T, D], queries [B, H, T, D]) to
importances [B, H_kv, T] (higher = keep). Each applies a score from `scores.py`; an evicting strategy's
default compressor is its own score (`EvictionCache.own_prompt_compressor`), and caches that learn
from attention (heavy_hitter, tova) start their running scores from these importances. The registry,
which adds every scored strategy's own compressor under its name, is in `strategies.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvlab.options import Option, choice, integer
from kvlab.scores import attention_mass, pool_keys, window_attention


class PromptCompressor:
    compresses = True
    options: tuple[Option, ...] = ()  # settings it takes (flag and YAML names), passed as their `keyword`

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError


class KeepAll(PromptCompressor):
    """No compression: the prompt must fit the cache (the cache raises otherwise)."""

    compresses = False

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return torch.zeros(k.shape[:3], device=k.device)


class KeyScores(PromptCompressor):
    """A key score (recency, l2_norm, keydiff, ...) over the prompt's keys."""

    def __init__(self, score: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.score = score

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return self.score(k, input_pos[:, None, :].expand(k.shape[:3]))


class AttentionScores(PromptCompressor):
    """The attention each prompt key receives from the last `window` prompt queries (None: all of them,
    H2O; 1: the last, TOVA), summed over the query group. With `per_query`, the sum is divided by the
    number of observed queries that could see each token: the mean attention it received, so early
    tokens are not favoured for being seen by more queries (heavy_hitter_mean)."""

    def __init__(self, window: int | None = None, per_query: bool = False) -> None:
        self.window, self.per_query = window, per_query

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        scores = attention_mass(window_attention(input_pos, k, q, self.window))
        if not self.per_query:
            return scores
        seen_by = (input_pos.max(dim=-1, keepdim=True).values - input_pos + 1).clamp(min=1)  # [B, T]
        return scores / seen_by[:, None, :]


class SnapKV(PromptCompressor):
    """SnapKV (Li et al., 2024): the attention that the last `window` prompt queries (the observation
    window) pay to each key, pooled along the sequence so neighbours of important tokens survive too;
    the window's own keys are always kept. Scores are aggregated over the query heads that share a KV
    head (`gqa`: mean, max or sum) so selection happens per KV head, keeping GQA's memory savings; or,
    with gqa="query", each query head selects its own tokens as in the reference code: the cache then
    repeats the KVs for every query head (the cache builder arranges it), which costs group-size x memory."""

    options = (
        integer("snapkv_window", 16, "snapkv: observation window of last prompt queries", param="window"),
        integer("snapkv_kernel", 7, "snapkv: odd pooling kernel size", odd=True, param="kernel"),
        choice("snapkv_pooling", ("max", "avg"), "max", "snapkv: max or avg pooling", valid="max or avg", param="pooling"),
        choice(
            "snapkv_gqa",
            ("mean", "max", "sum", "query"),
            "mean",
            "snapkv: aggregation over the query heads of a KV head (mean, max, sum), or query: select per query head as the reference "
            "code does, repeating KVs per query head (group-size x memory)",
            valid="mean, max, sum or query",
            param="gqa",
        ),
    )

    def __init__(self, window: int = 16, kernel: int = 7, pooling: str = "max", gqa: str = "mean") -> None:
        for option, value in zip(self.options, (window, kernel, pooling, gqa), strict=True):
            option.validate(value)
        self.window, self.kernel, self.pooling, self.gqa = window, kernel, pooling, gqa

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        probs = window_attention(input_pos, k, q, self.window).sum(dim=3)  # [B, H_kv, group, T]
        if self.gqa == "query" and probs.shape[2] != 1:
            raise ValueError("snapkv gqa='query' needs a cache holding one KV head per query head (snapkv_gqa query sets kv_repeat)")
        scores = {"mean": probs.mean, "max": lambda dim: probs.max(dim=dim).values, "sum": probs.sum, "query": probs.sum}[self.gqa](dim=2)
        scores = pool_keys(scores, self.kernel, self.pooling)
        last = input_pos.max(dim=-1, keepdim=True).values
        in_window = (input_pos > last - self.window) & (input_pos >= 0)
        return scores.masked_fill(in_window[:, None, :], float("inf"))

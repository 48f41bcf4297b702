"""Prompt compressors: score every prompt token once, at prefill, so that a cache shorter than the
prompt keeps the most important ones (the cache itself protects sinks and the recent window).

A compressor maps the prompt's (input_pos [B, T], keys [B, H_kv, T, D], queries [B, H, T, D]) to
importances [B, H_kv, T] (higher = keep). Caches that learn from attention (heavy_hitter, tova) start
their running scores from these importances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SNAPKV_OPTIONS = ("window", "kernel", "pooling", "gqa")


class PromptCompressor:
    compresses = True

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError


class KeepAll(PromptCompressor):
    """No compression: the prompt must fit the cache (the cache raises otherwise)."""

    compresses = False

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return torch.zeros(k.shape[:3], device=k.device)


class RecentCompressor(PromptCompressor):
    """Keep the most recent prompt tokens (with the cache's sinks: StreamingLLM)."""

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return input_pos[:, None, :].expand(k.shape[:3]).float()


class RandomCompressor(PromptCompressor):
    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return torch.rand(k.shape[:3], device=k.device)


class L2Compressor(PromptCompressor):
    """Keep low-norm keys (Devoto et al., 2024)."""

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return -k.float().norm(dim=-1)


class HeavyHitterCompressor(PromptCompressor):
    """H2O at prefill: attention accumulated over every prompt query, summed over the query group."""

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        return prompt_attention(q, k, input_pos, input_pos).sum(dim=(2, 3))


class MeanHeavyHitterCompressor(PromptCompressor):
    """H2O's prompt scores divided by the number of prompt queries that could attend to each token: the
    mean attention a token received rather than the sum, which otherwise grows with how early the token
    is (a key at position p is seen by T - p queries) and crowds out a late, important span."""

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        seen_by = (input_pos.max(dim=-1, keepdim=True).values - input_pos + 1).clamp(min=1)  # [B, T]
        return prompt_attention(q, k, input_pos, input_pos).sum(dim=(2, 3)) / seen_by[:, None, :]


class TOVACompressor(PromptCompressor):
    """TOVA at prefill: the attention of each sequence's last prompt token."""

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        last = input_pos.argmax(dim=-1, keepdim=True)
        q_last = q.gather(2, last[:, None, :, None].expand(-1, q.shape[1], 1, q.shape[3]))
        return prompt_attention(q_last, k, input_pos, input_pos.gather(1, last)).sum(dim=(2, 3))


class SnapKVCompressor(PromptCompressor):
    """SnapKV (Li et al., 2024): the attention that the last `window` prompt queries (the observation
    window) pay to each key, pooled along the sequence so neighbours of important tokens survive too;
    the window's own keys are always kept. Scores are aggregated over the query heads that share a KV
    head (`gqa`: mean, max or sum) so selection happens per KV head, keeping GQA's memory savings; or,
    with gqa="query", each query head selects its own tokens as in the reference code: the cache then
    repeats the KVs for every query head (`make_caches` arranges it), which costs group-size x memory."""

    def __init__(self, window: int = 16, kernel: int = 7, pooling: str = "max", gqa: str = "mean") -> None:
        if pooling not in ("max", "avg") or gqa not in ("mean", "max", "sum", "query") or kernel < 1 or kernel % 2 == 0 or window < 1:
            raise ValueError(f"snapkv: need window >= 1, an odd kernel, pooling max|avg and gqa mean|max|sum|query; got {window}, {kernel}, {pooling}, {gqa}")
        self.window, self.kernel, self.pooling, self.gqa = window, kernel, pooling, gqa

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        B, n_kv, T, _ = k.shape
        last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
        window_pos = last - self.window + 1 + torch.arange(self.window, device=k.device)  # [B, window]; < 0 for short rows
        cols = window_pos.clamp(min=0)  # right padding: a real token's column is its position
        q_window = q.gather(2, cols[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        query_pos = torch.where(window_pos >= 0, window_pos, -1)
        probs = prompt_attention(q_window, k, input_pos, query_pos).sum(dim=3)  # [B, H_kv, group, T]
        if self.gqa == "query" and probs.shape[2] != 1:
            raise ValueError("snapkv gqa='query' needs a cache holding one KV head per query head (make_caches(..., n_heads=...))")
        scores = {"mean": probs.mean, "max": lambda dim: probs.max(dim=dim).values, "sum": probs.sum, "query": probs.sum}[self.gqa](dim=2)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        scores = pool(scores.reshape(B * n_kv, 1, T), self.kernel, stride=1, padding=self.kernel // 2).view(B, n_kv, T)
        in_window = (input_pos > last - self.window) & (input_pos >= 0)
        return scores.masked_fill(in_window[:, None, :], float("inf"))


def prompt_attention(q: Tensor, k: Tensor, key_pos: Tensor, query_pos: Tensor, chunk: int = 512) -> Tensor:
    """Causal attention probabilities of prompt queries q [B, H, t, D] over prompt keys k [B, H_kv, T, D],
    as [B, H_kv, group, t, T]; padding (position -1) neither attends nor is attended. Computed in query
    chunks so the float32 scores never hold more than `chunk` rows at once."""
    B, H, t, D = q.shape
    n_kv = k.shape[1]
    q = q.view(B, n_kv, H // n_kv, t, D)
    rows = []
    for start in range(0, t, chunk):
        qpos = query_pos[:, start : start + chunk]
        scores = (q[:, :, :, start : start + chunk] @ k[:, :, None].transpose(-1, -2)).float() / D**0.5
        visible = (key_pos[:, None, :] <= qpos[:, :, None]) & (key_pos[:, None, :] >= 0)  # [B, t, T]
        probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
        rows.append(probs.nan_to_num(0.0) * (qpos >= 0)[:, None, None, :, None])
    return torch.cat(rows, dim=3)


PROMPT_COMPRESSORS: dict[str, type[PromptCompressor]] = {
    "full": KeepAll,
    "recent_global": RecentCompressor,
    "random": RandomCompressor,
    "l2": L2Compressor,
    "heavy_hitter": HeavyHitterCompressor,
    "heavy_hitter_mean": MeanHeavyHitterCompressor,
    "tova": TOVACompressor,
    "snapkv": SnapKVCompressor,
}


def make_prompt_compressor(name: str, **options) -> PromptCompressor:
    if name not in PROMPT_COMPRESSORS:
        raise ValueError(f"unknown prompt compression strategy {name!r}; choose from: {', '.join(PROMPT_COMPRESSORS)}")
    if options and name != "snapkv":
        raise ValueError(f"prompt compression strategy {name!r} takes no options; got {sorted(options)}")
    return PROMPT_COMPRESSORS[name](**options)

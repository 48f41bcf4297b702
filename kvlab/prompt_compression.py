"""Prompt compressors: score every prompt token once, at prefill, so that a cache shorter than the
prompt keeps the most important ones (the cache itself protects sinks and the recent window).

A compressor maps the prompt's (input_pos [B, T], keys and values [B, H_kv, T, D], queries [B, H, T, D]) to
importances [B, H_kv, T] (higher = keep). Each applies a score from `scores.py`; an evicting strategy's
default compressor is its own score (`EvictionCache.own_prompt_compressor`), and caches that learn
from attention (heavy_hitter, tova) start their running scores from these importances. The registry,
which adds every scored strategy's own compressor under its name, is in `strategies.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvlab import parallel
from kvlab.options import Option, choice, fraction, integer
from kvlab.scores import (
    attention_mass,
    chunk_attention,
    chunk_mean,
    lagkv,
    layer_attention_mass,
    pool_keys,
    received_attention,
    recency,
    rkv,
    value_weighted,
    window_attention,
)

# Wrappers over any compressor's scores, applied by the cache at prefill (`wrap_scores`), in this order.
SCORE_WRAPPER_OPTIONS = (
    choice(
        "value_weight",
        ("none", "norm", "wo_l1"),
        None,
        "prompt scores: weight each by its value, (score + value_epsilon) x norm: norm by ||v|| (Expected "
        "Attention's value rescaling), wo_l1 by ||W_o v||_1, the value through the attention's output "
        "projection, averaged over the query group (CriticalKV, as kvpress's CriticalKVPress)",
        default_help="norm for expected_attention, none otherwise",
    ),
    Option(
        "value_epsilon",
        (int, float),
        "a number >= 0",
        "value_weight: added to the scores before weighting",
        0.0,
        lambda v: v >= 0,
    ),
    fraction(
        "value_first_stage",
        0.0,
        "value_weight: the share of each head's prompt budget kept by the unweighted score first, the rest by "
        "the weighted one (CriticalKV's two-stage selection; kvpress's 0.5); 0: one stage",
        closed=True,
    ),
    integer(
        "chunk_size",
        None,
        "prompt scores (ChunkKV): rank prompt tokens by the mean score of their chunk of N consecutive positions",
        default_help="off",
    ),
)


def wrap_scores(
    scores: Tensor, pos: Tensor, norms: Tensor | None, value_epsilon: float, chunk_size: int | None
) -> Tensor:
    """A compressor's scores [B, H_kv, T] through the wrappers of SCORE_WRAPPER_OPTIONS; pos [B, T] or [B, H_kv, T],
    norms [B, H_kv, T] the values' (`scores.value_norms`; None: unweighted). ChunkKV ranks a whole prompt's chunks by
    their mean over the layer's heads too (kvpress's ChunkKVPress), so every head keeps the same chunks; between prefill
    chunks, where each head holds its own tokens, each head ranks its own."""
    if norms is not None:
        scores = value_weighted(scores, norms, value_epsilon)
    if chunk_size is None:
        return scores
    chunked = chunk_mean(scores, pos, chunk_size)
    if pos.dim() == 3:
        return chunked
    # every rank's heads
    over_heads = parallel.sum_over_ranks(chunked.sum(dim=1, keepdim=True)) / parallel.all_heads(chunked.shape[1])
    return over_heads.expand_as(chunked)


class PromptCompressor:
    compresses = True
    needs_model = False  # its scores come from a further pass of the model, which the engine runs (reconstruction.py)
    uses_lse = False  # takes the prompt attention's log-sum-exp [B, H, T] as `lse=` when the prefill has it (CPU)
    options: tuple[Option, ...] = ()  # settings it takes (flag and YAML names), passed as their `keyword`
    # its scores never differ between heads (by position alone): nothing for Ada-KV to share out
    same_in_every_head = False

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def scores_chunks(self) -> bool:
        """Whether it scores between prefill chunks (`score_chunk`)."""
        return type(self).score_chunk is not PromptCompressor.score_chunk

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        """Scores [B, H_kv, S] of the held and chunk keys and values [B, H_kv, S, D] of a chunked prefill, each head's
        in position order (key_pos [B, H_kv, S], -1 empty, last), from the chunk's own queries q [B, H, N, D] at
        query_pos [B, N] (right-padded with -1): how each compressor scores a chunk is stated in docs/strategies.md."""
        raise NotImplementedError

    def with_rope(self, rope: tuple[Tensor, Tensor] | None) -> PromptCompressor:
        """The compressor a cache uses, given the model's RoPE cos/sin tables [positions, D] (caches
        built by `make_caches` pass them); only a compressor that reads positions from queries needs them."""
        return self


class KeepAll(PromptCompressor):
    """No compression: the prompt must fit the cache (the cache raises otherwise)."""

    compresses = False

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        return torch.zeros(k.shape[:3], device=k.device)

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        return torch.zeros(k.shape[:3], device=k.device)


class KeyScores(PromptCompressor):
    """A key score (recency, l2_norm, keydiff, ...) over the prompt's keys."""

    def __init__(self, score: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.score = score

    @property
    def same_in_every_head(self) -> bool:
        return self.score is recency

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        return self.score(k, input_pos[:, None, :].expand(k.shape[:3]))

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        return self.score(k, key_pos)


class AttentionScores(PromptCompressor):
    """The attention each prompt key receives from the last `window` prompt queries (None: all of them,
    H2O; 1: the last, TOVA), summed over the query group; with `shared_heads`, averaged over every query head of
    the layer instead, so each head keeps the same tokens (TOVA). With `per_query`, the sum is divided by the
    number of observed queries that could see each token: the mean attention it received, so early
    tokens are not favoured for being seen by more queries (heavy_hitter_mean)."""

    def __init__(self, window: int | None = None, per_query: bool = False, shared_heads: bool = False) -> None:
        if shared_heads and window is None:
            raise ValueError("AttentionScores: shared_heads averages a window of queries' attention; give a window")
        self.window, self.per_query, self.shared_heads = window, per_query, shared_heads

    def mass(self, probs: Tensor) -> Tensor:
        """Each key's attention from the observed queries, [B, H_kv, S]: per KV head, or the layer's mean in every
        head."""
        return layer_attention_mass(probs) if self.shared_heads else attention_mass(probs)

    @property
    def uses_lse(self) -> bool:
        return self.window is None

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> Tensor:
        scores = (
            received_attention(q, k, input_pos, lse=lse)
            if self.window is None
            else self.mass(window_attention(input_pos, k, q, self.window))
        )
        if not self.per_query:
            return scores
        seen_by = (input_pos.max(dim=-1, keepdim=True).values - input_pos + 1).clamp(min=1)  # [B, T]
        return scores / seen_by[:, None, :]

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        scores = self.mass(chunk_attention(key_pos, k, query_pos, q, self.window))
        if not self.per_query:
            return scores
        seen_by = (
            query_pos[:, None, None, :] >= torch.where(key_pos >= 0, key_pos, query_pos.max() + 1)[..., None]
        ).sum(dim=-1)
        return scores / seen_by.clamp(min=1)


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
        choice(
            "snapkv_pooling", ("max", "avg"), "max", "snapkv: max or avg pooling", valid="max or avg", param="pooling"
        ),
        choice(
            "snapkv_gqa",
            ("mean", "max", "sum", "query"),
            "mean",
            "snapkv: aggregation over the query heads of a KV head (mean, max, sum), or query: select per query "
            "head as the reference code does, repeating KVs per query head (group-size x memory)",
            valid="mean, max, sum or query",
            param="gqa",
        ),
        choice(
            "snapkv_window_reduce",
            ("sum", "mean"),
            "sum",
            "snapkv: a key's attention from the window's queries summed (the paper's code; H2O's scale when it "
            "seeds H2O's running scores) or averaged (kvpress's SnapKVPress, the scale that CriticalKV's "
            "value_epsilon is set for)",
            valid="sum or mean",
            param="window_reduce",
        ),
    )

    def __init__(
        self, window: int = 16, kernel: int = 7, pooling: str = "max", gqa: str = "mean", window_reduce: str = "sum"
    ) -> None:
        for option, value in zip(self.options, (window, kernel, pooling, gqa, window_reduce), strict=True):
            option.validate(value)
        self.window, self.kernel, self.pooling, self.gqa, self.window_reduce = (
            window,
            kernel,
            pooling,
            gqa,
            window_reduce,
        )

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        probs = self.over_window(window_attention(input_pos, k, q, self.window))
        return self.select(probs, input_pos[:, None, :], input_pos.max(dim=-1, keepdim=True).values)

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        probs = self.over_window(chunk_attention(key_pos, k, query_pos, q, self.window))
        return self.select(probs, key_pos, query_pos.max(dim=-1, keepdim=True).values)

    def over_window(self, probs: Tensor) -> Tensor:
        """The window's attention [B, H_kv, group, w, T] reduced over its w queries (rows of missing queries are zero
        and count in the mean's w alike for every key, so a row's ranking is the sum's)."""
        return probs.sum(dim=3) if self.window_reduce == "sum" else probs.mean(dim=3)

    def select(self, probs: Tensor, key_pos: Tensor, last: Tensor) -> Tensor:
        """Scores from the window's attention [B, H_kv, group, T] to keys at key_pos [B, 1 or H_kv, T], the newest
        position last [B, 1]."""
        if self.gqa == "query" and probs.shape[2] != 1:
            raise ValueError(
                "snapkv gqa='query' needs a cache holding one KV head per query head (snapkv_gqa query sets kv_repeat)"
            )
        scores = {
            "mean": probs.mean,
            "max": lambda dim: probs.max(dim=dim).values,
            "sum": probs.sum,
            "query": probs.sum,
        }[self.gqa](dim=2)
        in_window = (key_pos > last[:, :, None] - self.window) & (key_pos >= 0)
        # Pooled over the keys before the window alone, as the reference code and kvpress pool: the window's own
        # attention does not lift the keys just before it (zeros are what their pooling pads the edge with).
        scores = pool_keys(scores.masked_fill(in_window, 0.0), self.kernel, self.pooling)
        return scores.masked_fill(in_window, float("inf"))


class LagKV(PromptCompressor):
    """LagKV (Liang et al., 2025, arXiv 2504.04704): each partition of `lag` prompt tokens (after 4 sinks, as
    kvpress) is scored by its keys' and values' spread once normalised by the next partition's range
    (`lagkv`); every scored partition keeps the same share, the last one is kept. Keys and values alone:
    no attention, no queries."""

    sinks = 4
    options = (
        integer(
            "lagkv_size",
            128,
            "lagkv: tokens per partition, each scored against the next one's per-channel range",
            param="lag",
        ),
    )

    def __init__(self, lag: int = 128) -> None:
        self.lag = self.options[0].validate(lag)

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        return lagkv(k, v, input_pos[:, None, :].expand(k.shape[:3]), self.lag, self.sinks)

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        return lagkv(k, v, key_pos, self.lag, self.sinks)


class RKV(PromptCompressor):
    """R-KV (Cai et al., 2025, arXiv 2505.24133), made for long generations and applied to the prompt too: a
    token's importance is the attention the last `window` queries paid it, averaged over them and over its KV
    head's query group, max-pooled along the keys (kernel 7, as SnapKV); its score subtracts the redundancy of
    its key among the head's keys (`rkv`): mix x importance - (1 - mix) x redundancy, mix = `rkv_lambda`."""

    kernel = 7
    options = (
        integer(
            "rkv_window",
            8,
            "rkv: the last N queries (prompt, then decoded) whose attention is a token's importance",
            param="window",
        ),
        fraction(
            "rkv_lambda",
            0.1,
            "rkv: score = lambda x importance - (1 - lambda) x redundancy (key cosine similarity)",
            closed=True,
            param="mix",
        ),
    )

    def __init__(self, window: int = 8, mix: float = 0.1) -> None:
        for option, value in zip(self.options, (window, mix), strict=True):
            option.validate(value)
        self.window, self.mix = window, mix

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        probs = window_attention(input_pos, k, q, self.window)  # [B, H_kv, group, w, T]
        return self.from_attention(probs, k, input_pos[:, None, :].expand(k.shape[:3]))

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        return self.from_attention(chunk_attention(key_pos, k, query_pos, q, self.window), k, key_pos)

    def from_attention(self, probs: Tensor, k: Tensor, key_pos: Tensor) -> Tensor:
        """Scores from the last queries' attention [B, H_kv, group, w, T] to keys k at key_pos [B, H_kv, T]."""
        importance = pool_keys(attention_mass(probs) / (probs.shape[2] * self.window), self.kernel)
        return rkv(importance, k, key_pos, self.mix)

"""Expected Attention as a prompt compressor: each key scored by the attention that future queries, modelled as a
Gaussian fitted to the prompt's last queries and rotated ahead to the positions to come, would pay it."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from kvlab.options import integer
from kvlab.prompt_compression import PromptCompressor
from kvlab.scores import expected_logits, query_statistics, unrotate


class ExpectedAttention(PromptCompressor):
    """Expected Attention (Devoto, Jeblick and Jégou, 2025, arXiv 2510.00636): the future queries are a
    Gaussian, the mean and covariance per query head of the last `window` prompt queries before RoPE (un-rotated
    with the model's tables), rotated by the RoPE of the next `future` positions averaged over them; a key's
    expected attention is E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d) + k^T Sigma k / (2d)) (`expected_logits`,
    the keys turned into the averaged frame instead of the Gaussian), normalised over the prompt's keys like
    attention and averaged over the query group of its KV head. As the reference (kvpress) does, the first 4
    tokens (attention sinks, outlier queries) stay out of the statistics and the normalisation and score 1 above
    the rest. kvpress's value rescaling, (score + epsilon) x ||v||, is `value_weight` (norm by default for the
    expected_attention strategy). Without RoPE tables (`with_rope(None)`) queries and keys are used as given."""

    sinks = 4
    options = (
        integer(
            "ea_window",
            None,
            "expected_attention: fit the future queries' Gaussian to the last N prompt queries",
            default_help="all but the first 4",
            param="window",
        ),
        integer(
            "ea_future",
            512,
            "expected_attention: the next N positions whose RoPE rotation, averaged, turns the Gaussian into "
            "the future queries'",
            param="future",
        ),
    )

    def __init__(self, window: int | None = None, future: int = 512) -> None:
        for option, value in zip(self.options, (window, future), strict=True):
            if value is not None:
                option.validate(value)
        self.window, self.future = window, future
        self.rope: tuple[Tensor, Tensor] | None = None

    def with_rope(self, rope: tuple[Tensor, Tensor] | None) -> ExpectedAttention:
        bound = copy.copy(self)
        bound.rope = rope
        return bound

    def fit(self, input_pos: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The future queries' Gaussian, mean [B, H, D] and covariance [B, H, D, D], and the cos/sin [B, 1, 1, D]
        of its averaged rotation (`unrotate` turns keys into its frame)."""
        last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
        observed = input_pos >= self.sinks
        if self.window is not None:
            observed &= input_pos > last - self.window
        x, cos, sin = (
            q.float(),
            torch.ones_like(q[:, :1, :1], dtype=torch.float),
            torch.zeros_like(q[:, :1, :1], dtype=torch.float),
        )
        if self.rope is not None:
            table_cos, table_sin = self.rope
            at = input_pos.clamp(min=0)[:, None]
            x = unrotate(x, table_cos[at], table_sin[at])
            future_cos, future_sin = table_cos[: self.future].mean(dim=0), table_sin[: self.future].mean(dim=0)
            now = (last + 1).clamp(max=len(table_cos) - 1)[:, None]  # [B, 1, 1]: the first future position
            cos = table_cos[now] * future_cos - table_sin[now] * future_sin  # mean over j of cos((now + j) w)
            sin = table_sin[now] * future_cos + table_cos[now] * future_sin
        return *query_statistics(x, observed), cos, sin

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        return self.score_keys(input_pos[:, None, :].expand(k.shape[:3]), k, *self.fit(input_pos, q))

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        return self.score_keys(key_pos, k, *self.fit(query_pos, q))

    def score_keys(self, key_pos: Tensor, k: Tensor, mean: Tensor, cov: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Keys [B, H_kv, T, D] at key_pos [B, H_kv, T] scored by the fitted Gaussian (`fit`)."""
        logits = expected_logits(unrotate(k.float(), cos, sin), mean, cov)  # [B, H_kv, group, T]
        counted = (key_pos >= self.sinks)[:, :, None, :]
        scores = logits.masked_fill(~counted, float("-inf")).softmax(dim=-1).nan_to_num(0.0).mean(dim=2)
        sinks = (key_pos >= 0) & ~counted[:, :, 0]
        return torch.where(sinks, scores.amax(dim=-1, keepdim=True) + 1, scores)

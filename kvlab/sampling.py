"""The next token from a step's logits: greedy, or top-k sampling at a temperature by the exponential race (argmax of
p / Exp(1)), which needs no host sync; every tensor-parallel rank picks the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab import parallel


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # sample among the k most likely tokens only


GREEDY = Sampling()


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None) -> Tensor:
    """Next token per row from logits [B, V]: greedy when temperature is 0, else top-k sampling.
    Sampling uses the exponential-race trick (argmax of p / Exp(1)), which needs no host sync."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits.float(), dim=-1)
    return parallel.same_tokens((probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1))

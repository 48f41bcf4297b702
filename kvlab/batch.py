"""A batch of prompts as the engine runs it: checked against the model's context, right-padded, with where each row's
prefill ends and how many of its last tokens are decoded through the cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.config import CacheSpec
from kvlab.model import Transformer


@dataclass
class Batch:
    """Right-padded prompts [B, T] and where each row's prefill ends: its last `suffix[i]` tokens are decoded
    through the compressed cache, from column prefill_lens[i]."""

    tokens: Tensor
    input_pos: Tensor  # [B, T_prefill] positions of the prefilled columns, -1 padding
    lens: Tensor  # [B] prompt lengths
    prefill_lens: Tensor  # [B] tokens prefilled per row
    suffix: list[int]
    max_seq_length: int  # what the caches are sized for

    @property
    def forced(self) -> int:
        """Decode steps that feed prompt tokens (a row with a shorter suffix finishes early; its extra steps are
        dropped)."""
        return max(self.suffix)


def pad_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    spec: CacheSpec,
    decoded_prompt_tokens: Sequence[int] | None,
    streaming: bool,
    max_seq_length: int | None,
) -> Batch:
    """The prompts checked against the model's context and padded into a Batch."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    suffix = [max(n, int(spec.compress_first_token)) for n in decoded_prompt_tokens or [0] * len(prompts)]
    if not prompts or len(suffix) != len(prompts) or any(len(p) < 1 + s for p, s in zip(prompts, suffix, strict=True)):
        raise ValueError(f"every prompt must have at least 1 token more than it decodes through the cache ({suffix})")
    if streaming and len(set(suffix)) > 1:
        raise ValueError("streaming (on_token) needs the same number of decoded prompt tokens in every row")
    device = model.tok_embeddings.weight.device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    prefill_lens = lens - torch.tensor(suffix, device=device)
    T, T_prefill = int(lens.max()), int(prefill_lens.max())
    needed = T_prefill + max(suffix) + max_new_tokens  # every row runs max(suffix) + max_new_tokens - 1 steps
    context = model.config.block_size
    if needed > context:
        raise ValueError(
            f"prompt of {T} tokens + max_new_tokens={max_new_tokens} exceeds the model's context length of "
            f"{context} tokens"
        )
    max_seq_length = max_seq_length or needed
    if not needed <= max_seq_length <= context:
        raise ValueError(
            f"max_seq_length={max_seq_length} must lie between prompt + max_new_tokens ({needed}) and the "
            f"context length ({context})"
        )
    tokens = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, device=device)
    columns = torch.arange(T_prefill, device=device)
    return Batch(
        tokens, torch.where(columns < prefill_lens[:, None], columns, -1), lens, prefill_lens, suffix, max_seq_length
    )

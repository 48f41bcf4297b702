"""Perplexity through a compressed cache: a document's first tokens prefilled as a prompt, every later token predicted
by teacher forcing from the cache of all before it, so eviction decisions change the loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.build import build_caches
from kvlab.config import CacheSpec, model_scored
from kvlab.engine import maintain, replayed, token_column
from kvlab.model import Transformer
from kvlab.recording import RecordedPrefill
from kvlab.slot_counts import plan_layer_budgets


def rows_held(model: Transformer) -> Tensor:
    """[B] tokens each sequence holds, averaged over layers and KV heads."""
    return torch.stack([layer.attention.kv_cache.tokens_held().float() for layer in model.layers]).mean(dim=0)


def score_one_token(model: Transformer, token: Tensor, input_pos: Tensor, target: Tensor) -> Tensor:
    """Teacher forcing through the cache: the loss of `target` [B] after `token` [B, 1]. The compiled unit for
    perplexity."""
    logits = model(token, input_pos)
    return F.cross_entropy(logits[:, -1].float(), target, reduction="none")


@torch.no_grad()
def document_nll(
    model: Transformer, documents: list[list[int]], spec: CacheSpec, step: Callable, prompt_tokens: int = 1
) -> tuple[Tensor, Tensor]:
    """Per-token losses [B, L-1] of equally long documents and tokens held per sequence. The first
    `prompt_tokens` are prefilled as a prompt (exact attention; compressed and, with a layer budget
    planner, planned when stored), every later token is predicted from the compressed cache of all
    before it. With one prompt token every prediction goes through the cache."""
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor(documents, device=device)
    B, L = tokens.shape
    P = prompt_tokens
    if not 1 <= P < L:
        raise ValueError(f"--ppl_prompt_tokens must lie in [1, {L - 1}] for {L}-token documents, got {P}")
    positions = torch.arange(P, device=device).expand(B, P)
    recorded = RecordedPrefill()
    recorded.record(model, tokens[:, :P], positions, positions)
    budgets = None if spec.layer_budget == "uniform" else plan_layer_budgets(spec, [P] * B, L - P, recorded.similarity)
    caches = build_caches(model, spec, [P] * B, L - P, L, budgets)
    if model_scored(spec.strategies, spec.options):  # the oracle's future is the rest of the document
        recorded.score_with_model(model, caches, [P] * B, [d[P:] for d in documents], spec.repeat)
    recorded.replay(model, caches, compact=True)
    losses = [
        F.cross_entropy(recorded.logits.flatten(0, 1).float(), tokens[:, 1 : P + 1].flatten(), reduction="none").view(
            B, P
        )
    ]
    with replayed(step, caches) as call:
        for p in range(P, L - 1):
            losses.append(
                call(
                    model,
                    token_column(tokens, p),
                    torch.full((B, 1), p, device=device),
                    token_column(tokens, p + 1)[:, 0],
                )[:, None]
            )
            maintain(caches)
    return torch.cat(losses, dim=1), rows_held(model)

"""Attention as the model runs it: exact causal prefill, a decode step over the cache's slots, a prefill chunk over
held and own keys; GQA without repeating K/V, masks derived from token positions (-1: an empty slot)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.scores import merged_attention


def causal_attention_lse(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Exact causal attention [B, H, T, D] and each query's log-sum-exp of its scaled logits [B, H, T] (float32), on
    the CPU: kvlab's native prefill attention where it runs, else torch's flash kernel (the kernel, and so the output,
    of `scaled_dot_product_attention` there), as `exact_attention` takes them. H2O's prompt scores reuse the
    log-sum-exp (`scores.received_from_lse`)."""
    if kernels.takes_prefill_attention(q, k, v):  # query i sees keys 0..i, as torch's is_causal
        key_pos, query_pos = (torch.arange(n, device=q.device).expand(q.shape[0], -1) for n in (k.shape[2], q.shape[2]))
        return prefill_attention(q, k, v, key_pos, query_pos)
    group = q.shape[1] // k.shape[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True
    )


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, Tensor]:
    """kvlab's native prefill attention (`kernels.takes_prefill_attention`): y [B, H, T, D] in q's dtype and the
    log-sum-exps [B, H, T] (float32) of q at query_pos [B, T] over keys at key_pos ([B, S] or [B, H_kv, S]), by
    `attention_mask`'s rule; a padding query (-1) sees every filled slot."""
    y, lse = torch.ops.kvlab.attend_prefill(q.float(), k, v, key_pos, query_pos)
    return y.to(q.dtype), lse


def attention_mask(key_pos: Tensor, query_pos: Tensor) -> Tensor:
    """Causality from positions: a query sees filled slots (pos >= 0) no later than itself.
    key_pos: [B, S] (shared by heads) or [B, H_kv, S]; query_pos: [B, T] -> [B, 1 or H_kv, T, S]."""
    if key_pos.dim() == 2:
        key_pos = key_pos.unsqueeze(1)
    key_pos = key_pos.unsqueeze(2)
    return (key_pos >= 0) & (key_pos <= query_pos[:, None, :, None])


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor, return_probs: bool
) -> tuple[Tensor, Tensor | None]:
    """A decode step's attention over the cache's slots (`grouped_attention` under `attention_mask`): kvlab's
    native kernel, with the mask and softmax fused, where it runs and no probabilities are wanted. Keys and
    values in another dtype than q (a 16-bit cache's) are read as they are by the kernel, else widened to q's. The
    kernel's queries and output are float32: a bfloat16 model's are widened and rounded back."""
    if not return_probs and kernels.takes_attention(q, k, v):
        return torch.ops.kvlab.attend_fp32(q.float(), k, v, key_pos, query_pos).to(q.dtype), None
    return grouped_attention(q, k.to(q.dtype), v.to(q.dtype), attention_mask(key_pos, query_pos), return_probs)


def chunk_attention(
    q: Tensor, query_pos: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, own_from: int | None = None
) -> Tensor:
    """A prefill chunk's queries q [B, H, N, D] at query_pos [B, N] over keys at key_pos ([B, S] or [B, H_kv, S]),
    causal by position; a padding query (-1) attends to every real key, a finite output that nothing keeps.
    `own_from`: the keys before it are earlier tokens that every real query sees, and from it on each row's chunk
    holds its own keys in query order (its padding's slots after them): both parts then run the CPU flash kernel
    without a mask (`split_chunk_attention`), as a one-shot prefill does. kvlab's native prefill attention takes
    every case where it runs; elsewhere keys and values in another dtype (a float16 recording's) are widened to q's."""
    if kernels.takes_prefill_attention(q, k, v):
        return prefill_attention(q, k, v, key_pos, query_pos)[0]
    if own_from is not None and own_from > 0 and k.device.type == "cpu":
        return split_chunk_attention(q, k.to(q.dtype), v.to(q.dtype), own_from)
    seeing = torch.where(query_pos >= 0, query_pos, torch.iinfo(query_pos.dtype).max)
    return grouped_attention(q, k.to(q.dtype), v.to(q.dtype), attention_mask(key_pos, seeing), False)[0]


def split_chunk_attention(q: Tensor, k: Tensor, v: Tensor, own_from: int) -> Tensor:
    """Attention of q [B, H, N, D] over keys [:own_from] (all seen; GQA folded into the query axis) and keys
    [own_from:] (causal from the first: query i sees own keys <= i, a padding query every one), the two softmaxes
    merged by their log-sum-exps into the one softmax over every key."""
    B, H, N, D = q.shape
    group = H // k.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    y_held, lse_held = flash(q.reshape(B, H // group, group * N, D), k[:, :, :own_from], v[:, :, :own_from])[:2]
    y_own, lse_own = causal_attention_lse(q, k[:, :, own_from:], v[:, :, own_from:])
    y, _ = merged_attention(y_held.reshape(B, H, N, D), lse_held.reshape(B, H, N), y_own, lse_own)
    return y.to(q.dtype)


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, return_probs: bool
) -> tuple[Tensor, Tensor | None]:
    """GQA attention without repeating K/V: the query heads sharing a KV head are folded into the
    query-length axis. q: [B, H, T, D]; k, v: [B, H_kv, S, D]; mask: [B, 1 or H_kv, T, S].
    Returns y [B, H, T, D] and, if asked, probabilities [B, H_kv, group, T, S] in float32."""
    B, H, T, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    group = H // n_kv
    q = q.reshape(B, n_kv, group * T, D)
    mask = mask.unsqueeze(2).expand(B, mask.shape[1], group, T, S).reshape(B, mask.shape[1], group * T, S)
    if not return_probs:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.reshape(B, H, T, D), None
    scores = (q @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = probs.to(v.dtype) @ v
    return y.view(B, H, T, D), probs.view(B, n_kv, group, T, S)

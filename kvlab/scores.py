"""Every importance score, written once. A score is higher for a token worth keeping; the caches apply
the same function to the prompt (prefill) and to the running cache (decode), see `cache.py`.

    key scores        f(keys [B, H, S, D], positions [B, H, S]) -> [B, H, S], from the keys alone
    attention scores  attention probabilities [B, H_kv, group, t, S] of observed queries, summed
                      over the query group and the queries (`attention_mass`); which queries are
                      observed is the strategy's choice (all, the last one, a window of the last w)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def recency(k: Tensor, pos: Tensor) -> Tensor:
    """Newer tokens first: a sliding window (with sinks: StreamingLLM)."""
    return pos.float()


def random_score(k: Tensor, pos: Tensor) -> Tensor:
    """No information: the baseline every score must beat."""
    return torch.rand(pos.shape, device=pos.device)


def l2_norm(k: Tensor, pos: Tensor) -> Tensor:
    """Low-norm keys draw high attention (Devoto et al., 2024)."""
    return -k.float().norm(dim=-1)


def keydiff(k: Tensor, pos: Tensor) -> Tensor:
    """Keys least like the head's mean key are the most distinctive (KeyDiff, Park et al., 2025)."""
    held = (pos >= 0)[..., None].float()
    mean = (k.float() * held).sum(dim=2, keepdim=True) / held.sum(dim=2, keepdim=True).clamp(min=1)
    return -F.cosine_similarity(k.float(), mean, dim=-1)


def attention_mass(probs: Tensor) -> Tensor:
    """[B, H_kv, group, t, S] -> [B, H_kv, S]: the attention each key received, summed over the query
    heads of its group and the observed queries (H2O accumulates it, TOVA keeps the last query's)."""
    return probs.sum(dim=(2, 3))


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


def window_attention(input_pos: Tensor, k: Tensor, q: Tensor, window: int | None) -> Tensor:
    """The prompt attention of each sequence's last `window` queries (every query for None), [B, H_kv,
    group, w, T]: the observation window of SnapKV, TOVA (w = 1), FastGen's profile and KV-Compress.
    A sequence shorter than the window observes fewer queries (the missing rows are zero)."""
    if window is None:
        return prompt_attention(q, k, input_pos, input_pos)
    w = min(window, k.shape[2])
    last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
    query_pos = last - w + 1 + torch.arange(w, device=k.device)
    query_pos = torch.where(query_pos >= 0, query_pos, -1)  # right padding: a real token's column is its position
    q_obs = q.gather(2, query_pos.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
    return prompt_attention(q_obs, k, input_pos, query_pos)


def pool_keys(scores: Tensor, kernel: int, kind: str = "max") -> Tensor:
    """Pool [B, H, T] scores along the keys (stride 1, same length), so neighbours of an important token
    score high too (SnapKV, KV-Compress)."""
    B, H, T = scores.shape
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    return pool(scores.reshape(B * H, 1, T), kernel, stride=1, padding=kernel // 2).view(B, H, T)

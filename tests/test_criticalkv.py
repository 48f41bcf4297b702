"""CriticalKV (Feng et al., 2025, arXiv 2502.03805) as kvpress's CriticalKVPress and CriticalAdaKVPress: the
value norm through the output projection, and the two-stage selection, checked against the presses' steps
written out here on random prompts."""

from __future__ import annotations

import pytest
import torch

from kvlab.build import make_caches
from kvlab.strategies import PROMPT_COMPRESSORS

B, H_KV, GROUP, T, D, DIM = 2, 3, 2, 40, 8, 16
EPSILON = 1e-4


def output_l1_norms(v: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """kvpress's vwl1norm: ||W_o^h v||_1 per query head h, averaged over each KV head's group."""
    per_head = wo.T.reshape(H_KV * GROUP, D, DIM)
    v_q = v.repeat_interleave(GROUP, dim=1)
    norms = torch.stack(
        [torch.linalg.vector_norm(v_q[:, h] @ per_head[h], ord=1, dim=-1) for h in range(H_KV * GROUP)], dim=1
    )
    return norms.view(B, H_KV, GROUP, T).mean(dim=2)


def forced(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each head's top counts[b, h] scores set to +inf (kvpress scatters finfo.max; either wins every comparison)."""
    out = scores.clone()
    for b in range(B):
        for h in range(H_KV):
            out[b, h, scores[b, h].topk(int(counts[b, h])).indices] = float("inf")
    return out


def critical_kept(scores: torch.Tensor, norms: torch.Tensor, n_kept: int, ada: bool) -> list[list[set[int]]]:
    """The positions CriticalKVPress (ada=False) or CriticalAdaKVPress (ada=True) keeps, from its steps."""
    budgets = torch.full((B, H_KV), n_kept)
    if ada:  # AdaKVPress's split: each head's safeguard first, then the layer's top scores
        scores = forced(scores, torch.full((B, H_KV), max(1, int(n_kept * 0.2))))
        top = scores.flatten(1).topk(n_kept * H_KV, dim=1).indices // T
        budgets = torch.stack([torch.bincount(row, minlength=H_KV) for row in top])
    staged = forced(scores, (budgets * 0.5).long())
    weighted = torch.where(staged.isinf(), staged, (staged + EPSILON) * norms)
    return [[set(weighted[b, h].topk(int(budgets[b, h])).indices.tolist()) for h in range(H_KV)] for b in range(B)]


@pytest.mark.parametrize("ada", [False, True])
def test_critical_selection_keeps_what_the_kvpress_presses_keep(ada):
    torch.manual_seed(3)
    q, k = torch.randn(B, H_KV * GROUP, T, D), torch.randn(B, H_KV, T, D)
    v = torch.randn(B, H_KV, T, D) * torch.rand(B, H_KV, T, 1) * 3
    wo = torch.randn(DIM, H_KV * GROUP * D)
    n_kept = 12
    options = dict(
        prompt_compression_strategy="heavy_hitter",
        global_tokens=0,
        recent_window=1,
        value_weight="wo_l1",
        value_epsilon=EPSILON,
    )
    options |= dict(value_first_stage=0.5) | (dict(head_budget="adakv_safeguard") if ada else {})
    width = n_kept * H_KV if ada else n_kept
    cache = make_caches("heavy_hitter", 1, B, H_KV, width, D, torch.float32, **options)[0]
    cache.output_weight = wo
    cache.limit_rows(torch.full((B,), n_kept))
    pos = torch.arange(T).expand(B, T)
    cache.prefill(pos, k, v, q)
    scores = PROMPT_COMPRESSORS["heavy_hitter"](pos, k, v, q)
    scores[..., -1] = float("inf")  # the newest token, protected (SnapKVPress gives its window the top score)
    expected = critical_kept(scores, output_l1_norms(v, wo), n_kept, ada)
    held = [[set(cache.pos[b, h].tolist()) - {-1} for h in range(H_KV)] for b in range(B)]
    assert held == expected
    one_stage = [
        [set(((scores + EPSILON) * output_l1_norms(v, wo))[b, h].topk(n_kept).indices.tolist()) for h in range(H_KV)]
        for b in range(B)
    ]
    assert ada or held != one_stage  # the first stage changes what is kept here
    if ada:
        assert len({len(head) for row in held for head in row}) > 1  # the heads' shares differ


def test_wo_l1_needs_the_output_projection_and_two_stages_need_a_weight():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8)
    cache = make_caches(
        "heavy_hitter",
        1,
        1,
        1,
        10,
        8,
        torch.float32,
        prompt_compression_strategy="heavy_hitter",
        value_weight="wo_l1",
        recent_window=1,
    )[0]
    with pytest.raises(ValueError, match="--value_weight wo_l1 needs the attention's output projection"):
        cache.prefill(torch.arange(30)[None], k, v, q)
    with pytest.raises(
        ValueError, match="--value_first_stage 0.5 selects in two stages by the value weight; give a --value_weight"
    ):
        make_caches("heavy_hitter", 1, 1, 1, 10, 8, torch.float32, value_first_stage=0.5, recent_window=1)

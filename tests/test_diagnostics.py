"""Attention loss: the full-attention mass on tokens a compressed cache evicted."""

from __future__ import annotations

import math

import torch

from conftest import spec_for
from kvlab.cache import FullCache
from kvlab.diagnostics import AttentionLossProbe
from kvlab.engine import generate
from kvlab.strategies import WindowCache


def test_attention_loss_is_the_full_attention_mass_on_evicted_tokens():
    torch.manual_seed(0)
    D = 4
    keys = torch.randn(1, 1, 7, D)
    probe = AttentionLossProbe(
        WindowCache(1, 1, 4, D, torch.float32, recent_window=1), FullCache(1, 1, 8, D, torch.float32)
    )
    probe.prefill(torch.arange(6)[None], keys[:, :, :6], keys[:, :, :6], None)  # the window keeps positions 2-5
    q = torch.randn(1, 2, 1, D)  # two query heads share the KV head
    _, _, kept_pos = probe.update(torch.tensor([[6]]), keys[:, :, 6:], keys[:, :, 6:], q)  # evicts position 2
    assert sorted(kept_pos[0, 0].tolist()) == [3, 4, 5, 6]
    probs = (q[0, :, 0] @ keys[0, 0].T / math.sqrt(D)).softmax(dim=-1)  # [2 heads, 7 positions]
    expected = probs[:, :3].sum(dim=-1).mean()
    torch.testing.assert_close(probe.losses[0], expected.view(1))


def test_no_eviction_means_no_attention_loss(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode("The history of the printing press begins in the fifteenth century")
    for strategy, cache_length in (("full", None), ("window", 64)):
        loss = generate(model, [prompt], 8, spec_for(model, strategy, cache_length), attention_loss=True).attention_loss
        assert len(loss["per_layer"]) == model.config.n_layer and len(loss["per_step"]) == 7
        assert max(loss["per_layer"]) < 1e-5
    evicting = generate(
        model, [prompt], 8, spec_for(model, "window", 8, recent_window=2), attention_loss=True
    ).attention_loss
    assert 0.05 < sum(evicting["per_step"]) / 7 < 1

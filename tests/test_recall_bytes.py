"""The recallable caches' device bytes: with slow_tier="host" only the fast tier stays on the device."""

from __future__ import annotations

import pytest
import torch

from kvlab.build import make_caches


@pytest.mark.parametrize("strategy", ["clusterkv", "quest"])
def test_the_host_tier_keeps_only_the_fast_tier_on_the_device(strategy):
    B, H, budget, history, D = 2, 2, 24, 96, 8
    host = make_caches(strategy, 1, B, H, budget, D, torch.float32, n_heads=4, history=history, slow_tier="host")[0]
    device = make_caches(strategy, 1, B, H, budget, D, torch.float32, n_heads=4, history=history)[0]
    full = make_caches("full", 1, B, H, history, D, torch.float32)[0]
    fast = 2 * B * H * budget * D * 4 + B * H * budget * 8  # fast_k, fast_v (float32) and fast_slots (int64)
    assert host.device_nbytes() == fast == host.fast_k.nbytes + host.fast_v.nbytes + host.fast_slots.nbytes
    assert device.device_nbytes() == device.nbytes() == full.nbytes() == 2 * B * H * history * D * 4
    # + 8 bytes of slot id per 2 x D x 4 of KVs
    assert host.device_nbytes() / full.nbytes() == pytest.approx(budget / history * (1 + 8 / (2 * D * 4)))

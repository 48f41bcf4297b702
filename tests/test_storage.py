"""Quantized KV storage: exact packing, error bounded by half a step, real packed bytes, and logits close
to full precision on the default model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import paul_graham_text
from kvlab.build import make_caches
from kvlab.storage import QuantizedKVStorage


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_survive_packing_and_error_is_at_most_half_a_step(bits):
    torch.manual_seed(0)
    storage = QuantizedKVStorage((2, 3, 5, 8), torch.float32, bits=bits, key_axis="token")
    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    storage.write(torch.arange(5).expand(2, 3, 5), k, v, prompt=True)
    keys, values = storage.read()
    for x, out, scale in ((k, keys, storage.k_scale), (v, values, storage.v_scale)):
        assert ((out - x).abs() <= scale.float() / 2 + 1e-3 * x.abs().amax()).all()
        codes = (out - x.amin(dim=-1, keepdim=True)) / scale.float()
        assert (codes.round() >= 0).all() and (codes.round() <= 2**bits - 1).all()
    constant = torch.full((2, 3, 1, 8), 0.25)
    storage.write(torch.zeros(2, 3, 1, dtype=torch.long), constant, constant)
    assert torch.equal(storage.read()[1][:, :, :1], constant)  # a constant vector decodes exactly


def test_writes_go_to_their_slots_only():
    storage = QuantizedKVStorage((1, 1, 4, 4), torch.float32, bits=4, key_axis="token")
    rows = torch.tensor([[0.0, 1, 2, 3], [3, 2, 1, 0], [0, 0, 0, 15], [5, 5, 5, 20]]).view(1, 1, 4, 4)
    storage.write(torch.arange(4).view(1, 1, 4), rows, rows)
    before = storage.read()[0].clone()
    storage.write(torch.tensor([[[2]]]), rows[:, :, 3:], rows[:, :, 3:])
    after = storage.read()[0]
    assert torch.equal(after[:, :, [0, 1, 3]], before[:, :, [0, 1, 3]]) and torch.equal(after[:, :, 2], before[:, :, 3])
    assert torch.allclose(before, rows, atol=1e-3)  # each row lies on its own 4-bit grid (up to float16 scales)


@pytest.mark.parametrize("bits,key_axis", [(8, "token"), (4, "channel"), (2, "channel")])
def test_memory_is_the_packed_size(bits, key_axis):
    B, H, C, D = 2, 3, 64, 64
    cache = make_caches("heavy_hitter", 1, B, H, C, D, torch.float32, cache_bits=bits, key_quant_axis=key_axis)[0]
    codes = 2 * B * H * C * D * bits // 8
    value_scales = 2 * B * H * C * 2  # float16 scale and zero point per token
    key_scales = B * H * C * 2 * 2 if key_axis == "token" else B * H * D * 2 * 2
    assert cache.nbytes() == codes + value_scales + key_scales
    assert make_caches("heavy_hitter", 1, B, H, C, D, torch.float32)[0].nbytes() == 2 * B * H * C * D * 4


def teacher_forced_logits(model, ids, n_prompt, **options):
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, len(ids), a.head_dim, torch.float32, **options))
    model.cache_key = None
    with torch.no_grad():
        model(torch.tensor([ids[:n_prompt]]), torch.arange(n_prompt)[None], prefill=True)
        return torch.cat([model(torch.tensor([[ids[p]]]), torch.tensor([[p]]))[0] for p in range(n_prompt, len(ids))])


def test_quantized_caches_stay_close_to_full_precision(smollm):
    """8-bit: logits within 0.5 and the same greedy tokens; 4 bits: loss within 0.2 of full either way;
    2 bits: per-channel keys (KIVI) beat per-token keys (bench/bench_quantization.py measures 4 bits too)."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(paul_graham_text()[:4000])[:360]
    n_prompt = 300
    targets = torch.tensor(ids[n_prompt + 1 :])
    reference = teacher_forced_logits(model, ids, n_prompt)
    eight = teacher_forced_logits(model, ids, n_prompt, cache_bits=8)
    assert (eight - reference).abs().max() < 0.5
    assert torch.equal(eight.argmax(-1), reference.argmax(-1))
    nll = {"full": F.cross_entropy(reference[:-1], targets).item(), 8: F.cross_entropy(eight[:-1], targets).item()}
    assert abs(nll[8] - nll["full"]) < 0.01
    for bits in (4, 2):
        for axis in ("token", "channel"):
            nll[bits, axis] = F.cross_entropy(teacher_forced_logits(model, ids, n_prompt, cache_bits=bits, key_quant_axis=axis)[:-1], targets).item()
    assert abs(nll[4, "token"] - nll["full"]) < 0.2 and abs(nll[4, "channel"] - nll["full"]) < 0.2
    assert nll["full"] < nll[2, "channel"] < nll[2, "token"]

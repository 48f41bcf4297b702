"""kvlab::attend_paged, the native decode attention over a paged pool's blocks (kvlab/kernels/csrc/attention_paged.cpp):
it equals torch's attention over the gathered view, within the bound of a different summation order, with
KV-Compress's metric (each slot's probabilities, or their squares, summed over the KV head's query rows); PagedKV
decodes through it on the CPU without gathering a view, and kvcompress generates the torch path's tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from test_paged import compressed_pool

from conftest import spec_for
from kvlab import kernels
from kvlab.attention import attention_mask, grouped_attention
from kvlab.engine import generate
from kvlab.kernels.__main__ import attention_reference, paged_view
from kvlab.paged import PagedKV

needs_native = pytest.mark.skipif(not kernels.NATIVE, reason=f"native kernels: {kernels.REASON}")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(3, 9, 3, 64, 16, 5), (2, 4, 4, 64, 4, 40), (1, 8, 2, 128, 16, 20), (2, 6, 3, 40, 8, 3)]
)
def test_paged_attention_and_its_metric_equal_torch_over_the_gathered_view(dtype, shape):
    """Rows, query heads, KV heads, head size, block size and blocks per head; empty slots, absent blocks (-1),
    a query that sees no slot (position -1) and runs of more than one task's blocks (40 x 4 slots)."""
    R, H, H_kv, D, block, W = shape
    g = torch.Generator().manual_seed(D + W)
    n_blocks = R * H_kv * W + 1
    k, v = (torch.randn(n_blocks, block, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(-1, 60, (n_blocks, block), generator=g)
    table = torch.randperm(n_blocks - 1, generator=g)[: R * H_kv * W].view(R, H_kv, W) + 1
    table[torch.rand(table.shape, generator=g) < 0.2] = -1
    q = torch.randn(R, H, 1, D, generator=g)
    query_pos = torch.randint(30, 60, (R, 1), generator=g)
    query_pos[-1] = -1 if R > 1 else query_pos[-1]
    keys, values, key_pos = paged_view(k, v, pos, table)
    want, atol = attention_reference(q, keys, values, key_pos, query_pos)
    probs = grouped_attention(q, keys, values, attention_mask(key_pos, query_pos), True)[1].nan_to_num(0.0)
    # each probability off by at most what the output's bound allows per unit of |v|; R rows of it summed
    p_atol = atol / max(values.abs().max().item(), 1.0) * probs.shape[2]
    # |p^2 - p'^2| <= (p + p') |p - p'|: twice the probabilities' bound for the squares
    for metric, want_metric, bound in (
        (1, probs.sum(dim=(2, 3)), p_atol),
        (2, probs.square().sum(dim=(2, 3)), 2 * p_atol),
    ):
        y, got_metric = torch.ops.kvlab.attend_paged(q, k, v, pos, table, query_pos, metric)
        torch.testing.assert_close(y, want.nan_to_num(0.0), rtol=0, atol=atol)
        torch.testing.assert_close(got_metric, want_metric, rtol=0, atol=bound)
    y, none = torch.ops.kvlab.attend_paged(q, k, v, pos, table, query_pos, 0)
    assert none.numel() == 0 and (R == 1 or (y[-1] == 0).all())  # position -1 sees nothing: zeros


@needs_native
def test_paged_attention_refuses_a_table_past_the_pool():
    k = torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match="table entry 4 past the pool's 4 blocks"):
        torch.ops.kvlab.attend_paged(
            torch.zeros(1, 2, 1, 8), k, k, torch.zeros(4, 2, dtype=torch.long), torch.tensor([[[1, 4]]]),
            torch.zeros(1, 1, dtype=torch.long), 2,
        )  # fmt: skip


@needs_native
def test_pagedkv_attends_in_place_and_adds_the_torch_paths_metric(monkeypatch):
    """After compression (heads holding different block counts, last blocks partly filled) and with an idle row:
    PagedKV.attend on the native kernel gives the gathered view's output and metric, and gathers no view."""
    paged = compressed_pool(D=16)
    on_torch = copy.deepcopy(paged)
    q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16)
    input_pos = torch.tensor([[45], [45], [-1]])
    original, views = PagedKV.view, []

    def spy(self: PagedKV, *args: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        views.append(args)
        return original(self, *args)

    monkeypatch.setattr(PagedKV, "view", spy)
    y = paged.attend(0, input_pos, k, v, q)
    assert views == []
    monkeypatch.setattr(kernels, "takes_attention", lambda *a: False)
    want = on_torch.attend(0, input_pos, k, v, q)
    assert len(views) == 1
    keys, values, key_pos = paged_view(
        paged.pool.k, paged.pool.v, paged.pool.pos, paged.table[0, :, :, : paged.view_blocks]
    )
    _, atol = attention_reference(q, keys, values, key_pos, input_pos)
    torch.testing.assert_close(y[:2], want[:2], rtol=0, atol=atol)
    assert (y[2] == 0).all()
    # the squares of a query group's 2 probabilities (test_paged_attention_...'s bound); block 0 is the null block an
    # absent table entry reads (where torch's softmax of nothing adds NaN)
    metric_atol = 2 * 2 * atol / values.abs().max().item()
    torch.testing.assert_close(paged.pool.metric[1:], on_torch.pool.metric[1:], rtol=0, atol=metric_atol)


def test_kvcompress_generates_the_torch_paths_tokens_through_the_native_kernel(tiny_model, monkeypatch):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    spec = spec_for(tiny_model, "kvcompress", 0.4, kvc_block_size=2, kvc_window=4, kvc_protect=3)
    native = generate(tiny_model, prompts, 24, spec, max_seq_length=44)
    assert tiny_model.layers[0].attention.kv_cache.attends_itself
    monkeypatch.setattr(kernels, "takes_attention", lambda *a: False)
    on_torch = generate(tiny_model, prompts, 24, spec, max_seq_length=44)
    assert native.tokens == on_torch.tokens

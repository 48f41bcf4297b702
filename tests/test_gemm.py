"""The native float products for a prompt's rows (kvlab/kernels/csrc/gemm.h: weight panels packed per call, a
register-blocked micro-kernel): against torch's product, and which calls take them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import kernels
from kvlab.kernels import reordering_atol

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


@native
@pytest.mark.parametrize("rows", [kernels.MAX_ROWS + 1, 16, 20, 97, 300])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (70, 37), (33, 100), (5, 1)])
def test_panel_product_equals_torch_and_each_block_of_rows_its_own(rows, k, n):
    """Rows of x in passes of equal rows (at most 14), panels of 32 weight rows (packed eight rows by eight k, the
    rest of k value by value) and a partial last one, k of any length: within the reordering of float32 sums of
    torch's product (with bias, and gated: |silu'| <= 1.1 as in test_kernels). Each output is one sum over k in
    order, so any MAX_ROWS + 1 rows of x give exactly the rows they give among the others (a row of a batch what it
    gets alone)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w, b, up = (
        torch.randn(rows, k, generator=g),
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, k, generator=g),
    )
    magnitude = max((x.abs() @ w.abs().T).max().item(), (x.abs() @ up.abs().T).max().item())
    got = torch.ops.kvlab.linear_fp32(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=reordering_atol(k, magnitude))
    gated_want = F.silu(F.linear(x, w)) * F.linear(x, up)
    torch.testing.assert_close(
        torch.ops.kvlab.gated_fp32(x, w, up), gated_want, rtol=0, atol=reordering_atol(k, 2.1 * magnitude**2)
    )
    start = (rows - kernels.MAX_ROWS - 1) // 2
    block = slice(start, start + kernels.MAX_ROWS + 1)
    assert torch.equal(torch.ops.kvlab.linear_fp32(x[block], w, b), got[block])


@native
def test_panel_product_of_bfloat16_weights_is_float32_sums_rounded_once():
    """The bfloat16 op with a prompt's rows (not the model's path: torch's bfloat16 product is faster) widens the
    weight as it packs it: float32 sums of the bfloat16 values, the output rounded to bfloat16 once."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(100, 577, generator=g).bfloat16(), torch.randn(70, 577, generator=g).bfloat16()
    magnitude = (x.float().abs() @ w.float().abs().T).max().item()
    want = F.linear(x.float(), w.float())
    got = torch.ops.kvlab.linear_bf16(x, w, None)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-8, atol=reordering_atol(577, magnitude))


@native
@pytest.mark.parametrize("rows", [1, 8, 9, 95, 96])
def test_float_products_take_the_native_ops_at_every_row_count(rows, monkeypatch):
    """A decode step's rows (up to MAX_ROWS: the matrix-vector kernels) and a prompt's (the panel product) take the
    native float32 ops: one kind of sum for every prompt row, however the rows are batched or chunked."""
    calls = []
    for name in ("linear_fp32", "gated_fp32"):
        op = getattr(torch.ops.kvlab, name)
        monkeypatch.setattr(torch.ops.kvlab, name, lambda *a, op=op, name=name: calls.append(name) or op(*a))
    x, w = torch.randn(1, rows, 64), torch.randn(40, 64)
    kernels.linear(x, w)
    kernels.gated(x, w, w)
    assert calls == ["linear_fp32", "gated_fp32"]


@native
def test_panel_product_compiles_into_the_graph_and_equals_eager():
    g = torch.Generator().manual_seed(5)
    w, up = torch.randn(40, 64, generator=g), torch.randn(40, 64, generator=g)
    x = torch.randn(2, 60, 64, generator=g)

    def prefill(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, w) + kernels.gated(x, w, up)

    with torch.no_grad():
        torch._dynamo.reset()
        assert torch.equal(torch.compile(prefill, fullgraph=True)(x), prefill(x))

"""kvlab's native bfloat16 products (a bfloat16 model's CPU decode step) against float32 torch on the same
bfloat16 values, and which calls take them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import kernels
from kvlab.kernels import reordering_atol

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


@native
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k,n", [(576, 960), (577, 1001), (7, 3), (33, 130)])
def test_bfloat16_products_equal_float32_torch_on_the_same_values(rows, k, n):
    """bfloat16 x and weights, float32 sums, one rounding of the output: |native - float32 torch on the same
    bfloat16 values| within the sums' reordering plus half a bfloat16 last place (2^-8 of the value)."""
    g = torch.Generator().manual_seed(rows * 7 + k)
    x, w, b, up = (
        t.bfloat16()
        for t in (
            torch.randn(rows, 1, k, generator=g),
            torch.randn(n, k, generator=g),
            torch.randn(n, generator=g),
            torch.randn(n, k, generator=g),
        )
    )
    xf, wf, uf = x.float(), w.float(), up.float()
    magnitude = max((xf.abs() @ wf.abs().T).max().item(), (xf.abs() @ uf.abs().T).max().item())
    got = kernels.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), F.linear(xf, wf, b.float()), rtol=2.0**-8, atol=reordering_atol(k, magnitude)
    )
    gated = kernels.gated(x, w, up)
    torch.testing.assert_close(
        gated.float(),
        F.silu(F.linear(xf, wf)) * F.linear(xf, uf),
        rtol=2.0**-8,
        atol=reordering_atol(k, 2.1 * magnitude**2),
    )


@native
def test_bfloat16_decode_takes_the_native_products_and_prefill_torchs(monkeypatch):
    calls = []
    for name in ("linear_bf16", "gated_bf16"):
        op = getattr(torch.ops.kvlab, name)
        monkeypatch.setattr(
            torch.ops.kvlab, name, lambda *a, op=op, name=name: calls.append((name, a[0].shape[:-1])) or op(*a)
        )
    w = torch.randn(6, 4).bfloat16()
    for x in (torch.randn(2, 1, 4), torch.randn(1, 9, 4), torch.randn(1, 4, requires_grad=True)):
        kernels.linear(x.bfloat16(), w)
        kernels.gated(x.bfloat16(), w, w)
    kernels.linear(torch.randn(1, 4).bfloat16(), w.t().contiguous().t())  # column-major: torch's kernel
    assert calls == [("linear_bf16", (2, 1)), ("gated_bf16", (2, 1))]

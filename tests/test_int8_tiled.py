"""The int8 products for many rows (x in int16, codes tiled per call: kvlab/kernels/csrc/gemv_int8_tiled.cpp): against
torch's product of the codes, and taken by Int8Linear beyond a decode step's rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import kernels
from kvlab.kernels import reordering_atol
from kvlab.kernels.__main__ import int8_rounding_bound
from kvlab.quantize import Int8Linear, Quantization, quantize_int8
from kvlab.quantized_model import quantize_linear

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def int8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's product of the codes widened exactly, and the bound on the tiled op's distance from it: x's rounding
    to int16 plus the reordering of float32 sums."""
    magnitude = (x.abs() @ (q.float().abs() * scales[:, None]).T).max().item()
    return F.linear(x, q.float()) * scales, int8_rounding_bound(x, q, scales) + reordering_atol(q.shape[1], magnitude)


def int8_linear(w: torch.Tensor) -> Int8Linear:
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    return quantize_linear(linear, Quantization("int8"))


@native
@pytest.mark.parametrize("rows", [1, 9, 12, 13, 29, 100])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (577, 130), (40, 3), (7, 17)])
def test_tiled_int8_linear_equals_the_product_of_its_codes(rows, k, n):
    """Rows of x of every count against the 12-row passes, tail tiles (n not a multiple of 16) and tail blocks (k not
    a multiple of 32): within x's int16 rounding and float32 reordering of torch's product; that bound is tight (a
    thousandth of the output's size), and each row's result is the one it gets alone (x is rounded per row)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, scales = quantize_int8(w)
    want, bound = int8_reference(x, q, scales)
    got = torch.ops.kvlab.linear_int8_tiled(x, q, scales, b)
    assert ((got - want - b).abs() <= bound).all()
    assert bound.max() < 1e-3 * want.abs().max()
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(got[i], torch.ops.kvlab.linear_int8_tiled(x[i : i + 1], q, scales, b)[0])


@native
def test_tiled_int8_is_not_the_product_of_other_codes():
    """The bound above catches one row's scale off by 1% (x's int16 rounding allows ~1e-4 of the output): the
    comparison can fail, and fails on that row only."""
    g = torch.Generator().manual_seed(0)
    x, q, scales = (
        torch.randn(20, 576, generator=g),
        torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=g),
        torch.rand(64, generator=g),
    )
    want, bound = int8_reference(x, q, scales)
    wrong = scales.clone()
    wrong[5] *= 1.01
    gap = (torch.ops.kvlab.linear_int8_tiled(x, q, wrong, None) - want).abs() - bound
    assert (gap > 0).any() and (gap[:, [i for i in range(64) if i != 5]] <= 0).all()


@native
@pytest.mark.parametrize("rows", [1, 8, 9, 70, 513])
def test_int8_linear_takes_the_float_op_for_a_step_and_the_tiled_op_beyond(rows, monkeypatch):
    """Up to kernels.MAX_ROWS rows (a decode step) Int8Linear multiplies x in float32 (kvlab::linear_int8); more rows
    (a prefill) take the tiled op, and so do its gate and up projections, in one call."""
    g = torch.Generator().manual_seed(rows)
    gate, up = int8_linear(torch.randn(300, 576, generator=g)), int8_linear(torch.randn(300, 576, generator=g))
    x = torch.randn(rows, 576, generator=g)
    calls = []
    for name in ("linear_int8", "linear_int8_tiled", "gated_int8", "gated_int8_tiled"):
        op = getattr(torch.ops.kvlab, name)
        monkeypatch.setattr(torch.ops.kvlab, name, lambda *a, op=op, name=name: calls.append(name) or op(*a))
    with torch.no_grad():
        got, gated = gate(x), gate.gated(up, x)
    tiled = rows > kernels.MAX_ROWS
    assert calls == (["linear_int8_tiled", "gated_int8_tiled"] if tiled else ["linear_int8", "gated_int8"])
    want, bound = int8_reference(x, gate.weight, gate.scales)
    if not tiled:  # x in float32: only the order of float32 sums differs
        bound = reordering_atol(576, (x.abs() @ gate.dequantize().abs().T).max().item())
    assert ((got - want).abs() <= bound).all()
    want_up, bound_up = int8_reference(x, up.weight, up.scales)
    gated_bound = 1.1 * bound * want_up.abs() + F.silu(want).abs() * bound_up + 1.1 * bound * bound_up
    assert ((gated - F.silu(want) * want_up).abs() <= gated_bound).all()


@native
def test_tiled_int8_compiles_into_the_graph_and_equals_eager():
    g = torch.Generator().manual_seed(1)
    gate, up = int8_linear(torch.randn(40, 64, generator=g)), int8_linear(torch.randn(40, 64, generator=g))
    x = torch.randn(2, 15, 64, generator=g)

    def prefill(x: torch.Tensor) -> torch.Tensor:
        return gate(x) + gate.gated(up, x)

    graphs = []

    def record(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes])
        return gm

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(prefill, backend=record, fullgraph=True)(x)
        # Dynamo records the op packets
        assert {torch.ops.kvlab.linear_int8_tiled, torch.ops.kvlab.gated_int8_tiled} <= set(graphs[0])
        torch._dynamo.reset()
        assert torch.equal(torch.compile(prefill, fullgraph=True)(x), prefill(x))


@native
def test_tiled_int8_operands_that_do_not_fit_are_one_line_errors():
    q, scales = torch.zeros(20, 32, dtype=torch.int8), torch.ones(20)
    with pytest.raises(RuntimeError, match="x must be float32 with 32 features"):
        torch.ops.kvlab.linear_int8_tiled(torch.randn(9, 33), q, scales, None)
    with pytest.raises(RuntimeError, match=r"20 weight rows need as many contiguous float32 scales, got \[19\]"):
        torch.ops.kvlab.linear_int8_tiled(torch.randn(9, 32), q, torch.ones(19), None)
    with pytest.raises(RuntimeError, match=r"gate \[20, 32\] and up \[21, 32\] differ"):
        torch.ops.kvlab.gated_int8_tiled(
            torch.randn(9, 32), q, scales, torch.zeros(21, 32, dtype=torch.int8), torch.ones(21)
        )

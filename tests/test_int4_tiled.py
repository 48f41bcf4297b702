"""The int4 products in the tiled layout (x in int16, the default decode path): against torch's product of
the dequantized weights and against the plain layout's int16 products (kvlab/kernels/csrc/gemv_int4_tiled.cpp)."""

from __future__ import annotations

import pytest
import torch

from kvlab import kernels
from kvlab.kernels import reordering_atol
from kvlab.kernels.__main__ import int4_reference, int4_rounding_bound
from kvlab.quantize import GROUPSIZES, Int4Linear, Quantization, quantize_int4
from kvlab.quantized_model import quantize_linear

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def int4_linear(w: torch.Tensor) -> Int4Linear:
    """w [n, k] as an int4 g32 Linear prepared for the native kernels, x in int16: the tiled layout, which alone holds
    the codes (untiled exactly where asked)."""
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    module = quantize_linear(linear, Quantization("int4", 32))
    module.x_bits = 16
    codes = module.weight
    module.prepare(None)
    assert module.tiled is not None and module.weight is None and torch.equal(module.codes(), codes)
    return module


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("groupsize", GROUPSIZES)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (577, 130), (40, 3)])
def test_tiled_int4_linear_equals_the_product_of_its_dequantized_weights(rows, groupsize, k, n):
    """The tiled layout's product (x rounded to int16, the default), with tail tiles and rows of every count:
    within the plain layout's int16 bound of torch's product with the weights dequantized, and within the
    reordering of float32 sums of the plain layout's int16 product (the same exact integer sums per block)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + groupsize)
    x, w, b = torch.randn(rows, 1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    codes, scales, zeros = quantize_int4(w, groupsize)
    offsets = zeros - 8 * scales
    want, magnitude = int4_reference(x, codes, scales, zeros)
    atol = reordering_atol(2 * codes.shape[1], magnitude)
    tiled = torch.ops.kvlab.int4_tile(codes)
    assert tiled.shape == (-(-n // 16), codes.shape[1] * 16)
    got = torch.ops.kvlab.linear_int4_tiled(
        x, tiled, kernels.tile_rows(scales), kernels.tile_rows(offsets), n, groupsize, b
    )
    assert ((got - want - b).abs() <= int4_rounding_bound(x, codes, scales, 16) + atol).all()
    torch.testing.assert_close(
        got, torch.ops.kvlab.linear_int4(x, codes, scales, offsets, groupsize, b, 16), rtol=0, atol=atol
    )


@native
def test_tiled_int4_operands_that_do_not_fit_are_one_line_errors():
    """Tiles that hold another row count, untiled scales, or plain codes are refused, naming what was expected."""
    codes = torch.ops.kvlab.int4_tile(torch.zeros(20, 16, dtype=torch.uint8))  # 20 rows of 32 codes: 2 tiles
    x, vectors = torch.randn(1, 32), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="2 tiles do not hold 40 rows"):
        torch.ops.kvlab.linear_int4_tiled(x, codes, vectors, vectors, 40, 32, None)
    with pytest.raises(
        RuntimeError,
        match=r"scales and offsets must be contiguous float16 \[2, 1, 16\] \(kvlab.kernels.tile_rows.\), got "
        r"Float \[20, 1\]",
    ):
        torch.ops.kvlab.linear_int4_tiled(x, codes, torch.zeros(20, 1), vectors, 20, 32, None)
    with pytest.raises(RuntimeError, match=r"takes contiguous uint8 \[tiles, blocks \* 256\] codes"):
        torch.ops.kvlab.linear_int4_tiled(x, torch.zeros(20, 16, dtype=torch.uint8), vectors, vectors, 20, 32, None)


@native
@pytest.mark.parametrize("rows", [1, 3, 8, 70])
@pytest.mark.parametrize("k,n", [(576, 1536), (65, 300)])
def test_tiled_gated_int4_equals_the_plain_layouts(rows, k, n, monkeypatch):
    """An int4 gate and up projection with x in int16 (the default) take the tiled op, in one call, a decode step's
    rows and a prefill's (70), and give the plain layout's int16 result to the reordering of float32 sums
    (|silu'| <= 1.1, as in the test above)."""
    g = torch.Generator().manual_seed(rows + k)
    gate, up = (int4_linear(torch.randn(n, k, generator=g)) for _ in range(2))
    x = torch.randn(rows, 1, k, generator=g)
    magnitude = max(int4_reference(x, m.codes(), m.scales, m.zeros)[1] for m in (gate, up))
    calls, op = [], torch.ops.kvlab.gated_int4_tiled
    monkeypatch.setattr(torch.ops.kvlab, "gated_int4_tiled", lambda *a: calls.append(1) or op(*a))
    with torch.no_grad():
        got = gate.gated(up, x)
    assert calls == [1]
    operands = (gate.codes(), gate.scales, gate.offsets, up.codes(), up.scales, up.offsets)
    plain = torch.ops.kvlab.gated_int4(x, *operands, 32, 16)
    torch.testing.assert_close(got, plain, rtol=0, atol=reordering_atol(gate.padded_in, 2.1 * magnitude**2))


@native
@pytest.mark.parametrize("rows", [9, 100, 513])
def test_a_prefills_int4_products_take_the_tiled_op(rows, monkeypatch):
    """More rows than a decode step has (a prefill's) still take the tiled op with x in int16 (faster than
    dequantize-then-matmul at every row count: Int4Linear.prepare), within the int16 bound of the product of the
    dequantized weights; each row's result is the one it gets alone (x is rounded per row, over the cores)."""
    g = torch.Generator().manual_seed(rows)
    module = int4_linear(torch.randn(300, 576, generator=g))
    x = torch.randn(rows, 576, generator=g)
    calls, op = [], torch.ops.kvlab.linear_int4_tiled
    monkeypatch.setattr(torch.ops.kvlab, "linear_int4_tiled", lambda *a: calls.append(1) or op(*a))
    with torch.no_grad():
        got = module(x)
    assert calls == [1]
    codes = module.codes()
    want, magnitude = int4_reference(x, codes, module.scales, module.zeros)
    terms = 2 * codes.shape[1]
    bound = int4_rounding_bound(x, codes, module.scales, 16) + reordering_atol(terms, magnitude)
    assert ((got - want).abs() <= bound).all()
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(got[i], op(x[i : i + 1], *module.tiled_operands(), 300, 32, None)[0])

"""kvlab's native CPU kernels (kvlab/kernels) against torch's: every instruction-set path, odd shapes and
tails, every int4 group size, batches 1 to 8, inside torch.compile's graph, and the pure-torch fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_kernels_attention import attention_inputs

from conftest import ROOT, make_tiny_model, native
from kvlab import kernels
from kvlab.build import make_caches
from kvlab.kernels import reordering_atol
from kvlab.kernels.__main__ import int4_reference, int4_rounding_bound
from kvlab.model import Linear
from kvlab.quantize import GROUPSIZES, Int4Linear, Int8Linear, Quantization, quantize_int4, quantize_int8
from kvlab.quantized_model import quantize_linear, quantize_model
from tolerance import assert_reordered_close


def cpu_isas() -> list[str]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return ["scalar", "avx2"] + (["avx512"] if " avx512f" in flags else [])


def run_module(isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLAB_KERNEL_ISA": isa}
    return subprocess.run(
        [sys.executable, "-m", "kvlab.kernels"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@native
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k,n", [(576, 960), (577, 1001), (1536, 576), (7, 3), (16, 4), (33, 130)])
def test_linear_equals_torch_to_summation_order(rows, k, n):
    """Every row count a decode step can have, K with and without an 8/16-lane tail, N with and without a
    4-row tail: |native - F.linear| within the rounding of one sum of K products (tests/tolerance.py)."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    got = torch.ops.kvlab.linear_fp32(x, w, b)
    magnitude = (x.abs() @ w.abs().T).max().item()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=reordering_atol(k, magnitude))
    torch.testing.assert_close(
        torch.ops.kvlab.linear_fp32(x[:, None], w, None),
        F.linear(x[:, None], w),
        rtol=0,
        atol=reordering_atol(k, magnitude),
    )


@native
def test_a_wrong_weight_row_is_caught():
    """The bound above is far below a real fault: one weight row off by one position fails it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 577, generator=g), torch.randn(9, 577, generator=g)
    shifted = torch.ops.kvlab.linear_fp32(x, w.roll(1, dims=0).contiguous(), None)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            shifted, F.linear(x, w), rtol=0, atol=reordering_atol(577, (x.abs() @ w.abs().T).max().item())
        )


@native
@pytest.mark.parametrize("isa", cpu_isas())
def test_every_instruction_set_path_matches_torch(isa):
    """`python -m kvlab.kernels` with each path this CPU has forced: it names the path and exits 0."""
    result = run_module(isa)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"native {isa}: every op matches torch")


def test_without_native_kernels_torch_runs_and_says_so():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvlab import kernels; import torch; print(kernels.load(), kernels.linear(torch.ones(1, 3), "
            "torch.ones(2, 3)).tolist())",
        ],
        cwd=ROOT,
        env={**os.environ, "KVLAB_KERNELS": "torch"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "False [[3.0, 3.0]]"
    assert result.stderr.strip() == "kvlab: KVLAB_KERNELS=torch; running torch's kernels"


@native
def test_linear_takes_the_native_kernel_only_for_float32_outside_autograd(monkeypatch):
    """A decode step's rows and a prompt's (9 and more: the panel product) alike; float64, a tensor that needs
    gradients and a column-major weight take torch's."""
    calls = []
    op = torch.ops.kvlab.linear_fp32
    monkeypatch.setattr(torch.ops.kvlab, "linear_fp32", lambda *a: calls.append(a[0].shape) or op(*a))
    w = torch.randn(6, 4)
    for x in (
        torch.randn(2, 1, 4),
        torch.randn(1, 8, 4),
        torch.randn(9, 4),
        torch.randn(1, 4, dtype=torch.float64),
        torch.randn(1, 4, requires_grad=True),
    ):
        kernels.linear(x, w.to(x.dtype))
    kernels.linear(torch.randn(1, 4), w.t().contiguous().t())  # column-major: torch's kernel
    assert calls == [(2, 1, 4), (1, 8, 4), (9, 4)]


@native
def test_compiled_graph_keeps_the_native_op_and_equals_eager():
    torch.manual_seed(0)
    linear = torch.nn.Linear(577, 130)
    x = torch.randn(3, 1, 577)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes])
        return gm

    int8, int4, int4_x8 = (
        quantize_model(make_tiny_model(), q).layers[0].feed_forward
        for q in (Quantization("int8"), Quantization("int4", 32), Quantization("int4", 32))
    )
    for module in int4_x8.modules():
        if isinstance(module, Int4Linear):
            module.x_bits = 8  # the plain layout's ops; int16 x (the default) takes the tiled ones
    gate, up = torch.nn.Linear(32, 20, bias=False), torch.nn.Linear(32, 20, bias=False)
    bf16 = torch.nn.Linear(32, 8).bfloat16()

    q, k, v, key_pos, query_pos = attention_inputs(3, 4, 2, 1, 40, 8, False)

    def step(x):
        h = kernels.linear(x, linear.weight, linear.bias)[..., :32]
        h = h + torch.ops.kvlab.attend_fp32(q, k, v, key_pos, query_pos).reshape(3, 1, 32)
        int4_products = int4.w1(h) + int4.w1.gated(int4.w3, h) + int4_x8.w1(h) + int4_x8.w1.gated(int4_x8.w3, h)
        bf16_products = (
            kernels.linear(h.bfloat16(), bf16.weight, bf16.bias).float()
            + kernels.gated(h.bfloat16(), bf16.weight, bf16.weight).float()
        )
        return (
            int8.w1(h).relu()
            + int8.w1.gated(int8.w3, h)
            + int4_products
            + kernels.gated(h, gate.weight, up.weight)[..., :1]
            + bf16_products[..., :1]
        )

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(step, backend=record, fullgraph=True)(x)
        ops = [
            getattr(torch.ops.kvlab, name)
            for name in (
                "linear_fp32",
                "linear_int8",
                "linear_int4",
                "linear_int4_tiled",
                "gated_fp32",
                "gated_int8",
                "gated_int4",
                "gated_int4_tiled",
                "attend_fp32",
                "linear_bf16",
                "gated_bf16",
            )
        ]
        assert set(ops) <= set(graphs[0])  # Dynamo records the op packets
        torch._dynamo.reset()
        assert torch.equal(torch.compile(step, fullgraph=True)(x), step(x))


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k,n", [(576, 960), (577, 130), (1536, 576), (15, 3), (33, 7)])
def test_int8_linear_equals_the_float_product_of_its_codes(rows, k, n):
    """(x @ q^T) * scales + bias with int8 codes widened exactly to float32: within the rounding of one
    sum of K products, for 16/32-code tails and every row count."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, 1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, scales = quantize_int8(w)
    want = F.linear(x, q.float()) * scales + b
    magnitude = (x.abs() @ q.float().abs().T).max().item() * scales.max().item()
    torch.testing.assert_close(
        torch.ops.kvlab.linear_int8(x, q, scales, b), want, rtol=0, atol=reordering_atol(k, magnitude)
    )


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("groupsize", GROUPSIZES)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (577, 130), (40, 3)])
def test_int4_linear_equals_the_product_of_its_dequantized_weights(rows, groupsize, k, n):
    """x @ w^T for 4-bit weights (K padded to whole groups) against torch's product with the weights
    dequantized. x in float32: within the rounding of the kernel's two sums (codes, offsets) of up to Kp
    terms. x rounded per block of 32 to int16 (the default) or int8: within half a step per input on top of
    that; int8's rounding is further off than summation order alone, int16's differs from float32 x's."""
    g = torch.Generator().manual_seed(rows * 1000 + k + groupsize)
    x, w, b = torch.randn(rows, 1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    codes, scales, zeros = quantize_int4(w, groupsize)
    want, magnitude = int4_reference(x, codes, scales, zeros)
    atol = reordering_atol(2 * codes.shape[1], magnitude)
    exact = torch.ops.kvlab.linear_int4(x, codes, scales, zeros - 8 * scales, groupsize, b, 32)
    torch.testing.assert_close(exact, want + b, rtol=0, atol=atol)
    for x_bits in (16, 8):
        got = torch.ops.kvlab.linear_int4(x, codes, scales, zeros - 8 * scales, groupsize, b, x_bits)
        assert ((got - want - b).abs() <= int4_rounding_bound(x, codes, scales, x_bits) + atol).all()
        assert not torch.equal(got, exact)
    assert (got - want - b).abs().max() > atol


@native
@pytest.mark.parametrize("x_bits", [32, 16, 8])
def test_int4_codes_in_the_wrong_nibble_are_caught(x_bits):
    """The even column lives in the high nibble: the codes pass each mode's bound, and the same codes with
    their nibbles swapped fail it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 576, generator=g), torch.randn(64, 576, generator=g)
    codes, scales, zeros = quantize_int4(w, 32)
    want, magnitude = int4_reference(x, codes, scales, zeros)
    bound = reordering_atol(576, magnitude) + (int4_rounding_bound(x, codes, scales, x_bits) if x_bits < 32 else 0)
    swapped = (codes << 4 | codes >> 4).contiguous()
    errors = [
        (torch.ops.kvlab.linear_int4(x, c, scales, zeros - 8 * scales, 32, None, x_bits) - want).abs()
        for c in (codes, swapped)
    ]
    assert (errors[0] <= bound).all() and not (errors[1] <= bound).all()


@native
def test_int4_x_bits_outside_the_choices_is_a_one_line_error():
    """x_bits is 32, 16 or 8; anything else is refused, naming the value."""
    codes, scales = torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="x_bits must be 32, 16 or 8, got 4"):
        torch.ops.kvlab.linear_int4(torch.randn(1, 32), codes, scales, scales, 32, None, 4)


def kvlab_linear(linear: torch.nn.Linear) -> Linear:
    module = Linear(linear.in_features, linear.out_features, bias=False)
    module.weight.data = linear.weight.data
    return module


def gated_operands(mode: str, k: int, n: int, generator: torch.Generator) -> tuple[list[torch.nn.Module], int]:
    """A gate and an up projection [n, k] quantized as `mode`, and the terms of each one's sums."""
    linears = [torch.nn.Linear(k, n, bias=False) for _ in range(2)]
    for linear in linears:
        linear.weight.data = torch.randn(n, k, generator=generator)
    if mode == "fp32":
        return [kvlab_linear(linear) for linear in linears], k
    modules = [quantize_linear(linear, Quantization(mode, 32 if mode == "int4" else None)) for linear in linears]
    for module in modules:
        module.prepare(None)
        if isinstance(module, Int4Linear):
            module.x_bits = 32  # x in float32, so the product rounds only as float32 sums do
    return modules, k + -k % 32


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("mode", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("k,n", [(576, 1536), (65, 300)])
def test_gated_projection_equals_silu_of_gate_times_up(rows, mode, k, n, monkeypatch):
    """silu(gate(x)) * up(x) in one native call against torch's three ops on the same weights (for int8
    and int4, the dequantized ones): |silu'| <= 1.1 turns each product's rounding bound at magnitude m
    into at most 2.1 m^2 x the same factor for the result."""
    g = torch.Generator().manual_seed(rows + k)
    (gate, up), terms = gated_operands(mode, k, n, g)
    x = torch.randn(rows, 1, k, generator=g)
    (gate_y, gate_m), (up_y, up_m) = (torch_product(m, x) for m in (gate, up))
    calls = []
    op = getattr(torch.ops.kvlab, f"gated_{mode}")
    monkeypatch.setattr(torch.ops.kvlab, f"gated_{mode}", lambda *a: calls.append(1) or op(*a))
    with torch.no_grad():
        got = gate.gated(up, x)
    assert calls == [1]
    torch.testing.assert_close(
        got, F.silu(gate_y) * up_y, rtol=0, atol=reordering_atol(terms, 2.1 * max(gate_m, up_m) ** 2)
    )


def torch_product(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """x @ w^T with the module's weights (dequantized) in torch, and the magnitude of the kernel's sums."""
    if isinstance(module, Int4Linear):
        return int4_reference(x, module.codes(), module.scales, module.zeros)
    w = module.dequantize() if isinstance(module, Int8Linear) else module.weight
    return F.linear(x, w), (x.abs() @ w.abs().T).max().item()


@native
@pytest.mark.parametrize(
    "quant",
    [Quantization("int8"), Quantization("int4", 32), Quantization("int4", 128)],
    ids=["int8", "int4-g32", "int4-g128"],
)
def test_quantized_decode_step_matches_dequantize_then_matmul(quant, monkeypatch):
    """A quantized model's decode step on the native kernels (every Linear and the gated projection)
    against the same model dequantizing its weights to float32 (torch's kernels): logits to summation
    order through the model's chain of sums."""
    model = quantize_model(make_tiny_model(), quant)
    assert all(m.offsets is not None for m in model.modules() if isinstance(m, Int4Linear))
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.x_bits = 32  # x in float32 (test_quantize checks the default, x in int16, on SmolLM2)
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.prepare(None)
    logits = {}
    for native_path in (True, False):
        monkeypatch.setattr(kernels, "NATIVE", native_path)
        model.setup_caches(make_caches("full", 2, 2, 2, 16, 8, torch.float32))
        with torch.no_grad():
            model(torch.tensor([[3, 9, 27, 17, 5], [7, 21, 63, 1, 8]]), torch.arange(5).expand(2, 5), prefill=True)
            logits[native_path] = model(torch.tensor([[4], [6]]), torch.full((2, 1), 5))
    assert_reordered_close(logits[True], logits[False], terms=128, chain=4 * model.config.n_layer + 1)

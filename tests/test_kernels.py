"""kvlab's native CPU kernels (kvlab/kernels) against torch's: every instruction-set path, odd shapes and
tails, batches 1 to 8, inside torch.compile's graph, and the pure-torch fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, make_tiny_model, spec_for
from kvlab import kernels
from kvlab.build import make_caches
from kvlab.engine import generate
from kvlab.kernels import reordering_atol
from kvlab.quantize import Int8Linear, Quantization, quantize_int8, quantize_model
from tolerance import assert_reordered_close

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def cpu_isas() -> list[str]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return ["scalar", "avx2"] + (["avx512"] if " avx512f" in flags else [])


def run_module(isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLAB_KERNEL_ISA": isa}
    return subprocess.run([sys.executable, "-m", "kvlab.kernels"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


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
    torch.testing.assert_close(torch.ops.kvlab.linear_fp32(x[:, None], w, None), F.linear(x[:, None], w), rtol=0, atol=reordering_atol(k, magnitude))


@native
def test_a_wrong_weight_row_is_caught():
    """The bound above is far below a real fault: one weight row off by one position fails it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 577, generator=g), torch.randn(9, 577, generator=g)
    shifted = torch.ops.kvlab.linear_fp32(x, w.roll(1, dims=0).contiguous(), None)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(shifted, F.linear(x, w), rtol=0, atol=reordering_atol(577, (x.abs() @ w.abs().T).max().item()))


@native
@pytest.mark.parametrize("isa", cpu_isas())
def test_every_instruction_set_path_matches_torch(isa):
    """`python -m kvlab.kernels` with each path this CPU has forced: it names the path and exits 0."""
    result = run_module(isa)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"native {isa}: every op matches torch")


def test_without_native_kernels_torch_runs_and_says_so():
    result = subprocess.run(
        [sys.executable, "-c", "from kvlab import kernels; import torch; print(kernels.load(), kernels.linear(torch.ones(1, 3), torch.ones(2, 3)).tolist())"],
        cwd=ROOT,
        env={**os.environ, "KVLAB_KERNELS": "torch"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "False [[3.0, 3.0]]"
    assert result.stderr.strip() == "kvlab: KVLAB_KERNELS=torch; running torch's kernels"


@native
def test_linear_takes_the_native_kernel_only_for_a_float32_decode_step(monkeypatch):
    calls = []
    op = torch.ops.kvlab.linear_fp32
    monkeypatch.setattr(torch.ops.kvlab, "linear_fp32", lambda *a: calls.append(a[0].shape) or op(*a))
    w = torch.randn(6, 4)
    for x in (torch.randn(2, 1, 4), torch.randn(1, 8, 4), torch.randn(9, 4), torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 4, requires_grad=True)):
        kernels.linear(x, w.to(x.dtype))
    kernels.linear(torch.randn(1, 4), w.t().contiguous().t())  # column-major: torch's kernel
    assert calls == [(2, 1, 4), (1, 8, 4)]


@native
def test_compiled_graph_keeps_the_native_op_and_equals_eager():
    torch.manual_seed(0)
    linear = torch.nn.Linear(577, 130)
    x = torch.randn(3, 1, 577)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes])
        return gm

    quantized = quantize_model(make_tiny_model(), Quantization("int8")).layers[0].feed_forward.w1

    def step(x):
        return quantized(kernels.linear(x, linear.weight, linear.bias)[..., :32]).relu()

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(step, backend=record, fullgraph=True)(x)
        assert {torch.ops.kvlab.linear_fp32, torch.ops.kvlab.linear_int8} <= set(graphs[0])  # Dynamo records the op packets
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
    torch.testing.assert_close(torch.ops.kvlab.linear_int8(x, q, scales, b), want, rtol=0, atol=reordering_atol(k, magnitude))


@native
def test_int8_decode_step_matches_dequantize_then_matmul(monkeypatch):
    """A quantized model's decode step on the native int8 kernel against the same model dequantizing its
    weights to float32 (torch's kernels): logits to summation order through the model's chain of sums."""
    model = quantize_model(make_tiny_model(), Quantization("int8"))
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
    assert_reordered_close(logits[True], logits[False], terms=64, chain=2 * model.config.n_layer + 1)


@native
@pytest.mark.parametrize("prompt", ["The history of the printing press begins", "What is the capital of France?"])
def test_native_and_torch_kernels_give_the_same_greedy_text(smollm, prompt, monkeypatch):
    """The default model, the README's prompts: the same 24 greedy tokens on either path (the weights stay
    row-major: torch's kernels take them as they are)."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(prompt)
    tokens = {}
    for native_path in (True, False):
        monkeypatch.setattr(kernels, "NATIVE", native_path)
        tokens[native_path] = generate(model, [ids], 24, spec_for(model, "full")).tokens
    assert tokens[True] == tokens[False]

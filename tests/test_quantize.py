"""Weight-only int8/int4 quantization (kvlab/quantize.py, scripts/quantize.py): error bounds, quality on
the default model, the quantized checkpoint, fused kernels against dequantize-then-matmul, compiled."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, paul_graham_text
from kvlab import kernels
from kvlab.build import make_caches
from kvlab.checkpoint import load_checkpoint
from kvlab.quantize import (
    FUSED,
    Int4Linear,
    Int8Linear,
    Kernel,
    Quantization,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from kvlab.quantized_model import quantize_linear, quantize_model

sys.path.insert(0, str(ROOT / "scripts"))
from quantize import main as quantize_main  # noqa: E402
from quantize import quantize_checkpoint  # noqa: E402


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """Prefill logits of every position: one sequence through a full cache."""
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, len(ids), a.head_dim, torch.float32))
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], prefill=True)[0]


def decode_logits_of(model, ids: list[int]) -> torch.Tensor:
    """The logits of every position, fed one token per step as decoding does (the native kernels' input)."""
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, len(ids), a.head_dim, torch.float32))
    with torch.no_grad():
        return torch.cat([model(torch.tensor([[t]]), torch.tensor([[i]]))[0] for i, t in enumerate(ids)])


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()


@pytest.fixture(scope="module")
def essay_ids(smollm) -> list[int]:
    return smollm[1].encode(paul_graham_text()[:6000])[:256]


@pytest.fixture(scope="module")
def float_logits(smollm, essay_ids) -> torch.Tensor:
    return logits_of(smollm[0], essay_ids)


@pytest.fixture(scope="module")
def long_essay(smollm) -> tuple[list[int], torch.Tensor]:
    """1,024 essay tokens and their float32 logits: where a rate's spread over 256 positions is too wide."""
    ids = smollm[1].encode(paul_graham_text()[:8000])[:1024]
    assert len(ids) == 1024
    return ids, logits_of(smollm[0], ids)


def test_quantize_dequantize_error_is_at_most_half_a_step():
    """Rounding to the nearest level: every weight within half a quantization step of its value, int8
    per row (step = the row's scale), int4 per group (padding columns aside)."""
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.rand(48, 1) * 3
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert ((dequantize_int8(q, scales) - w).abs() <= scales[:, None] / 2 + 1e-6).all()
    packed, scales, zeros = quantize_int4(w, 32)  # 80 -> 96 columns: 3 groups, the last one padded
    assert packed.shape == (48, 48) and packed.dtype == torch.uint8 and scales.shape == zeros.shape == (48, 3)
    error = (dequantize_int4(packed, scales, zeros)[:, :80] - w).abs()
    assert (error <= scales.repeat_interleave(32, dim=1)[:, :80] / 2 + 1e-6).all()


def test_int4_scales_and_minimums_are_float16_values():
    """Each int4 group's scale and minimum (zero - 8 scale) are float16 values (llama.cpp Q4_1's numerics), as
    the native tiled kernel reads them: the minimum at or below the group's, its range within 15 steps."""
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.rand(48, 1) * 3
    _, scales, zeros = quantize_int4(w, 32)
    minimums, groups = zeros - 8 * scales, w.view(48, 3, 32)
    assert torch.equal(scales.half().float(), scales) and torch.equal(minimums.half().float(), minimums)
    assert (minimums <= groups.amin(-1)).all() and (groups.amax(-1) <= minimums + 15 * scales).all()


def test_int8_logits_stay_close_to_float32(smollm, float_logits, essay_ids):
    """int8 per-channel weights, 256 essay tokens. Measured: mean |logit change| 0.20 against a logit
    spread (std) of 5.9, max 1.43, correlation 0.9991, perplexity -0.03%. Bounds: mean < 0.3, max < 2.5,
    r >= 0.998, and perplexity within 1% (the issue's target for int8)."""
    model = quantize_model(copy.deepcopy(smollm[0]), Quantization("int8"))
    logits = logits_of(model, essay_ids)
    diff = (logits - float_logits).abs()
    assert diff.mean() < 0.3 and diff.max() < 2.5
    assert torch.corrcoef(torch.stack([logits.flatten(), float_logits.flatten()]))[0, 1] >= 0.998
    assert abs(perplexity(logits, essay_ids) / perplexity(float_logits, essay_ids) - 1) < 0.01


def test_int4_top1_agrees_with_float32(smollm, float_logits, essay_ids):
    """int4 g=32 (the default): the next-token argmax equals float32's at >= 95% of 256 essay positions
    (measured 98.4%: the GGUF's layers are Q4_1 in groups of 32, which g=32 nearly reproduces; int8 gives
    94%), and perplexity stays within 2% (measured -0.1%; the issue's target for int4 is 5%)."""
    model = quantize_model(copy.deepcopy(smollm[0]), Quantization("int4", 32))
    logits = logits_of(model, essay_ids)
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean() >= 0.95
    assert abs(perplexity(logits, essay_ids) / perplexity(float_logits, essay_ids) - 1) < 0.02


@pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")
@pytest.mark.parametrize(
    "x_bits,top1,ppl", [(32, 0.95, 0.02), (16, 0.95, 0.02), (8, 0.90, 0.05)], ids=["x-float32", "x-int16", "x-int8"]
)
def test_int4_decode_steps_agree_with_float32(smollm, float_logits, essay_ids, x_bits, top1, ppl, monkeypatch, request):
    """int4 g=32 decode steps on the native kernels, the essay's positions fed one token per step. x in
    float32 or rounded to int16 per block of 32 (the default, on the tiled layout), 256 positions: the
    prefill's bounds above (measured: top-1 98.4%, perplexity -0.1%, the same on every ISA path). x rounded to
    int8 per block of 32 (KVLAB_INT4_X=int8, llama.cpp's Q4 x Q8_0 numerics) is chaotic: a float32 rounding
    difference flips a code, which moves the next layer's inputs by a step, so each ISA path (summing in its
    own order) draws its own rounding noise. Over 256 positions the rates spread wide (16 draws, inputs
    perturbed by 1e-6: top-1 90.2-93.4%, perplexity +0.8 to +4.4%; the AVX2 path 89.5%), so this case
    decodes 1,024 positions: 8 draws top-1 91.6-93.2% (mean 92.6, sd 0.55), perplexity +0.3 to +1.7% (scalar,
    AVX2, AVX-512 paths: 92.7, 92.1, 93.3%); bounds >= 90% and the issue's 5% for int4, 4.7 and 7 sd away.
    SmolLM2's normalized inputs have outlier channels that coarsen their blocks' steps (wqkv and w1/w3 lose
    the most)."""
    if x_bits == 8:
        essay_ids, float_logits = request.getfixturevalue("long_essay")
    # read as each Linear is prepared
    monkeypatch.setenv("KVLAB_INT4_X", {32: "float32", 16: "int16", 8: "int8"}[x_bits])
    model = quantize_model(copy.deepcopy(smollm[0]), Quantization("int4", 32))
    assert all(module.x_bits == x_bits for module in model.modules() if isinstance(module, Int4Linear))
    name = "gated_int4_tiled" if x_bits == 16 else "gated_int4"  # int16 x reads the tiled layout
    calls, op = [], getattr(torch.ops.kvlab, name)
    monkeypatch.setattr(torch.ops.kvlab, name, lambda *a: calls.append(16 if x_bits == 16 else a[-1]) or op(*a))
    logits = decode_logits_of(model, essay_ids)
    assert calls == [x_bits] * (model.config.n_layer * len(essay_ids))
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean() >= top1
    assert abs(perplexity(logits, essay_ids) / perplexity(float_logits, essay_ids) - 1) < ppl


def test_int4_x_is_chosen_by_kvlab_int4_x(monkeypatch):
    """KVLAB_INT4_X picks how int4 products take x for the Linears built after it (int16 by default); a bad
    value is a one-line error."""
    assert Int4Linear(64, 16).x_bits == 16
    for choice, bits in [("float32", 32), ("int8", 8), ("int16", 16)]:
        monkeypatch.setenv("KVLAB_INT4_X", choice)
        assert Int4Linear(64, 16).x_bits == bits
    monkeypatch.setenv("KVLAB_INT4_X", "int4")
    with pytest.raises(ValueError, match="^KVLAB_INT4_X must be one of int16, float32, int8, got 'int4'$"):
        Int4Linear(64, 16)


@pytest.mark.parametrize("quant", [Quantization("int8"), Quantization("int4", 128)], ids=["int8", "int4-g128"])
def test_quantized_checkpoint_round_trips(smollm, smollm_dir, essay_ids, tmp_path, quant):
    """scripts/quantize.py's checkpoint loads back to the same integer tensors and the same logits as
    quantizing the float model in memory; the tokenizer and the tied int8 head come along (g=128 pads
    the 576 inputs to 640)."""
    out = quantize_checkpoint(smollm_dir, quant, tmp_path / "q")
    loaded, tokenizer, config = load_checkpoint(out)
    assert config["quantization"] == quant.to_dict() and tokenizer.encode("Paris") == smollm[1].encode("Paris")
    in_memory = quantize_model(copy.deepcopy(smollm[0]), quant)
    assert loaded.output.scales is loaded.tok_embeddings.scales
    state, expected = loaded.state_dict(), in_memory.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert torch.equal(logits_of(loaded, essay_ids[:32]), logits_of(in_memory, essay_ids[:32]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "quant",
    [Quantization("int8"), Quantization("int4", 32), Quantization("int4", 64)],
    ids=["int8", "int4-g32", "int4-g64"],
)
def test_fused_kernel_equals_dequantize_then_matmul(quant, dtype, monkeypatch):
    """torch's fused CPU kernel and the plain path give the same product (K=96 is padded to 128 for g=64).
    In bfloat16 (the CPU's fast path) the inputs, scales and product are rounded to 8-bit mantissas: the
    product (|y| up to 2.3 here) stays within 0.02 of the float32 path (measured 0.007); a wrong kernel
    layout would be off by whole units."""
    monkeypatch.setattr(kernels, "NATIVE", False)  # torch's kernels: kvlab's own are tests/test_kernels.py's
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True)
    x = torch.randn(2, 3, 96)
    plain, fused = quantize_linear(linear, quant), quantize_linear(linear, quant)
    fused.prepare(Kernel(dtype))
    if isinstance(fused, Int4Linear):
        assert fused.packed is not None and fused.weight is None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        y = fused(x)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, plain(x), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(plain(x), F.linear(x, plain.dequantize(), linear.bias))


@pytest.mark.parametrize("quant", [Quantization("int8"), Quantization("int4", 32)], ids=["int8", "int4"])
def test_inputs_over_the_kernels_row_limit_take_dequantize_then_matmul(quant, monkeypatch):
    """A kernel with max_rows takes inputs of up to that many rows (bfloat16 rounding shows it ran) and
    leaves larger ones to the float path, exactly; int4 keeps its plain codes for them."""
    monkeypatch.setattr(kernels, "NATIVE", False)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    plain, limited = quantize_linear(linear, quant), quantize_linear(linear, quant)
    limited.prepare(Kernel(torch.bfloat16, max_rows=4))
    small, large = torch.randn(1, 4, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        assert not torch.equal(limited(small), plain(small))
        torch.testing.assert_close(limited(small), plain(small), rtol=2e-2, atol=2e-2)
        assert torch.equal(limited(large), plain(large))


def test_int8_logits_on_the_cpu_kernel_stay_close_to_float32(smollm, float_logits, essay_ids):
    """What int8 decoding runs on the CPU: every matmul in torch's int8 kernel with bfloat16 inputs (no row
    limit here, so the 256-token prefill takes it too). Same bounds as the float path's test above; measured
    mean |logit change| 0.21, max 1.51, r 0.9991, perplexity +0.26% (+0.73% with the scales rounded to
    bfloat16 inside the kernel, which is why they are applied after it)."""
    model = quantize_model(copy.deepcopy(smollm[0]), Quantization("int8"))
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.prepare(Kernel(torch.bfloat16))
    logits = logits_of(model, essay_ids)
    diff = (logits - float_logits).abs()
    assert diff.mean() < 0.3 and diff.max() < 2.5
    assert torch.corrcoef(torch.stack([logits.flatten(), float_logits.flatten()]))[0, 1] >= 0.998
    assert abs(perplexity(logits, essay_ids) / perplexity(float_logits, essay_ids) - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["dequantize", "fused"])
@pytest.mark.parametrize("quant", [Quantization("int8"), Quantization("int4", 32)], ids=["int8", "int4"])
def test_compiled_step_equals_eager(tiny_model, quant, fused, monkeypatch):
    """A compiled decode step of the quantized tiny model gives eager's logits, on either of torch's kernel
    paths (kvlab's native one: tests/test_kernels.py). The dequantize path takes every matrix, the int8
    embedding and LM head included, off the fused kernels: the int8 one rounds x to bfloat16, so the last
    bit of float32 that Inductor's fused dequantization changes upstream can flip one rounding and move a
    logit by 5e-3 (measured), where float32 throughout keeps the two within 4e-6 (25 seeds)."""
    monkeypatch.setattr(kernels, "NATIVE", False)
    if not fused:
        for mode in {quant.mode, "int8"}:
            monkeypatch.delitem(FUSED, ("cpu", mode))
    model = quantize_model(copy.deepcopy(tiny_model), quant)
    assert all(
        (m.kernel is not None) == fused
        for m in model.modules()
        if isinstance(m, Int8Linear | Int4Linear) and m.mode == quant.mode and m.out_features % 16 == 0
    )
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 2, a.n_local_heads, 16, a.head_dim, torch.float32))
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 6)), torch.arange(6).expand(2, -1), prefill=True)
        token, pos = torch.randint(0, 64, (2, 1)), torch.full((2, 1), 6)
        eager = model(token, pos)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(token, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "int3"], "error: unknown quantization mode 'int3'; valid modes: int8, int4"),
        (["--mode", "int4", "--groupsize", "48"], "error: int4 group size must be one of 32, 64, 128, got 48"),
        (
            ["--mode", "int8", "--groupsize", "64"],
            "error: int8 is quantized per output channel and takes no group size; group sizes are for int4",
        ),
    ],
)
def test_bad_mode_or_groupsize_is_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quantize_main(argv)
    assert exit_info.value.code == 1 and str(exit_info.value) == message and capsys.readouterr().err == message + "\n"

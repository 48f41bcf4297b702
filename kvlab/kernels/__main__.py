"""`python -m kvlab.kernels`: which kernels run here, checked against torch on odd shapes; exit 1 on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.quantize import quantize_int8


def mismatch(op: str, got: Tensor, want: Tensor, terms: int, magnitude: float) -> list[str]:
    """A failure line where `got` is further from `want` than summation order explains."""
    error, bound = (got - want).abs().max().item(), kernels.reordering_atol(terms, magnitude)
    return [f"{op} {tuple(got.shape)} K={terms}: off by {error:.2e} > {bound:.2e}"] if error > bound else []


def check() -> list[str]:
    """Every native op against its torch reference; the failures, one line each."""
    failures = []
    g = torch.Generator().manual_seed(0)
    for rows, k, n in [(1, 576, 1536), (3, 577, 1001), (8, 64, 49), (2, 7, 5)]:
        x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        q, scales = quantize_int8(w)
        failures += mismatch("linear_fp32", torch.ops.kvlab.linear_fp32(x, w, b), F.linear(x, w, b), k, (x.abs() @ w.abs().T).max().item())
        codes_magnitude = (x.abs() @ q.float().abs().T).max().item() * scales.max().item()
        failures += mismatch("linear_int8", torch.ops.kvlab.linear_int8(x, q, scales, b), F.linear(x, q.float()) * scales + b, k, codes_magnitude)
    return failures


def main() -> int:
    if not kernels.load(quiet=True):
        print(f"torch: {kernels.REASON}")
        return 0
    failures = check()
    print(f"native {kernels.REASON}: " + ("every op matches torch" if not failures else "MISMATCH"))
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

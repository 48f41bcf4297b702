"""`python -m kvlab.kernels`: which kernels run here, checked against torch on odd shapes; exit 1 on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kvlab import kernels
from kvlab.quantize import quantize_int8


def check() -> list[str]:
    """Every native op against its torch reference; the failures, one line each."""
    failures = []
    g = torch.Generator().manual_seed(0)
    for rows, k, n in [(1, 576, 1536), (3, 577, 1001), (8, 64, 49), (2, 7, 5)]:
        x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        got, want = torch.ops.kvlab.linear_fp32(x, w, b), F.linear(x, w, b)
        bound = 16 * k**0.5 * 2**-24 * (x.abs() @ w.abs().T).max().item()  # summation order only: tests/tolerance.py
        if (got - want).abs().max().item() > bound:
            failures.append(f"linear_fp32 rows={rows} K={k} N={n}: off by {(got - want).abs().max().item():.2e} > {bound:.2e}")
        q, scales = quantize_int8(w)
        got, want = torch.ops.kvlab.linear_int8(x, q, scales, b), F.linear(x, q.float()) * scales + b
        bound = 16 * k**0.5 * 2**-24 * (x.abs() @ q.float().abs().T).max().item() * scales.max().item()
        if (got - want).abs().max().item() > bound:
            failures.append(f"linear_int8 rows={rows} K={k} N={n}: off by {(got - want).abs().max().item():.2e} > {bound:.2e}")
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

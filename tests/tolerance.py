"""Tolerances derived from the computation a test checks, not from one machine's result.

The machines that run this suite have AVX2 or AVX-512, and their fp32 kernels (torch's own, MKL's, oneDNN's)
sum in different orders; so do a matrix-vector and a matrix-matrix product, or a chunked and a whole
computation. Two such results of the same sum of n products differ by rounding alone. With unit roundoff u
(2^-24 in float32), each order's error is below lambda * sqrt(n) * u times the sum of the magnitudes of the
products, except with probability about 2 exp(-lambda^2 / 2) (the probabilistic bound of Higham and Mary,
SIAM J. Sci. Comput. 41(5), 2019); lambda = 8 makes that 3e-14. Two orders differ by at most twice that.
A result that feeds further sums (a layer's output, the next layer's input) carries the earlier rounding
with it: errors add over the chain of sums in sequence, which `chain` counts.

Every bound here is orders of magnitude below what the tests exist to catch (a wrong position, slot,
token, mask or scale moves values by whole percent or more), and each test that uses one says so.
"""

from __future__ import annotations

import torch

from kvlab.kernels import reordering_atol


def assert_reordered_close(
    actual: torch.Tensor, expected: torch.Tensor, terms: int, chain: int = 1, magnitude: float | None = None
) -> None:
    """`actual` equals `expected` up to summation order: |actual - expected| <= reordering_atol elementwise,
    with the magnitude taken as the largest |expected| unless given."""
    if magnitude is None:
        magnitude = expected.abs().max().item()
    atol = reordering_atol(terms, magnitude, chain, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)

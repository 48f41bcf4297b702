"""`python -m kvlab.kernels`: which kernels run here, checked against torch on odd shapes; exit 1 on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.attention import attention_mask, grouped_attention
from kvlab.quantize import GROUPSIZES, dequantize_int4, int4_codes, quantize_int4, quantize_int8


def mismatch(op: str, got: Tensor, want: Tensor, terms: int, magnitude: float, rounded: float = 0.0) -> list[str]:
    """A failure line where `got` is further from `want` than summation order explains, beyond `rounded` x |want|
    (an output rounded to bfloat16 once more: 2^-8, half its last place)."""
    error = ((got.float() - want).abs() - rounded * want.abs()).max().item()
    bound = kernels.reordering_atol(terms, magnitude)
    return [f"{op} {tuple(got.shape)} K={terms}: off by {error:.2e} > {bound:.2e}"] if error > bound else []


def int4_reference(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor) -> tuple[Tensor, float]:
    """x @ w^T for 4-bit weights dequantized in torch (x zero-padded to the codes' rows), and the magnitude
    of its sums: the codes' and the offsets' parts are summed apart in the kernel."""
    w = dequantize_int4(codes, scales, zeros)
    x = F.pad(x, (0, w.shape[1] - x.shape[-1]))
    parts = (
        int4_codes(codes).float().unflatten(-1, (scales.shape[1], -1)) * scales[..., None],
        (zeros - 8 * scales)[..., None].expand(-1, -1, w.shape[1] // scales.shape[1]),
    )
    return F.linear(x, w), sum((x.abs() @ part.flatten(1).abs().T).max().item() for part in parts)


def x_rounding_bound(x: Tensor, weights: Tensor, x_bits: int) -> Tensor:
    """How far a product with x rounded to `x_bits` (16 or 8) may be from the float one, per output, for the part of
    the weights [N, Kp] that multiplies the rounded x: each input is rounded to its block's step (max |x| /
    (2^(bits - 1) - 1) over 32 inputs), so off by at most half that step (and a few ulps), times |weight|."""
    x = F.pad(x, (0, weights.shape[1] - x.shape[-1]))
    qmax = 2 ** (x_bits - 1) - 1
    half_steps = (
        (x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / (2 * qmax) * (1 + 2.0**-20))
        .expand(*x.shape[:-1], -1, 32)
        .flatten(-2)
    )
    return half_steps @ weights.abs().T


def int4_rounding_bound(x: Tensor, codes: Tensor, scales: Tensor, x_bits: int) -> Tensor:
    """`x_rounding_bound` for an int4 weight: x rounded multiplies the codes' part of each weight, |scale x code|;
    the offsets' part takes x's exact sums."""
    weights = int4_codes(codes).float().unflatten(-1, (scales.shape[1], -1)) * scales[..., None]
    return x_rounding_bound(x, weights.flatten(1), x_bits)


def int8_rounding_bound(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """`x_rounding_bound` for an int8 weight and x in int16 (the tiled op's), its rows padded to whole blocks of 32."""
    return x_rounding_bound(x, F.pad(q.float() * scales[:, None], (0, -q.shape[1] % 32)), 16)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[Tensor, float]:
    """torch's decode attention, and the bound on a different order's rounding: each score (a sum of D
    products) off by d moves every softmax weight p by at most 2 d p, so the output by 2 d max|v|; the
    exponentials and the normalization add a few units of roundoff; the weighted sum of S values its own."""
    D, S = q.shape[-1], k.shape[2]
    score_error = kernels.reordering_atol(D, (q.abs().amax() * k.abs().amax() * D**0.5).item())
    v_max = v.abs().amax().item()
    return grouped_attention(q, k, v, attention_mask(key_pos, query_pos), False)[0], v_max * (
        2 * score_error + 8 * 2.0**-24
    ) + kernels.reordering_atol(S, v_max)


def prefill_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, key_pos: Tensor, query_pos: Tensor
) -> tuple[Tensor, Tensor, float, float]:
    """torch's masked attention for `attend_prefill` (a padding query, -1, sees every filled slot), each query's
    log-sum-exp of its scaled scores, and the bounds on a different order's rounding: the output's as
    `attention_reference` derives it; the log-sum-exp's one score's error and a few units of roundoff of it."""
    seeing = torch.where(query_pos >= 0, query_pos, torch.iinfo(query_pos.dtype).max)
    want, atol = attention_reference(q, k, v, key_pos, seeing)
    B, H, T, D = q.shape
    scores = (q.reshape(B, k.shape[1], -1, D) @ k.transpose(-1, -2) / D**0.5).reshape(
        B, k.shape[1], H // k.shape[1], T, -1
    )
    mask = attention_mask(key_pos, seeing).unsqueeze(2)
    lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1).reshape(B, H, T)
    score_error = kernels.reordering_atol(D, (q.abs().amax() * k.abs().amax() * D**0.5).item())
    return want, lse, atol, score_error + 8 * 2.0**-24 * lse.abs().nan_to_num(posinf=0, neginf=0).max().item()


def check_matvec(g: torch.Generator, rows: int, k: int, n: int) -> list[str]:
    """The float32, int8 and int4 products and gated projections on one shape."""
    x, w, b, up = (
        torch.randn(rows, k, generator=g),
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, k, generator=g),
    )
    q, scales = quantize_int8(w)
    magnitude = (x.abs() @ w.abs().T).max().item()
    failures = mismatch("linear_fp32", torch.ops.kvlab.linear_fp32(x, w, b), F.linear(x, w, b), k, magnitude)
    codes_magnitude = (x.abs() @ q.float().abs().T).max().item() * scales.max().item()
    failures += mismatch(
        "linear_int8",
        torch.ops.kvlab.linear_int8(x, q, scales, b),
        F.linear(x, q.float()) * scales + b,
        k,
        codes_magnitude,
    )
    # silu(a) b: |silu'| <= 1.1, so the errors of a and b (each within the bound for its own magnitude,
    # at most the larger one's) reach the product as at most 2.1 x that magnitude squared.
    gated_magnitude = 2.1 * max(magnitude, (x.abs() @ up.abs().T).max().item()) ** 2
    failures += mismatch(
        "gated_fp32", torch.ops.kvlab.gated_fp32(x, w, up), F.silu(F.linear(x, w)) * F.linear(x, up), k, gated_magnitude
    )
    q_up, s_up = quantize_int8(up)
    want = F.silu(F.linear(x, q.float()) * scales) * (F.linear(x, q_up.float()) * s_up)
    failures += mismatch("gated_int8", torch.ops.kvlab.gated_int8(x, q, scales, q_up, s_up), want, k, gated_magnitude)
    failures += check_int8_tiled(x, q, scales, q_up, s_up, b)
    for groupsize in GROUPSIZES:
        failures += check_int4(x, w, up, b, groupsize)
    return failures + check_bfloat16(x, w, b, up)


def check_int8_tiled(x: Tensor, q: Tensor, scales: Tensor, q_up: Tensor, s_up: Tensor, b: Tensor) -> list[str]:
    """The int8 products with x in int16 (a prefill's): within x's rounding (`int8_rounding_bound`) and summation
    order of the float products of the codes; silu(a) b moves as in `check_int4`."""
    want, want_up = F.linear(x, q.float()) * scales, F.linear(x, q_up.float()) * s_up
    magnitude = max(
        (x.abs() @ (q.float().abs() * scales[:, None]).T).max().item(),
        (x.abs() @ (q_up.float().abs() * s_up[:, None]).T).max().item(),
    )
    da, db = int8_rounding_bound(x, q, scales), int8_rounding_bound(x, q_up, s_up)
    atol, gated_atol = (
        kernels.reordering_atol(q.shape[1], magnitude),
        kernels.reordering_atol(q.shape[1], 2.1 * magnitude**2),
    )
    bounds = {
        "linear_int8_tiled": (torch.ops.kvlab.linear_int8_tiled(x, q, scales, b), want + b, da + atol),
        "gated_int8_tiled": (
            torch.ops.kvlab.gated_int8_tiled(x, q, scales, q_up, s_up),
            F.silu(want) * want_up,
            1.1 * da * want_up.abs() + F.silu(want).abs() * db + 1.1 * da * db + gated_atol,
        ),
    }
    return [
        f"{op} x int16 {tuple(got.shape)}: off by {((got - expected).abs() / bound).max().item():.2f} x its bound"
        for op, (got, expected, bound) in bounds.items()
        if ((got - expected).abs() > bound).any()
    ]


def check_bfloat16(x: Tensor, w: Tensor, b: Tensor, up: Tensor) -> list[str]:
    """The bfloat16 product and gated projection against torch's float32 ones on the same bfloat16 values:
    float32 sums in another order, then one rounding of the output to bfloat16."""
    x, w, b, up = (t.bfloat16() for t in (x, w, b, up))
    xf, wf, uf = x.float(), w.float(), up.float()
    magnitude, k = max((xf.abs() @ wf.abs().T).max().item(), (xf.abs() @ uf.abs().T).max().item()), x.shape[-1]
    failures = mismatch(
        "linear_bf16", torch.ops.kvlab.linear_bf16(x, w, b), F.linear(xf, wf, b.float()), k, magnitude, 2.0**-8
    )
    gated_want = F.silu(F.linear(xf, wf)) * F.linear(xf, uf)
    return failures + mismatch(
        "gated_bf16", torch.ops.kvlab.gated_bf16(x, w, up), gated_want, k, 2.1 * magnitude**2, 2.0**-8
    )


def same_as_float32_product(x: Tensor, gate: tuple, up: tuple, b: Tensor, groupsize: int) -> list[str]:
    """A prompt's rows with x in float32 dequantize the weight panel by panel: bit for bit the float32 ops' products
    with the dequantized weights (x zero-padded to whole groups, as the int4 ops pad it)."""
    weights = [dequantize_int4(*w).contiguous() for w in (gate, up)]
    padded = F.pad(x, (0, weights[0].shape[1] - x.shape[1]))
    operands = [(c, s, z - 8 * s) for c, s, z in (gate, up)]
    same = torch.equal(
        torch.ops.kvlab.linear_int4(x, *operands[0], groupsize, b, 32),
        torch.ops.kvlab.linear_fp32(padded, weights[0], b),
    ) and torch.equal(
        torch.ops.kvlab.gated_int4(x, *operands[0], *operands[1], groupsize, 32),
        torch.ops.kvlab.gated_fp32(padded, *weights),
    )
    return [] if same else [f"linear_int4 / gated_int4 g{groupsize} {tuple(x.shape)}: not the float32 product's bits"]


def check_int4(x: Tensor, w: Tensor, up: Tensor, b: Tensor, groupsize: int) -> list[str]:
    """The int4 product and gated projection, x in float32 (to summation order) and rounded to int16 and
    int8 (within `int4_rounding_bound`; silu(a) b moves by at most 1.1 |da| |b| + |silu(a)| |db| + 1.1 |da| |db|)."""
    (codes, scales, zeros), (c_up, s_up, z_up) = quantize_int4(w, groupsize), quantize_int4(up, groupsize)
    want, magnitude = int4_reference(x, codes, scales, zeros)
    want_up, magnitude_up = int4_reference(x, c_up, s_up, z_up)
    weights = (codes, scales, zeros - 8 * scales)
    gated = (*weights, c_up, s_up, z_up - 8 * s_up)
    terms, gated_magnitude = codes.shape[1] * 2, 2.1 * max(magnitude, magnitude_up) ** 2
    failures = mismatch(
        f"linear_int4 g{groupsize}",
        torch.ops.kvlab.linear_int4(x, *weights, groupsize, b, 32),
        want + b,
        terms,
        magnitude,
    )
    if x.shape[0] > kernels.MAX_ROWS and torch.ops.kvlab.isa() != "scalar":  # a prompt's rows: the panel product
        failures += same_as_float32_product(x, (codes, scales, zeros), (c_up, s_up, z_up), b, groupsize)
    gated_want = F.silu(want) * want_up
    failures += mismatch(
        f"gated_int4 g{groupsize}",
        torch.ops.kvlab.gated_int4(x, *gated, groupsize, 32),
        gated_want,
        terms,
        gated_magnitude,
    )
    for x_bits in (16, 8):
        da, db = int4_rounding_bound(x, codes, scales, x_bits), int4_rounding_bound(x, c_up, s_up, x_bits)
        bounds = {
            "linear_int4": (
                torch.ops.kvlab.linear_int4(x, *weights, groupsize, b, x_bits),
                want + b,
                da + kernels.reordering_atol(terms, magnitude),
            ),
            "gated_int4": (
                torch.ops.kvlab.gated_int4(x, *gated, groupsize, x_bits),
                gated_want,
                1.1 * da * want_up.abs()
                + F.silu(want).abs() * db
                + 1.1 * da * db
                + kernels.reordering_atol(terms, gated_magnitude),
            ),
        }
        if x_bits == 16:  # the tiled layout's ops take x in int16 only
            n = codes.shape[0]
            tiled = [
                (torch.ops.kvlab.int4_tile(c), kernels.tile_rows(s), kernels.tile_rows(o))
                for c, s, o in (weights, gated[3:])
            ]
            bounds["linear_int4_tiled"] = (
                torch.ops.kvlab.linear_int4_tiled(x, *tiled[0], n, groupsize, b),
                *bounds["linear_int4"][1:],
            )
            bounds["gated_int4_tiled"] = (
                torch.ops.kvlab.gated_int4_tiled(x, *tiled[0], *tiled[1], n, groupsize),
                *bounds["gated_int4"][1:],
            )
        failures += out_of_bounds(bounds, f"g{groupsize} x int{x_bits}")
    return failures


def out_of_bounds(bounds: dict[str, tuple[Tensor, Tensor, Tensor]], label: str) -> list[str]:
    """One line for each op (name -> (got, expected, elementwise bound)) off by more than its bound somewhere."""
    return [
        f"{op} {label} {tuple(got.shape)}: off by {((got - expected).abs() / bound).max().item():.2f} x its bound"
        for op, (got, expected, bound) in bounds.items()
        if ((got - expected).abs() > bound).any()
    ]


def check_attention(
    g: torch.Generator,
    batch: int,
    heads: int,
    kv_heads: int,
    steps: int,
    slots: int,
    dim: int,
    per_head: bool,
    kv_dtype: torch.dtype,
) -> list[str]:
    """Decode attention over `slots` slots, some empty (-1), positions shared or per KV head, keys and values
    float32, float16 or bfloat16 (against torch over them widened to float32, exactly)."""
    q, (k, v) = (
        torch.randn(batch, heads, steps, dim, generator=g),
        torch.randn(2, batch, kv_heads, slots, dim, generator=g).to(kv_dtype),
    )
    key_pos = torch.randint(-1, slots, (batch, kv_heads, slots) if per_head else (batch, slots), generator=g)
    query_pos = torch.arange(slots - steps, slots).expand(batch, steps)
    want, atol = attention_reference(q, k.float(), v.float(), key_pos, query_pos)
    error = (torch.ops.kvlab.attend_fp32(q, k, v, key_pos, query_pos) - want).abs().max().item()
    return (
        [f"attend_fp32 {tuple(q.shape)} over {slots} {kv_dtype} slots: off by {error:.2e} > {atol:.2e}"]
        if error > atol
        else []
    )


def check_prefill_attention(
    g: torch.Generator, batch: int, heads: int, kv_heads: int, steps: int, held: int, dim: int, kv_dtype: torch.dtype
) -> list[str]:
    """Prefill attention: `steps` queries (the last one padding) over `held` earlier slots, some empty, and their
    own."""
    q, (k, v) = (
        torch.randn(batch, heads, steps, dim, generator=g),
        torch.randn(2, batch, kv_heads, held + steps, dim, generator=g).to(kv_dtype),
    )
    query_pos = torch.arange(held, held + steps).repeat(batch, 1)
    query_pos[:, -1] = -1
    key_pos = torch.cat([torch.randint(-1, held, (batch, held), generator=g), query_pos], dim=1)
    want, want_lse, atol, lse_atol = prefill_attention_reference(q, k.float(), v.float(), key_pos, query_pos)
    y, lse = torch.ops.kvlab.attend_prefill(q, k, v, key_pos, query_pos)
    error, lse_error = (y - want).abs().max().item(), (lse - want_lse).abs().max().item()
    if error > atol or lse_error > lse_atol:
        return [
            f"attend_prefill {tuple(q.shape)} over {held} + {steps} {kv_dtype} slots: off by {error:.2e} > "
            f"{atol:.2e} or {lse_error:.2e} > {lse_atol:.2e}"
        ]
    return []


def paged_view(k: Tensor, v: Tensor, pos: Tensor, table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The dense view of each (row, KV head)'s blocks of a pool (k, v [blocks, block, D], pos [blocks, block]) that
    `table` [R, H_kv, W] lists: keys and values in float32 [R, H_kv, W x block, D], positions (an absent block's -1)."""
    R, H, _ = table.shape
    ids = table.clamp(min=0).flatten()
    keys, values = (x.index_select(0, ids).view(R, H, -1, k.shape[-1]).float() for x in (k, v))
    return keys, values, torch.where(table[..., None] < 0, -1, pos[table.clamp(min=0)]).view(R, H, -1)


def check_paged_attention(
    g: torch.Generator, rows: int, heads: int, kv_heads: int, dim: int, block: int, width: int, kv_dtype: torch.dtype
) -> list[str]:
    """Decode attention over a paged pool: each (row, KV head) reads `width` blocks (some absent) of `block` slots
    (some empty) through its block table; the output, and KV-Compress's metric (the probabilities' squares summed
    over the query group, within twice the probabilities' bound), against torch over the gathered view."""
    n_blocks = rows * kv_heads * width + 1
    k, v = (torch.randn(n_blocks, block, dim, generator=g).to(kv_dtype) for _ in range(2))
    pos = torch.randint(-1, 60, (n_blocks, block), generator=g)
    table = (torch.randperm(n_blocks - 1, generator=g)[: n_blocks - 1] + 1).view(rows, kv_heads, width)
    table[torch.rand(table.shape, generator=g) < 0.2] = -1
    q, query_pos = torch.randn(rows, heads, 1, dim, generator=g), torch.randint(30, 60, (rows, 1), generator=g)
    keys, values, key_pos = paged_view(k, v, pos, table)
    want, atol = attention_reference(q, keys, values, key_pos, query_pos)
    probs = grouped_attention(q, keys, values, attention_mask(key_pos, query_pos), True)[1].nan_to_num(0.0)
    metric_atol = 2 * atol / max(values.abs().max().item(), 1.0) * (heads // kv_heads)
    y, metric = torch.ops.kvlab.attend_paged(q, k, v, pos, table, query_pos, 2)
    errors = (
        (y - want.nan_to_num(0.0)).abs().max().item(),
        (metric - probs.square().sum(dim=(2, 3))).abs().max().item(),
    )
    if errors[0] <= atol and errors[1] <= metric_atol:
        return []
    return [f"attend_paged {tuple(q.shape)} over {width} blocks of {block}: off by {errors[0]:.2e} / {errors[1]:.2e}"]


def check() -> list[str]:
    """Every native op against its torch reference; the failures, one line each."""
    g = torch.Generator().manual_seed(0)
    failures = []
    for rows, k, n in [(1, 576, 1536), (3, 577, 1001), (8, 64, 49), (2, 7, 5), (100, 70, 37), (16, 576, 96)]:
        failures += check_matvec(g, rows, k, n)
    for shape in [
        (1, 9, 3, 1, 600, 64, False, torch.float32),
        (2, 4, 2, 3, 70, 64, True, torch.float16),
        (1, 8, 8, 5, 37, 40, False, torch.float16),
        (1, 9, 3, 1, 300, 64, True, torch.bfloat16),
    ]:
        failures += check_attention(g, *shape)
    for shape in [
        (1, 9, 3, 100, 70, 64, torch.float32),
        (2, 4, 2, 33, 0, 64, torch.float16),
        (1, 4, 4, 9, 20, 40, torch.bfloat16),
        (1, 2, 1, 40, 30, 32, torch.float32),
    ]:
        failures += check_prefill_attention(g, *shape)
    for shape in [
        (3, 9, 3, 64, 16, 5, torch.float16),
        (2, 4, 2, 40, 4, 70, torch.float32),
        (1, 8, 8, 64, 8, 3, torch.bfloat16),
    ]:
        failures += check_paged_attention(g, *shape)
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

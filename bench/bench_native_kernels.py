"""kvlab's native CPU kernels (kvlab/kernels) against torch's, in one run.

    python bench/bench_native_kernels.py                        # 512 and 2048-token prompts
    python bench/bench_native_kernels.py --prompt_lengths 512 --repeats 5

Two parts:
1. the matrix-vector products of one decode step (batch 1), each weight shape of the default model: ms per
   product and the GB/s of weights read, native (row-major) against torch's F.linear on the layout
   `lay_out_for_matvec` gives it without native kernels (column-major for the wide ones), beside the
   machine's read bandwidth (summing a 1 GiB tensor), all measured here;
2. compiled decode tokens/s of the whole model, float32, int8 and int4 (g32) weights, every native op
   (matrix-vector products, the gated projection, attention) against torch's kernels, and whether they
   decode the same greedy tokens (int8 and int4: torch's kernels round their inputs to bfloat16, so they
   may part).

Writes bench/results/native_kernels_cpu.md and .json: {"decode_<fp32|int8|int4>_<n>": {"native": tok/s, "torch":
tok/s, "ratio": native/torch}, "matvec": {...}, "bandwidth_gbs", "isa", "cpu", "threads", "load"}.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform

import torch
import torch.nn.functional as F

from common import (
    QUANTIZATIONS,
    after_warmup,
    bench_parser,
    load_bench,
    machine,
    median_decode_rate,
    parse_bench_args,
    read_bandwidth,
    row,
    seconds_per_call,
    table,
    write_results,
)
from kvlab import kernels
from kvlab.engine import compile_decode_step, generate
from kvlab.model import lay_out_for_matvec
from kvlab.quantized_model import quantize_model


def matvec_rows(model) -> list[tuple[str, int, float, float]]:
    """(name, bytes per pass, native ms, torch ms) for each distinct Linear shape, batch 1: one product per
    layer's copy of the weight (as a decode step runs them, so each is read from memory, not from cache)."""
    shapes = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), name)
    out = []
    with torch.no_grad():
        for (n, k), name in shapes.items():
            copies = 1 if name == "output" else model.config.n_layer
            weights, x = [torch.randn(n, k) for _ in range(copies)], torch.randn(1, 1, k)
            column_major = [w.t().contiguous().t() if n > k else w for w in weights]
            native = seconds_per_call(
                lambda x=x, weights=weights: [torch.ops.kvlab.linear_fp32(x, w, None) for w in weights], 10
            )
            stock = seconds_per_call(lambda x=x, column_major=column_major: [F.linear(x, w) for w in column_major], 10)
            out.append(
                (f"{name.split('.')[-1]} [{n}, {k}] x {copies}", copies * weights[0].nbytes, native * 1e3, stock * 1e3)
            )
    return out


def decode_rates(bench, model, lengths: list[int], new_tokens: int, repeats: int) -> dict[int, tuple[float, list[int]]]:
    """Compiled decode tok/s and the tokens, per prompt length, on the kernels kernels.NATIVE picks now."""
    lay_out_for_matvec(model)
    torch._dynamo.reset()
    step = compile_decode_step(bench.device)
    rates = {}
    for n in lengths:
        runs = after_warmup(lambda n=n: generate(model, [bench.ids[:n]], new_tokens, decode_step=step), repeats)
        rates[n] = (median_decode_rate(runs), runs[0].tokens[0])
    return rates


def native_against_torch(bench, weights: str, args) -> dict[int, tuple[float, float, bool]]:
    """Per prompt length: (native tok/s, torch tok/s, same greedy tokens), the model quantized (`weights`
    int8 or int4) under each path, as loading it there would (int4 keeps its codes for the native kernel,
    torch's kernel repacks them)."""

    def model():
        return bench.model if weights == "fp32" else quantize_model(copy.deepcopy(bench.model), QUANTIZATIONS[weights])

    native = decode_rates(bench, model(), args.prompt_lengths, args.new_tokens, args.repeats)
    kernels.NATIVE = False
    stock = decode_rates(bench, model(), args.prompt_lengths, args.new_tokens, args.repeats)
    kernels.NATIVE = True
    return {n: (native[n][0], stock[n][0], native[n][1] == stock[n][1]) for n in args.prompt_lengths}


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument(
        "--prompt_lengths",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prompt lengths in tokens (default: 512 2048)",
    )
    p.add_argument("--new_tokens", type=int, default=64, help="tokens decoded per run (default: 64)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement; the median is reported (default: 3)"
    )
    return parse_bench_args(p, "native_kernels")


def record(decode: dict, matvecs: list[tuple], bandwidth: float) -> dict:
    """The JSON record: decode tok/s per weights and prompt length, each product's times, and the machine."""
    results = {
        f"decode_{w}_{n}": {"native": nat, "torch": st, "ratio": nat / st}
        for w, rates in decode.items()
        for n, (nat, st, _) in rates.items()
    }
    results["matvec"] = {name: {"bytes": b, "native_ms": nm, "torch_ms": tm} for name, b, nm, tm in matvecs}
    return results | {
        "bandwidth_gbs": bandwidth,
        "isa": kernels.REASON,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load": os.getloadavg(),
    }


def main() -> None:
    args = parse_args()
    if not kernels.load():
        raise SystemExit(f"error: the native kernels do not run here ({kernels.REASON})")
    bench = load_bench("cpu", "float32")
    bandwidth = read_bandwidth()
    matvecs = matvec_rows(bench.model)
    decode = {weights: native_against_torch(bench, weights, args) for weights in ("fp32", "int8", "int4")}
    results = record(decode, matvecs, bandwidth)
    lines = [
        f"# Native CPU kernels against torch's: {bench.config['name']}, float32 ({machine(bench.device)})",
        "",
        f"torch {torch.__version__}; native path: {kernels.REASON}; batch 1; read bandwidth (1 GiB sum): "
        f"{bandwidth:.1f} GB/s.",
        "",
        "## One decode step's matrix-vector products (batch 1)",
        "",
        *table(
            "weights | MB per pass | native ms | native GB/s | torch ms | torch GB/s | native / torch speed",
            (
                row(
                    name,
                    f"{b / 1e6:.1f}",
                    f"{nm:.3f}",
                    f"{b / nm / 1e6:.1f}",
                    f"{tm:.3f}",
                    f"{b / tm / 1e6:.1f}",
                    f"{tm / nm:.2f}x",
                )
                for name, b, nm, tm in matvecs
            ),
            align="---:",
        ),
        f"## Compiled decode, {args.new_tokens} new tokens, median of {args.repeats} runs after a warm-up",
        "",
        "torch's kernels: F.linear (MKL) on the float32 weights, column-major where wide; for int8 and int4 torch's",
        "`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` on bfloat16 inputs (kvlab.quantize.FUSED); attention:",
        "scaled_dot_product_attention under the positions' mask.",
        "",
        *table(
            "weights | prompt tokens | native tok/s | torch tok/s | native / torch | same greedy tokens",
            (
                row(w, n, f"{nat:.1f}", f"{st:.1f}", f"{nat / st:.2f}x", "yes" if same else "no")
                for w, rates in decode.items()
                for n, (nat, st, same) in rates.items()
            ),
            align="---:",
        ),
    ]
    write_results(lines, args.out, "native_kernels", bench.device, results=results)


if __name__ == "__main__":
    main()

"""Throughput of the default model: prefill and decode tokens/s, eager vs `--compile`, and against
Hugging Face transformers' `generate` on the same weights (its own GGUF loader) and the same prompt.

    python bench/bench_generate.py                      # CPU, float32
    python bench/bench_generate.py --device cuda        # bfloat16, CUDA graphs
    python bench/bench_generate.py --weights int8       # the quantized table for int8 only

Then the same decode with weight-only int8 / int4 weights (`kvlab.quantize`, quantized in memory as
`scripts/quantize.py` would write them), eager and compiled, against the same HF run.

Writes bench/results/generate_<device>.md. All numbers of one table come from one run, so quote the
ratios (compiled / eager, kvlab / HF), not lone times.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch

from common import (
    QUANTIZATIONS,
    after_warmup,
    bench_parser,
    load_bench,
    machine,
    median_decode_rate,
    parse_bench_args,
    row,
    table,
    time_hf,
    write_results,
)
from kvlab.convert import default_gguf_path
from kvlab.engine import compile_decode_step, decode_one_token, generate
from kvlab.quantize import FUSED
from kvlab.quantized_model import quantize_model, weight_bytes


def time_kvlab(model, prompt: list[int], new_tokens: int, decode_step, repeats: int) -> tuple[float, float]:
    """Median prefill and decode tokens/s over `repeats` runs after one warm-up run (which compiles)."""
    runs = after_warmup(lambda: generate(model, [prompt], new_tokens, decode_step=decode_step), repeats)
    prefill = statistics.median(len(prompt) / r.prefill_seconds for r in runs)
    return prefill, median_decode_rate(runs)


def kernel_path(device: torch.device, mode: str) -> str:
    kernel = FUSED.get((device.type, mode))
    return (
        "dequantize-then-matmul"
        if kernel is None
        else f"torch's fused kernel in {str(kernel.dtype).removeprefix('torch.')}"
    )


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument(
        "--prompt_lengths",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prompt lengths in tokens (default: 512 2048)",
    )
    p.add_argument(
        "--new_tokens", type=int, default=None, help="tokens decoded per run (default: 64 on CPU, 256 on CUDA)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement; the median is reported (default: 3)"
    )
    p.add_argument("--no_hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument(
        "--weights",
        nargs="*",
        default=list(QUANTIZATIONS),
        choices=list(QUANTIZATIONS),
        help="weight-only quantizations to time too (default: int8 int4; none: skip)",
    )
    return parse_bench_args(p, "generate")


def load_hf(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """HF transformers' model from the same GGUF (its own loader)."""
    import transformers

    gguf = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.to(device, dtype).eval()


def time_float(bench, hf_model, new_tokens: int, args) -> list[tuple]:
    """Per prompt length: (tokens, prefill tok/s, HF prefill, eager decode, compiled decode, HF decode, seconds of
    the compiled runs with their compilation); HF's are NaN without HF."""
    compiled_step = compile_decode_step(bench.device)
    rows = []
    for n in args.prompt_lengths:
        prompt = bench.ids[:n]
        eager_prefill, eager_decode = time_kvlab(bench.model, prompt, new_tokens, decode_one_token, args.repeats)
        t0 = time.perf_counter()
        _, compiled_decode = time_kvlab(bench.model, prompt, new_tokens, compiled_step, args.repeats)
        compile_run_seconds = time.perf_counter() - t0
        hf_prefill, hf_decode = (
            time_hf(hf_model, prompt, new_tokens, args.repeats)[:2] if hf_model is not None else (math.nan, math.nan)
        )
        rows.append((n, eager_prefill, hf_prefill, eager_decode, compiled_decode, hf_decode, compile_run_seconds))
        print(
            f"prompt {n}: prefill {eager_prefill:.0f} tok/s (HF {hf_prefill:.0f}); decode eager "
            f"{eager_decode:.1f}, compiled {compiled_decode:.1f}, HF {hf_decode:.1f} tok/s",
            flush=True,
        )
    return rows


def time_quantized(bench, rows: list[tuple], new_tokens: int, args) -> list[tuple]:
    """Per quantization and prompt length: (tokens, name, weight bytes, eager decode, compiled decode, the float
    model's compiled decode, HF decode)."""
    quantized_rows = []
    for name in args.weights:
        torch._dynamo.reset()  # a fresh compile for each model
        model = quantize_model(copy.deepcopy(bench.model), QUANTIZATIONS[name])
        step = compile_decode_step(bench.device)
        for n, *_, compiled_float, hf_decode, _ in rows:
            _, eager_decode = time_kvlab(model, bench.ids[:n], new_tokens, decode_one_token, args.repeats)
            _, compiled_decode = time_kvlab(model, bench.ids[:n], new_tokens, step, args.repeats)
            quantized_rows.append(
                (n, name, weight_bytes(model), eager_decode, compiled_decode, compiled_float, hf_decode)
            )
            print(
                f"{name}, prompt {n}: decode eager {eager_decode:.1f}, compiled {compiled_decode:.1f} tok/s", flush=True
            )
        del model
    return quantized_rows


def float_lines(bench, rows: list[tuple], new_tokens: int, repeats: int, hf_version: str | None) -> list[str]:
    """The report's header and float table."""
    return [
        f"# Generation throughput: {bench.config['name']} on {bench.device.type} ({machine(bench.device)}), "
        f"{bench.dtype_name}",
        "",
        f"torch {torch.__version__}; batch 1; greedy; {new_tokens} new tokens per run; median of {repeats} "
        "runs after a warm-up run.",
        "Decode tokens/s exclude the first decode step (it compiles under `--compile`). HF: `transformers` "
        + (f"{hf_version} " if hf_version else "")
        + "`generate` (dynamic cache, eager) on the same GGUF weights.",
        "",
        *table(
            "prompt tokens | prefill tok/s (kvlab) | prefill tok/s (HF) | decode tok/s eager | decode tok/s "
            "compiled | decode tok/s HF | compiled / eager | compiled / HF | eager / HF",
            (
                row(
                    n,
                    f"{ep:.0f}",
                    f"{hp:.0f}",
                    f"{ed:.1f}",
                    f"{cd:.1f}",
                    f"{hd:.1f}",
                    f"{cd / ed:.2f}x",
                    f"{cd / hd:.2f}x",
                    f"{ed / hd:.2f}x",
                )
                for n, ep, hp, ed, cd, hd, _ in rows
            ),
            align="---:",
        ),
        "Warm-up + timed compiled runs (includes compilation): "
        + ", ".join(f"{n} tokens: {s:.0f} s" for n, *_, s in rows),
        "",
    ]


def quantized_lines(bench, quantized_rows: list[tuple], names: list[str]) -> list[str]:
    """The weight-only quantization table, or nothing where none was timed."""
    if not quantized_rows:
        return []
    kernels = ", ".join(f"{name} {kernel_path(bench.device, QUANTIZATIONS[name].mode)}" for name in names)
    return [
        "## Weight-only quantization (same run)",
        "",
        "Decode with int8 (per channel) and int4 (g=32) weights, the tied embedding / LM head int8 in "
        f"both; kernels: {kernels}.",
        f"`/ HF`: against HF's {bench.dtype_name} decode above.",
        "",
        *table(
            "prompt tokens | weights | weight MB | decode tok/s eager | decode tok/s compiled | compiled / "
            "HF | compiled / compiled float",
            (
                row(n, name, f"{mb / 1e6:.0f}", f"{ed:.1f}", f"{cd:.1f}", f"{cd / hd:.2f}x", f"{cd / cf:.2f}x")
                for n, name, mb, ed, cd, cf, hd in quantized_rows
            ),
            align="---:",
        ),
    ]


def main() -> None:
    args = parse_args()
    bench = load_bench(args.device, args.dtype)
    new_tokens = args.new_tokens or (256 if bench.device.type == "cuda" else 64)
    hf_model = None if args.no_hf else load_hf(bench.device, bench.dtype)
    rows = time_float(bench, hf_model, new_tokens, args)
    quantized_rows = time_quantized(bench, rows, new_tokens, args)
    hf_version = None if hf_model is None else __import__("transformers").__version__
    lines = float_lines(bench, rows, new_tokens, args.repeats, hf_version) + quantized_lines(
        bench, quantized_rows, args.weights
    )
    write_results(lines, args.out, "generate", bench.device, show=False)


if __name__ == "__main__":
    main()

"""Weight-only quantization of the default model (kvlab/quantize.py): quality, bytes, and the matmul kernels.

    python bench/bench_weights.py              # quality and bytes: float32, int8, int4 (g=32/64/128), Q4_1 kept
    python bench/bench_weights.py --kernels    # also time each fused kernel against dequantize-then-matmul

Writes bench/results/weights_cpu.md. Quality: perplexity of the first 1,024 tokens of RULER's essays
(20.70 in float32), top-1 agreement with float32 on those 1,023 next tokens (teacher-forced), and a
64-token greedy continuation of the first 256 tokens compared with float32's. Each quantized model is
built from the float32 one as `scripts/quantize.py` would write it; the last row loads the GGUF's own Q4_1
blocks (`scripts/quantize.py --mode gguf`: the float32 weights, x in float32).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F

from common import bench_parser, load_bench, machine, parse_bench_args, report, row, table, write_results
from kvlab import quantized_model
from kvlab.build import make_caches
from kvlab.checkpoint import load_checkpoint
from kvlab.convert import blocks_checkpoint
from kvlab.engine import generate
from kvlab.model import Transformer
from kvlab.quantize import FUSED, Int8Linear, Kernel, Quantization
from kvlab.quantized_model import quantize_linear, quantize_model, weight_bytes

SETTINGS = [None, Quantization("int8"), Quantization("int4", 32), Quantization("int4", 64), Quantization("int4", 128)]


def name(quant: Quantization | None) -> str:
    return "float32" if quant is None else quant.mode if quant.mode == "int8" else f"int4 g={quant.groupsize}"


def prompt_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    a = model.config
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, len(ids), a.head_dim, torch.float32))
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], prefill=True)[0]


def on_kernel(model: Transformer, kernel: Kernel | None) -> Transformer:
    """The int8 matmuls all on `kernel` (None: dequantize-then-matmul), whatever their rows: FUSED's
    row limit sends a 1,024-token prefill to the float path, which is not what decoding runs."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.prepare(kernel)
    return model


def variants() -> list[tuple[str, Quantization | None, Kernel | None]]:
    """(label, quantization, the int8 matmuls' kernel in the teacher-forced pass). int8's CPU kernel takes
    at most 32 rows (FUSED), so its prefills run the float path and its decode steps the kernel: each
    gets a row."""
    kernel = FUSED.get(("cpu", "int8"))
    if kernel is None:
        return [("float32", None, None)] + [(name(q), q, None) for q in SETTINGS[1:]]
    decode = replace(kernel, max_rows=None)
    int8 = [
        ("int8, decode path (kernel, bfloat16 inputs)", SETTINGS[1], decode),
        ("int8, prefill path (float32)", SETTINGS[1], None),
    ]
    return [("float32", None, None), *int8] + [(name(q), q, decode) for q in SETTINGS[2:]]


def models(fp32: Transformer) -> Iterator[tuple[str, Transformer, Callable[[], None]]]:
    """(label, model, what to do before `generate` runs it) for each variant, one at a time; last, the GGUF's Q4_1
    blocks kept (`scripts/quantize.py --mode gguf`), loaded as generate.py loads it."""
    for label, quant, int8_kernel in variants():
        if quant is None:
            yield label, fp32, lambda: None
            continue
        model = on_kernel(quantize_model(copy.deepcopy(fp32), quant), int8_kernel)
        yield label, model, lambda m=model: quantized_model.prepare(m)  # generate runs with FUSED's choices
    blocks = load_checkpoint(blocks_checkpoint(), torch.device("cpu"), torch.float32)[0]
    yield "Q4_1 blocks kept (x in float32; --mode gguf)", blocks, lambda: None


def quality(fp32: Transformer, ids: list[int]) -> list[str]:
    """Perplexity and top-1 teacher-forced with the matmuls on each variant's path; greedy: `generate` as
    it runs (FUSED's choices)."""
    rows: list[str] = []
    reference = greedy = None
    for label, model, before_generate in models(fp32):
        logits = prompt_logits(model, ids[:1024])
        ppl = F.cross_entropy(logits[:-1], torch.tensor(ids[1:1024])).exp().item()
        before_generate()
        tokens = generate(model, [ids[:256]], 64).tokens[0]
        if reference is None:
            reference, greedy = logits[:-1].argmax(-1), tokens
        top1 = (logits[:-1].argmax(-1) == reference).float().mean().item()
        same = sum(a == b for a, b in zip(tokens, greedy, strict=True))
        prefix = next((i for i, (a, b) in enumerate(zip(tokens, greedy, strict=True)) if a != b), len(greedy))
        report(
            rows,
            row(label, f"{weight_bytes(model) / 1e6:.1f}", f"{ppl:.2f}", f"{100 * top1:.1f}%", f"{same}/64", prefix),
        )
    return rows


def median_us(fn, repeats: int = 7, calls: int = 10) -> float:
    """Median over `repeats` of the mean time of `calls` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def kernels(fp32: Transformer) -> list[str]:
    """Each of the model's matrix shapes at decode (one token): float32, then each mode fused and dequantized.
    One thread: on a shared machine, two threads wait on each other and time the scheduler instead."""
    torch.set_num_threads(1)
    layer = fp32.layers[0]
    linears = {
        "wqkv": layer.attention.wqkv,
        "wo": layer.attention.wo,
        "w1 (w3)": layer.feed_forward.w1,
        "w2": layer.feed_forward.w2,
        "output": fp32.output,
    }
    rows: list[str] = []
    for label, linear in linears.items():
        x = torch.randn(1, linear.in_features)
        with torch.no_grad():
            cells = [f"{label} {tuple(linear.weight.shape)}", f"{median_us(lambda: linear(x)):.0f}"]  # noqa: B023
        for quant in SETTINGS[1:3] + SETTINGS[4:]:
            for fused in (True, False):
                q = quantize_linear(linear, quant)
                q.prepare(FUSED.get(("cpu", quant.mode)) if fused else None)
                with torch.no_grad():
                    cells.append(f"{median_us(lambda: q(x)):.0f}")  # noqa: B023
        report(rows, row(*cells))
    return rows


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--kernels", action="store_true", help="also time the matmul kernels (needs a quiet machine)")
    args = parse_bench_args(p, "weights")
    b = load_bench("cpu", "float32")
    lines = [
        f"# Weight-only quantization, {b.config['name']} on {machine(b.device)}",
        "",
        "Perplexity: first 1,024 tokens of RULER's essays. top-1: next-token argmax equal to float32's "
        "(teacher-forced,",
        "1,023 positions). greedy: a 64-token continuation of the first 256 tokens: tokens equal to float32's "
        "at the same",
        "position, and how many before the first difference. Weights: every parameter and buffer but the RoPE tables.",
        "",
        *table(
            "weights | weight MB | perplexity | top-1 vs float32 | greedy same | greedy prefix", quality(b.model, b.ids)
        ),
    ]
    if args.kernels:
        lines += [
            "Decode matmuls (one token, one thread, eager, microseconds, median of 7): torch's fused kernel "
            "against dequantize-then-matmul.",
            "Paths in use on the CPU (kvlab.quantize.FUSED): "
            + ", ".join(f"{m} {'fused' if ('cpu', m) in FUSED else 'dequantize'}" for m in ("int8", "int4"))
            + ".",
            "",
            *table(
                "matrix | float32 | int8 fused | int8 dequant | int4 g=32 fused | int4 g=32 dequant | int4 "
                "g=128 fused | int4 g=128 dequant",
                kernels(b.model),
            ),
        ]
    write_results(lines, args.out, "weights", b.device)


if __name__ == "__main__":
    main()

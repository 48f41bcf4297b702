"""Where a decode step's time goes, and which Inductor settings cut it.

    python bench/bench_decode_profile.py                  # CPU, float32, 512-token prompt
    python bench/bench_decode_profile.py --prompt_length 2048
    python bench/bench_decode_profile.py --weights int8 --settings default   # bench/results/decode_profile_int8_cpu.md
    # with kvlab's native kernels:
    python bench/bench_decode_profile.py --settings default --out bench/results/decode_profile_native_cpu.md

Three parts, all from one run:
1. the floor: seconds to stream the model's weights once (a batch-1 pass over every Linear and the LM
   head, eager: what no decode step can beat) and the machine's read bandwidth (summing a 1 GiB tensor);
2. decode tokens/s with the weights row-major (as stored before `lay_out_for_matvec`) and as loaded,
   eager and compiled, then compiled under each Inductor setting (`compile_decode_step(device, inductor=...)`),
   each in a fresh compile (torch._dynamo.reset()), with its ratio to the default compile;
3. a torch.profiler breakdown of the default compiled step: time in matmuls (the weights), in fused
   Inductor kernels (norms, RoPE, softmax, cache writes), in attention, and the rest (Python and
   framework overhead between kernels).

Writes bench/results/decode_profile_<device>.md.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from common import (
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
from kvlab.engine import compile_decode_step, decode_one_token, generate
from kvlab.model import lay_out_for_matvec
from kvlab.quantize import Int4Linear, Int8Embedding, Int8Linear

SETTINGS = {  # None: kvlab's own (compiled_step_options); the others are stock Inductor with these set
    "default": None,
    "python wrapper": {},
    "freezing": {"freezing": True},
    "cpp_wrapper": {"cpp_wrapper": True},
    "cpp_wrapper, entry built apart": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True},
    "coordinate_descent_tuning": {"coordinate_descent_tuning": True},
    "freezing + cpp_wrapper": {"freezing": True, "cpp_wrapper": True},
    "max_autotune": {"max_autotune": True},
}
CATEGORIES = (
    ("matmul (weights)", ("mm", "addmm", "linear", "mkl", "onednn", "mkldnn", "gemm", "_weight_int", "kvlab::gated")),
    ("attention", ("scaled_dot_product", "flash", "attention", "bmm", "kvlab::attend")),
    ("fused Inductor kernels", ("cpp_fused", "triton_")),
    ("copies and indexing", ("copy_", "index", "scatter", "gather", "cat", "clone", "to_copy")),
    ("framework (graph call, guards)", ("compiledfxgraph", "dynamo", "compiled region", "pregraph")),
)


@torch.no_grad()
def weight_floor(model, device: torch.device, dtype: torch.dtype) -> tuple[float, float, int]:
    """(seconds for a batch-1 pass over every Linear, float or quantized, read GB/s of a 1 GiB sum, the
    bytes that pass reads)."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | Int8Linear | Int4Linear) and not isinstance(m, Int8Embedding)
    ]
    x = {m: torch.randn(1, m.in_features, device=device, dtype=dtype) for m in linears}
    weights = sum(read_bytes(m) for m in linears)
    pass_seconds = seconds_per_call(lambda: [m(x[m]) for m in linears], device=device)
    return pass_seconds, read_bandwidth(device), weights


def read_bytes(linear: torch.nn.Module) -> int:
    """The bytes a batch-1 product reads from `linear`: an int4 Linear's tiled copy where the native kernel
    takes it (the plain codes stay for prefill, unread by a step), else every parameter and buffer."""
    tiled = linear.tiled_operands() if isinstance(linear, Int4Linear) else None
    tensors = (*tiled, *linear.parameters()) if tiled is not None else (*linear.parameters(), *linear.buffers())
    return sum(t.nbytes for t in tensors)


@contextmanager
def row_major_weights(model):
    """Every Linear weight row-major (contiguous) for the duration, as before `lay_out_for_matvec`."""
    column_major = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.is_contiguous()]
    for m in column_major:
        m.weight.data = m.weight.data.contiguous()
    torch._dynamo.reset()
    try:
        yield
    finally:
        lay_out_for_matvec(model)


def category(name: str) -> str:
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other ops"


@torch.no_grad()
def profile_step(model, device: torch.device, prompt: list[int], steps: int) -> tuple[dict[str, float], float]:
    """Self CPU time per category and wall time, in seconds per decode step, over `steps` steps of the
    default compiled step (its Inductor kernels named in the profile), called directly after a prefill."""
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        step = compile_decode_step(device)
        n = len(prompt) + 4
        # compiles; leaves the caches set up
        generate(model, [prompt], 4, decode_step=step, max_seq_length=n + steps + 1)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        positions = [torch.tensor([[n + i]], device=device) for i in range(steps + 1)]
        step(model, token, positions[0], 0.0, None)  # any recompile for the direct call happens here, unprofiled
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for pos in positions[1:]:
                step(model, token, pos, 0.0, None)
            wall = (time.perf_counter() - t0) / steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    per_step: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_step[category(event.key)] += event.self_cpu_time_total / 1e6 / steps
    return dict(per_step), wall


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__, weights=True)
    p.add_argument("--prompt_length", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--new_tokens", type=int, default=64, help="tokens decoded per timed run (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the median is reported (default: 3)")
    p.add_argument(
        "--settings",
        nargs="+",
        default=list(SETTINGS),
        choices=list(SETTINGS),
        help="Inductor settings to time (default: all)",
    )
    return parse_bench_args(p, "decode_profile")


def time_settings(model, device: torch.device, prompt: list[int], args) -> tuple[float, float | None, dict[str, float]]:
    """(eager tok/s, eager tok/s with row-major weights or None where not compared, compiled tok/s per setting)."""

    def rate(step=None) -> float:
        kwargs = {} if step is None else {"decode_step": step}
        return median_decode_rate(
            after_warmup(lambda: generate(model, [prompt], args.new_tokens, **kwargs), args.repeats)
        )

    eager = rate()
    rates, row_major_eager = {}, None
    # native kernels read row-major weights only
    if device.type == "cpu" and args.weights == "float" and not kernels.NATIVE:
        with row_major_weights(model):  # the layout lay_out_for_matvec chose at load, against the one it replaced
            row_major_eager = rate()
            rates["default, row-major weights"] = rate(compile_decode_step(device))
        print(
            f"row-major weights: eager {row_major_eager:.1f}, compiled {rates['default, row-major weights']:.1f} tok/s",
            flush=True,
        )
    for name in args.settings:
        torch._dynamo.reset()
        step = compile_decode_step(device, decode_one_token, SETTINGS[name])
        t0 = time.perf_counter()
        rates[name] = rate(step)
        print(f"{name}: {rates[name]:.1f} tok/s ({time.perf_counter() - t0:.0f} s with compilation)", flush=True)
    return eager, row_major_eager, rates


def rate_rows(eager: float, row_major_eager: float | None, rates: dict[str, float], pass_seconds: float) -> list[str]:
    """The Inductor settings' table rows: tok/s, against the default compile and eager, ms per step, and the
    share of the step spent in the weight pass."""
    base = rates.get("default", eager)
    named = [("eager", eager)]
    if row_major_eager is not None:
        named.append(("eager, row-major weights", row_major_eager))
    return [
        row(name, f"{r:.1f}", f"{r / base:.2f}x", f"{r / eager:.2f}x", f"{1e3 / r:.1f}", f"{pass_seconds * r:.0%}")
        for name, r in [*named, *rates.items()]
    ]


def profile_rows(breakdown: dict[str, float], step_seconds: float) -> list[str]:
    """The profiled step's table rows: each category, the time in no op, and the step's wall time."""
    unaccounted = max(step_seconds - sum(breakdown.values()), 0)
    return [
        *(
            row(k, f"{v * 1e3:.1f}", f"{v / step_seconds:.0%}")
            for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1])
        ),
        row(
            "not in any op (Python, dispatch, profiler)",
            f"{unaccounted * 1e3:.1f}",
            f"{unaccounted / step_seconds:.0%}",
        ),
        row("**step (wall, profiled)**", f"{step_seconds * 1e3:.1f}", "100%"),
    ]


def main() -> None:
    args = parse_args()
    kernels.load()
    bench = load_bench(args.device, args.dtype, args.weights)
    device, model, prompt = bench.device, bench.model, bench.ids[: args.prompt_length]
    pass_seconds, bandwidth, weight_bytes = weight_floor(model, device, bench.dtype)
    print(
        f"weights {weight_bytes / 1e6:.0f} MB: a batch-1 pass {pass_seconds * 1e3:.1f} ms; read bandwidth "
        f"{bandwidth:.1f} GB/s",
        flush=True,
    )
    eager, row_major_eager, rates = time_settings(model, device, prompt, args)
    torch._dynamo.reset()
    breakdown, step_seconds = profile_step(model, device, prompt, 16)
    floor = row(
        f"{weight_bytes / 1e6:.0f} MB",
        f"{pass_seconds * 1e3:.1f} ms",
        f"{weight_bytes / pass_seconds / 1e9:.1f}",
        f"{bandwidth:.1f} GB/s",
        f"{weight_bytes / bandwidth / 1e6:.1f} ms",
        f"{1 / pass_seconds:.1f}",
    )
    lines = [
        f"# Decode step profile: {bench.config['name']} on {device.type} ({machine(device)}), {bench.dtype_name}"
        + ("" if args.weights == "float" else f", {args.weights} weights"),
        "",
        f"torch {torch.__version__}; kernels: {kernels.path()}; batch 1; {len(prompt)}-token prompt; full "
        f"cache; {args.new_tokens} new tokens per run, median of {args.repeats} after a warm-up.",
        "",
        "## The floor",
        "",
        *table(
            "weights (Linear + LM head) | batch-1 pass over them | the pass's GB/s | read bandwidth (1 GiB sum) "
            "| weights / bandwidth | tok/s bound",
            [floor],
        ),
        "## Inductor settings (compiled decode)",
        "",
        *table(
            "setting | decode tok/s | / default compile | / eager | ms per step | share of step in the weight pass",
            rate_rows(eager, row_major_eager, rates, pass_seconds),
        ),
        "## Where the default compiled step's time goes (torch.profiler, self CPU time)",
        "",
        *table("part | ms per step | share of the step", profile_rows(breakdown, step_seconds)),
    ]
    name = "decode_profile" if args.weights == "float" else f"decode_profile_{args.weights}"
    write_results(lines, args.out, name, device)


if __name__ == "__main__":
    main()

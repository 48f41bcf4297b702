"""Where a float32 prefill spends its time on this CPU: torch's profiler over one prefill (a 2,048-token prompt by
default), its self time grouped into products, attention and the rest, with torch's kernels (MKL's products, the CPU
flash attention with keys and values repeated per query head) and with kvlab's native ones (the panel products of
csrc/gemm.h, the prefill attention); against what the machine allows for the products (MKL's rate on the prefill's
largest product, measured here).

    python bench/bench_prefill_profile.py                       # 2048 tokens
    python bench/bench_prefill_profile.py --prompt_lengths 512 2048 8191

Writes bench/results/prefill_profile_cpu.md and .json: {"<n>": {"torch"|"native": {"seconds",
"tok_s", "products_s", "attention_s", "rest_s", "products_gflop_s", "attention_gflop_s"}}, "mkl_gflop_s", "isa"}.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import profile

from common import bench_parser, load_bench, parse_bench_args, row, table, write_results
from kvlab import kernels
from kvlab.config import cache_spec
from kvlab.engine import generate
from kvlab.model import lay_out_for_matvec

KERNELS = {
    "torch": "torch's (MKL products, CPU flash attention)",
    "native": "kvlab's (panel products, prefill attention)",
}
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "kvlab::linear_fp32", "kvlab::gated_fp32")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "kvlab::attend_prefill")


def flops(model, n: int) -> tuple[float, float]:
    """A prefill's FLOPs in products (every Linear but the LM head, which runs for the last token) and in causal
    attention (scores and weighted values over n (n + 1) / 2 pairs per head)."""
    c = model.config
    per_token = 2 * sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "output"
    )
    return per_token * n, 4 * c.head_dim * c.n_head * c.n_layer * n * (n + 1) / 2


def profile_prefill(model, ids: list[int], native: bool) -> dict:
    """One warm prefill timed, then one profiled: its self time by group."""
    kernels.NATIVE = native
    spec = cache_spec({"cache_strategy": "full"}, model.config.n_layer)
    generate(model, [ids], 1, spec)
    seconds = generate(model, [ids], 1, spec).prefill_seconds
    with profile() as prof:
        generate(model, [ids], 1, spec)
    self_s = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    products, attention = sum(self_s.get(k, 0.0) for k in PRODUCTS), sum(self_s.get(k, 0.0) for k in ATTENTION)
    product_flops, attention_flops = flops(model, len(ids))
    return {
        "seconds": seconds,
        "tok_s": len(ids) / seconds,
        "products_s": products,
        "attention_s": attention,
        "rest_s": sum(self_s.values()) - products - attention,
        "products_gflop_s": product_flops / products / 1e9,
        "attention_gflop_s": attention_flops / attention / 1e9,
    }


def mkl_rate(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 20) -> float:
    """torch's (MKL's) GFLOP/s on the prefill's gate/up product shape."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.nn.functional.linear(x, w)
    t = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    return 2 * m * k * n * repeats / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument(
        "--prompt_lengths", type=int, nargs="+", default=[2048], help="prompt lengths in tokens (default: 2048)"
    )
    args = parse_bench_args(p, "prefill_profile")
    if not kernels.load():
        sys.exit("error: the native kernels are unavailable here; nothing to compare")
    bench = load_bench("cpu", "float32")
    lay_out_for_matvec(bench.model)
    results: dict = {str(n): {} for n in args.prompt_lengths}
    for n in args.prompt_lengths:
        for name, native in (("torch", False), ("native", True)):
            print(f"{n} tokens, {name}", file=sys.stderr, flush=True)
            results[str(n)][name] = profile_prefill(bench.model, bench.ids[:n], native)
    results |= {"mkl_gflop_s": mkl_rate(), "isa": kernels.REASON, "threads": torch.get_num_threads()}
    rows = [
        row(n, KERNELS[name], f"{r['tok_s']:.0f}", f"{r['products_s']:.2f}", f"{r['products_gflop_s']:.0f}",
            f"{r['attention_s']:.2f}", f"{r['attention_gflop_s']:.0f}", f"{r['rest_s']:.2f}")
        for n in args.prompt_lengths
        for name, r in results[str(n)].items()
    ]  # fmt: skip
    lines = [
        f"# Where a float32 prefill's time goes ({kernels.path()}, {torch.get_num_threads()} threads)",
        "",
        "Self time from torch's profiler over one prefill (full cache, float32 weights), in seconds; GFLOP/s of "
        "useful work",
        "(products: every Linear but the LM head; attention: the causal half). MKL alone here: "
        f"{results['mkl_gflop_s']:.0f} GFLOP/s",
        "on the gate/up product (2048 x 576 x 1536).",
        "",
        *table(
            "prompt tokens | kernels | tok/s | products s | products GFLOP/s | attention s | attention GFLOP/s "
            "| rest s",
            rows,
        ),
    ]
    write_results(lines, args.out, "prefill_profile", torch.device("cpu"), results=results)


if __name__ == "__main__":
    main()

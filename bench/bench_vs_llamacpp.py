"""kvlab against llama.cpp on this CPU, in one run: same prompts (the same token ids), same threads, same weights (issue 31).

    pip install -e ".[bench]"          # llama-cpp-python, built from source with this CPU's flags (~5 min)
    python bench/bench_vs_llamacpp.py  # prompts of 512 and 2048 tokens, 64 new tokens, median of 3

Weights: llama.cpp reads GGUFs written from the shipped Q4_1 file by llama-cpp-python's
`llama_model_quantize` (F32: its dequantized weights, which are kvlab's float32 checkpoint; Q8_0; Q4_0;
and the shipped Q4_1 itself), cached in ~/.cache/kvlab/gguf. kvlab runs its float32 checkpoint and that
checkpoint quantized as scripts/quantize.py writes it (int8 per channel, int4 in groups of 32), and the
int4 one once more with x rounded to int8 per block of 32 (KVLAB_INT4_X=int8: llama.cpp's Q4 x Q8_0 numerics).

Both sides decode greedily from the same prompt ids. Prefill: one call over the prompt (llama.cpp in its
default batches of 512; kvlab eager, as generate.py runs it). Decode: tok/s over the steps after the
first, kvlab's compiled (generate.py --compile). Without llama-cpp-python the bench says so and measures
kvlab alone.

Writes bench/results/vs_llamacpp_cpu.md and .json: {"decode_<fp32|int8|int4|int4_x8>_<n>" and
"prefill_fp32_<n>": {"kvlab": tok/s, "llamacpp": tok/s (null without it), "ratio"}, "cpu", "threads",
"load", "isa", "llamacpp_int4": the GGUF of the int4 row, "same_greedy_tokens_fp32": how many leading
greedy tokens kvlab float32 and llama.cpp F32 share}.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common import QUANTIZATIONS, after_warmup, bench_parser, load_bench, machine, parse_bench_args, row, table, write_results
from kvlab import kernels
from kvlab.convert import default_gguf_path
from kvlab.engine import compile_decode_step, generate
from kvlab.model import lay_out_for_matvec
from kvlab.quantize import Int4Linear, quantize_model

GGUF_TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_* values
LLAMA_WEIGHTS = {"fp32": ["F32"], "int8": ["Q8_0"], "int4": ["Q4_0", "Q4_1"]}  # kvlab weights -> the GGUFs it is measured against


def gguf_file(kind: str) -> Path:
    """The default model as a GGUF of `kind`: the shipped file for Q4_1, else written from it once."""
    shipped = default_gguf_path()
    if kind == "Q4_1":
        return shipped
    out = Path.home() / ".cache" / "kvlab" / "gguf" / shipped.name.replace("Q4_1", kind)
    if not out.exists():
        import llama_cpp

        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = GGUF_TYPES[kind], True
        if llama_cpp.llama_model_quantize(str(shipped).encode(), str(out).encode(), params) != 0:
            raise SystemExit(f"error: llama_model_quantize could not write {out}")
    return out


def greedy(llm) -> int:
    """The argmax of the logits of the last token evaluated (the only one llama.cpp computes logits for)."""
    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def llamacpp_rates(kind: str, prompts: dict[int, list[int]], new_tokens: int, repeats: int, threads: int) -> dict[int, tuple[float, float]]:
    """Per prompt length: llama.cpp's (prefill tok/s, decode tok/s), medians of `repeats` runs after a warm-up."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_file(kind)), n_ctx=max(prompts) + new_tokens + 8, n_threads=threads, n_threads_batch=threads, verbose=False)
    rates = {}
    for n, ids in prompts.items():

        def run(ids: list[int] = ids, n: int = n) -> tuple[float, float]:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            t1 = time.perf_counter()
            llm.eval([greedy(llm)])  # the first step, left out as kvlab's is
            t2 = time.perf_counter()
            for _ in range(new_tokens - 1):
                llm.eval([greedy(llm)])
            return n / (t1 - t0), (new_tokens - 1) / (time.perf_counter() - t2)

        runs = after_warmup(run, repeats)
        rates[n] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    return rates


def same_greedy_tokens(model, prompt: list[int], new_tokens: int) -> int:
    """How many of `new_tokens` greedy tokens kvlab's float32 model and llama.cpp's F32 GGUF agree on, from the start."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_file("F32")), n_ctx=len(prompt) + new_tokens + 8, n_threads=torch.get_num_threads(), verbose=False)
    llm.eval(prompt)
    theirs = []
    for _ in range(new_tokens):
        theirs.append(greedy(llm))
        llm.eval(theirs[-1:])
    ours = generate(model, [prompt], new_tokens).tokens[0]
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))


def kvlab_rates(model, prompts: dict[int, list[int]], new_tokens: int, repeats: int) -> dict[int, tuple[float, float]]:
    """Per prompt length: kvlab's (prefill tok/s, compiled decode tok/s), medians of `repeats` runs after a warm-up."""
    lay_out_for_matvec(model)
    torch._dynamo.reset()
    step = compile_decode_step(torch.device("cpu"))
    rates = {}
    for n, ids in prompts.items():
        runs = after_warmup(lambda ids=ids: generate(model, [ids], new_tokens, decode_step=step), repeats)
        rates[n] = (statistics.median(n / r.prefill_seconds for r in runs), statistics.median((r.decode_steps - 1) / r.decode_seconds for r in runs))
    return rates


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print('llama-cpp-python is not installed (pip install -e ".[bench]"): measuring kvlab alone', file=sys.stderr)
        return False
    return True


def measure(args) -> tuple[dict, dict, dict, str | None]:
    """kvlab's and llama.cpp's rates per weights kind and prompt length, and llama.cpp's int4 GGUF (the faster)."""
    bench = load_bench("cpu", "float32")
    prompts = {n: bench.ids[:n] for n in args.prompt_lengths}
    threads = torch.get_num_threads()
    ours = {"fp32": kvlab_rates(bench.model, prompts, args.new_tokens, args.repeats)}
    for kind in ("int8", "int4"):
        ours[kind] = kvlab_rates(quantize_model(copy.deepcopy(bench.model), QUANTIZATIONS[kind]), prompts, args.new_tokens, args.repeats)
    ours["int4_x8"] = kvlab_rates(with_int8_x(quantize_model(copy.deepcopy(bench.model), QUANTIZATIONS["int4"])), prompts, args.new_tokens, args.repeats)
    theirs, int4_gguf = {}, None
    if llamacpp_available():
        by_gguf = {g: llamacpp_rates(g, prompts, args.new_tokens, args.repeats, threads) for gs in LLAMA_WEIGHTS.values() for g in gs}
        for kind, ggufs in LLAMA_WEIGHTS.items():
            best = max(ggufs, key=lambda g: sum(by_gguf[g][n][1] for n in prompts))
            theirs[kind] = by_gguf[best]
        int4_gguf = max(LLAMA_WEIGHTS["int4"], key=lambda g: sum(by_gguf[g][n][1] for n in prompts))
        theirs["int4_x8"] = theirs["int4"]
        theirs["by_gguf"] = by_gguf
        theirs["same_greedy_tokens"] = same_greedy_tokens(bench.model, prompts[min(prompts)], args.new_tokens)
    return bench, ours, theirs, int4_gguf


def with_int8_x(model: torch.nn.Module) -> torch.nn.Module:
    """The int4 model with its products rounding x to int8 per block of 32 (what KVLAB_INT4_X=int8 builds)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.quantize_x = True
    return model


def cell(kvlab: float, llamacpp: float | None) -> dict:
    return {"kvlab": kvlab, "llamacpp": llamacpp, "ratio": None if llamacpp is None else kvlab / llamacpp}


def results_of(args, ours: dict, theirs: dict, int4_gguf: str | None) -> dict:
    """The JSON record: the issue's keys, then the machine and llama.cpp's details."""
    results = {}
    for kind in ("fp32", "int8", "int4", "int4_x8"):
        for n in args.prompt_lengths:
            results[f"decode_{kind}_{n}"] = cell(ours[kind][n][1], theirs[kind][n][1] if theirs else None)
    for n in args.prompt_lengths:
        results[f"prefill_fp32_{n}"] = cell(ours["fp32"][n][0], theirs["fp32"][n][0] if theirs else None)
    results |= {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "load": os.getloadavg(), "isa": kernels.REASON}
    results |= {"llamacpp_int4": int4_gguf, "llamacpp_by_gguf": theirs.get("by_gguf"), "same_greedy_tokens_fp32": theirs.get("same_greedy_tokens")}
    return results


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def report_lines(args, bench, results: dict, theirs: dict, int4_gguf: str | None) -> list[str]:
    gguf_of = {"fp32": "F32", "int8": "Q8_0", "int4": int4_gguf or "Q4_0/Q4_1", "int4_x8": int4_gguf or "Q4_0/Q4_1"}
    weights_of = {"int4_x8": "int4, x int8"}
    cells = [(key.split("_")[0], "_".join(key.split("_")[1:-1]), key.split("_")[-1], v) for key, v in results.items() if isinstance(v, dict) and "kvlab" in v]
    lines = [
        f"# kvlab against llama.cpp: {bench.config['name']} ({machine(bench.device)})",
        "",
        f"torch {torch.__version__}; kvlab's kernels: {kernels.path()}; batch 1, greedy;",
        f"{args.new_tokens} new tokens; medians of {args.repeats} runs after a warm-up; the same prompt ids on both sides.",
        "",
        *table(
            "measure | prompt tokens | kvlab weights | llama.cpp GGUF | kvlab tok/s | llama.cpp tok/s | kvlab / llama.cpp",
            (row(m, n, weights_of.get(kind, kind), gguf_of[kind], fmt(v["kvlab"]), fmt(v["llamacpp"]), fmt(v["ratio"], ".2f")) for m, kind, n, v in cells),
            align="---:",
        ),
    ]
    if theirs:
        lines += [
            f"kvlab float32 and llama.cpp F32 agree on the first {theirs['same_greedy_tokens']} of {args.new_tokens} greedy tokens "
            f"from the {min(args.prompt_lengths)}-token prompt.",
            "",
            "llama.cpp per GGUF (prefill / decode tok/s):",
            "",
            *table(
                "GGUF | " + " | ".join(f"{n} tokens" for n in args.prompt_lengths),
                (row(g, *(f"{r[n][0]:.0f} / {r[n][1]:.1f}" for n in args.prompt_lengths)) for g, r in theirs["by_gguf"].items()),
            ),
        ]
    return lines


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--prompt_lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths in tokens (default: 512 2048)")
    p.add_argument("--new_tokens", type=int, default=64, help="tokens decoded per run (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after a warm-up; the median is reported (default: 3)")
    args = parse_bench_args(p, "vs_llamacpp")
    kernels.load()
    bench, ours, theirs, int4_gguf = measure(args)
    results = results_of(args, ours, theirs, int4_gguf)
    write_results(report_lines(args, bench, results, theirs, int4_gguf), args.out, "vs_llamacpp", bench.device, results=results)


if __name__ == "__main__":
    main()

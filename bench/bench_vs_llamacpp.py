"""kvlab against llama.cpp on this CPU, in one run: same prompts (the same token ids), same threads, same weights.

    pip install -e ".[bench]"          # llama-cpp-python, built from source with this CPU's flags (~5 min)
    python bench/bench_vs_llamacpp.py  # prompts of 512 and 2048 tokens, 64 new tokens, 5 interleaved rounds
    # some groups of weights only:
    python bench/bench_vs_llamacpp.py --groups bf16 --out bench/results/vs_llamacpp_bf16_cpu.md

Weights: llama.cpp reads GGUFs written from the shipped Q4_1 file by llama-cpp-python's
`llama_model_quantize` (F32: its dequantized weights, which are kvlab's float32 checkpoint; Q8_0; Q4_0;
and the shipped Q4_1 itself), cached in ~/.cache/kvlab/gguf. kvlab runs its float32 checkpoint and that
checkpoint quantized as scripts/quantize.py writes it (int8 per channel, int4 in groups of 32, its products
taking x rounded to int16 per block of 32, the default), and the int4 one twice more: x in float32
(KVLAB_INT4_X=float32) and x rounded to int8 (KVLAB_INT4_X=int8: llama.cpp's Q4 x Q8_0 numerics). The bf16
group runs the float32 checkpoint cast to bfloat16 (a bfloat16 cache) against a BF16 GGUF.

The cache: llama.cpp's default is F16 keys and values; kvlab's rows use the same, a float16 cache
(`--cache_bits 16`), which its native attention reads as it is. One more row runs kvlab's float32 weights
over a float32 cache (`fp32_kv32`), kvlab's default.

llama.cpp runs with flash attention on (`flash_attn=True`: what its own tools do on a CPU; llama-cpp-python's
default is off, 7-20% slower); the float32 rows are measured against it with flash attention off as well,
labelled so. Both sides decode greedily from the same prompt ids. Prefill: one call over the prompt (llama.cpp
in its default batches of 512; kvlab eager, as generate.py runs it), for every group of weights. Decode: tok/s
over the steps after the first, kvlab's compiled (generate.py --compile). A long prompt (--long_prompt, 8,191
tokens by default: with the token it answers, SmolLM2's whole context) is prefilled alone: kvlab float32 at once and in
chunks of 512 (--prefill_chunk 512), against llama.cpp F32, in --long_repeats rounds. Without llama-cpp-python the bench
says so and measures kvlab alone.

Writes bench/results/vs_llamacpp_cpu.md and .json: {"decode_<fp32|int8|int4|int4_x32|int4_x8|fp32_kv32|bf16>_<n>",
"prefill_<fp32|int8|int4|bf16>_<n>", "<decode|prefill>_fp32_flash_off_<n>" (against llama.cpp without flash
attention) and "prefill_fp32_<long>", "prefill_fp32_chunk512_<long>": {"kvlab": tok/s, "llamacpp": tok/s (null
without it), "ratio"}, "cpu", "threads", "load", "isa", "llamacpp_flash_attn": true, "llamacpp_int4": the GGUF of
the int4 decode rows, "same_greedy_tokens_fp32": how many leading greedy tokens kvlab float32 and llama.cpp F32
share, "rounds": every round's (prefill, decode) tok/s}.
The runs of a row's weights (kvlab's variants and the GGUFs) are interleaved, round by round: this machine's
memory bandwidth moves with other tenants' work by up to a third between runs, and a ratio is taken within
a round, where both sides met the same machine.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from vs_llamacpp_results import (
    FLOAT_CACHE,
    GROUPS,
    HALF_CACHE,
    LLAMA_RUNS,
    LONG_CHUNK,
    report_lines,
    results_of,
    sections_of_other_benches,
)

from common import (
    QUANTIZATIONS,
    RESULTS,
    Bench,
    bench_parser,
    interleaved,
    load_bench,
    parse_bench_args,
    write_results,
)
from kvlab import kernels
from kvlab.config import cache_spec
from kvlab.convert import default_gguf_path
from kvlab.engine import compile_decode_step, generate
from kvlab.model import lay_out_for_matvec
from kvlab.quantize import Int4Linear
from kvlab.quantized_model import quantize_model

GGUF_TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}  # llama.cpp's LLAMA_FTYPE_* values


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


def llamacpp_run(llm, ids: list[int], new_tokens: int) -> Callable[[], tuple[float, float | None]]:
    """One llama.cpp run over `ids`: (prefill tok/s, decode tok/s after the first step; None for one new token)."""

    def run() -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        llm.eval([greedy(llm)])  # the first step, left out as kvlab's is
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([greedy(llm)])
        return len(ids) / (t1 - t0), (new_tokens - 1) / (time.perf_counter() - t2) if new_tokens > 1 else None

    return run


def kvlab_run(model, step, cache: dict, ids: list[int], new_tokens: int) -> Callable[[], tuple[float, float | None]]:
    """One kvlab run over `ids` with `cache`'s settings: (prefill tok/s, decode tok/s after the first step, compiled
    with a `step`; None for one new token)."""
    spec = cache_spec(cache, model.config.n_layer)

    def run() -> tuple[float, float]:
        r = generate(model, [ids], new_tokens, spec, **({"decode_step": step} if step else {}))
        return len(ids) / r.prefill_seconds, (r.decode_steps - 1) / r.decode_seconds if r.decode_steps > 1 else None

    return run


def same_greedy_tokens(model, prompt: list[int], new_tokens: int) -> int:
    """How many of `new_tokens` greedy tokens kvlab's float32 model and llama.cpp's F32 GGUF, each over a float16 cache,
    agree on, from the start."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        str(gguf_file("F32")), n_ctx=len(prompt) + new_tokens + 8, n_threads=threads, flash_attn=True, verbose=False
    )
    llm.eval(prompt)
    theirs = []
    for _ in range(new_tokens):
        theirs.append(greedy(llm))
        llm.eval(theirs[-1:])
    ours = generate(model, [prompt], new_tokens, cache_spec(HALF_CACHE, model.config.n_layer)).tokens[0]
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print('llama-cpp-python is not installed (pip install -e ".[bench]"): measuring kvlab alone', file=sys.stderr)
        return False
    return True


def weights_of(bench: Bench, group: str) -> torch.nn.Module:
    """The float32 model, a bfloat16 copy, or a copy quantized as scripts/quantize.py writes it."""
    if group == "bf16":
        return copy.deepcopy(bench.model).to(torch.bfloat16)
    return bench.model if group == "fp32" else quantize_model(copy.deepcopy(bench.model), QUANTIZATIONS[group])


def load_ggufs(group: str, n_ctx: int, only: str | None = None) -> dict:
    """llama.cpp's models for a group of weights (or its run named `only`), on as many threads as kvlab's, flash
    attention on or off as LLAMA_RUNS says."""
    import llama_cpp

    threads = torch.get_num_threads()
    return {
        name: llama_cpp.Llama(
            str(gguf_file(g)), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, flash_attn=flash, verbose=False
        )
        for name, (g, flash) in LLAMA_RUNS[group].items()
        if only in (None, name)
    }


def measure(args) -> tuple[Bench, dict]:
    """Per group of weights (fp32, int8, int4) and prompt length, every kvlab variant's and GGUF's runs, interleaved."""
    bench = load_bench("cpu", "float32")
    with_llamacpp = llamacpp_available()
    samples: dict = {}
    if args.long_prompt:  # first: a long prompt that does not fit fails before the groups' runs
        samples["long", args.long_prompt] = measure_long_prompt(bench, args, with_llamacpp)
    for group in args.groups:
        variants = GROUPS[group]
        torch._dynamo.reset()
        model = weights_of(bench, group)
        lay_out_for_matvec(model)
        models = {
            name: with_x_bits(copy.deepcopy(model), bits) if bits else model for name, (_, bits) in variants.items()
        }
        llms = load_ggufs(group, max(args.prompt_lengths) + args.new_tokens + 8) if with_llamacpp else {}
        for n in args.prompt_lengths:
            ids = bench.ids[:n]
            # each its own graphs: one process, one model, as generate.py
            steps = {name: compile_decode_step(torch.device("cpu")) for name in variants}
            runs = {
                name: kvlab_run(models[name], steps[name], cache, ids, args.new_tokens)
                for name, (cache, _) in variants.items()
            }
            runs |= {g: llamacpp_run(llm, ids, args.new_tokens) for g, llm in llms.items()}
            print(f"{group} @{n}: {', '.join(runs)} interleaved, {args.repeats} rounds", file=sys.stderr, flush=True)
            samples[group, n] = interleaved(runs, args.repeats)
        del llms
    if with_llamacpp and "fp32" in args.groups:
        samples["same_greedy_tokens"] = same_greedy_tokens(
            bench.model, bench.ids[: min(args.prompt_lengths)], args.new_tokens
        )
    return bench, samples


def measure_long_prompt(bench: Bench, args, with_llamacpp: bool) -> dict:
    """The long prompt's prefill, one new token: kvlab float32 at once and in chunks of LONG_CHUNK, llama.cpp F32."""
    ids = bench.ids[: args.long_prompt]
    if len(ids) < args.long_prompt:
        raise SystemExit(f"error: --long_prompt {args.long_prompt}: the bench text has only {len(ids)} tokens")
    lay_out_for_matvec(bench.model)
    runs = {
        "fp32": kvlab_run(bench.model, None, FLOAT_CACHE, ids, 1),
        f"fp32_chunk{LONG_CHUNK}": kvlab_run(bench.model, None, FLOAT_CACHE | {"prefill_chunk": LONG_CHUNK}, ids, 1),
    }
    if with_llamacpp:
        runs["F32"] = llamacpp_run(load_ggufs("fp32", len(ids) + 8, only="F32")["F32"], ids, 1)
    print(
        f"long prompt @{len(ids)}: {', '.join(runs)} interleaved, {args.long_repeats} rounds",
        file=sys.stderr,
        flush=True,
    )
    return interleaved(runs, args.long_repeats)


def with_x_bits(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """The int4 model with its products taking x in `bits` (32: float32; 8: int8 per block of 32, what
    KVLAB_INT4_X=float32 and int8 build)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.x_bits = bits
    return model


def main() -> None:
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
        "--repeats",
        type=int,
        default=5,
        help="timed rounds after a warm-up; medians over them are reported (default: 5)",
    )
    p.add_argument(
        "--groups",
        nargs="+",
        default=list(GROUPS),
        choices=list(GROUPS),
        help=f"groups of weights to run (default: all: {' '.join(GROUPS)})",
    )
    p.add_argument(
        "--long_prompt",
        type=int,
        default=8191,
        help="the long prompt's tokens, prefilled alone (default: 8191, with the token it answers the model's "
        "whole context; 0: none)",
    )
    p.add_argument(
        "--long_repeats", type=int, default=2, help="timed rounds of the long prompt after a warm-up (default: 2)"
    )
    args = parse_bench_args(p, "vs_llamacpp")
    kernels.load()
    bench, samples = measure(args)
    results = results_of(args, samples) | sections_of_other_benches(args.out or RESULTS / "vs_llamacpp_cpu.md")
    write_results(report_lines(args, bench, results), args.out, "vs_llamacpp", bench.device, results=results)


if __name__ == "__main__":
    main()

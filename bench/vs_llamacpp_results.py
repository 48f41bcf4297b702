"""What bench_vs_llamacpp.py runs and what it makes of the rates: kvlab's variants per group of weights, the llama.cpp
runs each is measured against, the JSON record (medians and the rounds' ratios) and the report."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch

from common import machine, row, table
from kvlab import kernels

HALF_CACHE = {"cache_strategy": "full", "cache_bits": 16}  # llama.cpp's default cache type, F16
FLOAT_CACHE = {"cache_strategy": "full"}
# kvlab's variants per group of weights: name -> (cache settings, the bits x takes in the int4 products: None for
# the default, int16)
GROUPS = {
    "fp32": {"fp32": (HALF_CACHE, None), "fp32_kv32": (FLOAT_CACHE, None)},
    "int8": {"int8": (HALF_CACHE, None)},
    "int4": {"int4": (HALF_CACHE, None), "int4_x32": (HALF_CACHE, 32), "int4_x8": (HALF_CACHE, 8)},
    "bf16": {"bf16": (FLOAT_CACHE, None)},  # a bfloat16 model's cache is bfloat16: 16 bits, as llama.cpp's F16
}
# kvlab weights -> llama.cpp's runs it is measured against: name -> (GGUF, flash attention); the first is the
# prefill rows' anchor, the fastest decoding one with flash attention on the decode rows'
LLAMA_RUNS = {
    "fp32": {"F32": ("F32", True), "F32 flash off": ("F32", False)},
    "int8": {"Q8_0": ("Q8_0", True)},
    "int4": {"Q4_0": ("Q4_0", True), "Q4_1": ("Q4_1", True)},
    "bf16": {"BF16": ("BF16", True)},
}
FLASH_OFF = "F32 flash off"
LONG_CHUNK = 512  # the long prompt's chunked row: --prefill_chunk 512
OTHER_SECTIONS = ("longdoc",)  # keys other benches write into this bench's JSON


def median_of(samples: list[tuple[float, float]], which: int) -> float:
    return statistics.median(sample[which] for sample in samples)


def cell(ours: list[tuple[float, float]], theirs: list[tuple[float, float]] | None, which: int) -> dict:
    """Medians of kvlab's and llama.cpp's rates (`which`: 0 prefill, 1 decode), and the median of the rounds' ratios."""
    if theirs is None:
        return {"kvlab": median_of(ours, which), "llamacpp": None, "ratio": None}
    ratio = statistics.median(a[which] / b[which] for a, b in zip(ours, theirs, strict=True))
    return {"kvlab": median_of(ours, which), "llamacpp": median_of(theirs, which), "ratio": ratio}


def results_of(args, samples: dict) -> dict:
    """The JSON record: the issue's keys (and the extra rows'), then the machine, llama.cpp's details and every round's
    rates."""
    lengths = args.prompt_lengths
    with_llamacpp = all(g in samples[group, lengths[0]] for group in args.groups for g in LLAMA_RUNS[group])
    by_gguf = {
        g: {n: [median_of(samples[group, n][g], w) for w in (0, 1)] for n in lengths}
        for group in (args.groups if with_llamacpp else ())
        for g in LLAMA_RUNS[group]
    }
    flash_on = {group: [g for g, (_, flash) in LLAMA_RUNS[group].items() if flash] for group in args.groups}
    best = (
        {group: max(flash_on[group], key=lambda g: sum(by_gguf[g][n][1] for n in lengths)) for group in args.groups}
        if with_llamacpp
        else {}
    )
    results: dict = {}
    for group in args.groups:
        for name in GROUPS[group]:
            for n in lengths:
                results[f"decode_{name}_{n}"] = cell(
                    samples[group, n][name], samples[group, n][best[group]] if with_llamacpp else None, 1
                )
        for n in lengths:
            anchor = flash_on[group][0]
            results[f"prefill_{group}_{n}"] = cell(
                samples[group, n][group], samples[group, n][anchor] if with_llamacpp else None, 0
            )
    for which, key in ((1, "decode"), (0, "prefill")):
        for n in lengths if with_llamacpp and "fp32" in args.groups else ():
            results[f"{key}_fp32_flash_off_{n}"] = cell(
                samples["fp32", n]["fp32"], samples["fp32", n][FLASH_OFF], which
            )
    if args.long_prompt:
        long = samples["long", args.long_prompt]
        for name in (n for n in long if n.startswith("fp32")):
            results[f"prefill_{name}_{args.long_prompt}"] = cell(long[name], long.get("F32"), 0)
    results |= {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load": os.getloadavg(),
        "isa": kernels.REASON,
    }
    if with_llamacpp:
        results |= {"llamacpp_flash_attn": True, "llamacpp_int4": best.get("int4"), "llamacpp_by_gguf": by_gguf}
        results["same_greedy_tokens_fp32"] = samples.get("same_greedy_tokens")
    results["rounds"] = {
        f"{group}@{n}": runs for (group, n), runs in ((k, v) for k, v in samples.items() if isinstance(k, tuple))
    }
    return results


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def labels(results: dict) -> tuple[dict[str, str], dict[str, str]]:
    """The report's names for each row kind: (the llama.cpp GGUF it runs against, kvlab's weights and cache)."""
    int4 = results.get("llamacpp_int4") or "Q4_0/Q4_1"
    gguf_of = {
        "fp32": "F32",
        "int8": "Q8_0",
        "int4": int4,
        "int4_x32": int4,
        "int4_x8": int4,
        "fp32_kv32": "F32",
        "bf16": "BF16",
    }
    gguf_of |= {"fp32_flash_off": "F32, flash attention off", f"fp32_chunk{LONG_CHUNK}": "F32"}
    weights_of = {
        f"fp32_chunk{LONG_CHUNK}": f"fp32, float32 cache, --prefill_chunk {LONG_CHUNK}",
        "int4": "int4, x int16",
        "int4_x32": "int4, x float32",
        "int4_x8": "int4, x int8",
        "fp32_kv32": "fp32, float32 cache",
        "bf16": "bf16, bfloat16 cache",
    }
    return gguf_of, weights_of


def report_lines(args, bench, results: dict) -> list[str]:
    """The report: how it was run, a row per record key, the greedy tokens' agreement and llama.cpp per GGUF."""
    gguf_of, weights_of = labels(results)
    cells = [
        (key.split("_")[0], "_".join(key.split("_")[1:-1]), key.split("_")[-1], v)
        for key, v in results.items()
        if isinstance(v, dict) and "kvlab" in v
    ]
    cells = [
        (m, "fp32_kv32" if m == "prefill" and kind == "fp32" and n == str(args.long_prompt) else kind, n, v)
        for m, kind, n, v in cells
    ]
    lines = [
        f"# kvlab against llama.cpp: {bench.config['name']} ({machine(bench.device)})",
        "",
        f"torch {torch.__version__}; kvlab's kernels: {kernels.path()}; batch 1, greedy; the same prompt ids on "
        "both sides;",
        "a float16 cache on both sides (llama.cpp's default; kvlab's --cache_bits 16) but in the rows marked "
        "float32 cache;",
        "llama.cpp with flash attention on (flash_attn=True) but in the rows marked off.",
        f"{args.new_tokens} new tokens; {args.repeats} rounds after a warm-up, each running every kvlab variant "
        "and GGUF of",
        "a row's weights in turn (this machine's memory bandwidth moves between rounds); rates are medians over "
        "the rounds,",
        "ratios the median of the rounds' ratios.",
        "",
        *table(
            "measure | prompt tokens | kvlab weights | llama.cpp GGUF | kvlab tok/s | llama.cpp tok/s | kvlab / "
            "llama.cpp",
            (
                row(
                    m,
                    n,
                    weights_of.get(kind, kind),
                    gguf_of[kind],
                    fmt(v["kvlab"]),
                    fmt(v["llamacpp"]),
                    fmt(v["ratio"], ".2f"),
                )
                for m, kind, n, v in cells
            ),
            align="---:",
        ),
    ]
    return lines + agreement_lines(args, results)


def agreement_lines(args, results: dict) -> list[str]:
    """How many greedy tokens both sides share, and llama.cpp's rates per GGUF, where llama.cpp ran."""
    lines = []
    if results.get("same_greedy_tokens_fp32") is not None:
        lines += [
            f"kvlab float32 and llama.cpp F32 agree on the first {results['same_greedy_tokens_fp32']} of "
            f"{args.new_tokens} greedy tokens from the {min(args.prompt_lengths)}-token prompt.",
            "",
        ]
    if results.get("llamacpp_by_gguf"):
        lines += [
            "llama.cpp per GGUF (prefill / decode tok/s):",
            "",
            *table(
                "GGUF | " + " | ".join(f"{n} tokens" for n in args.prompt_lengths),
                (
                    row(g, *(f"{r[n][0]:.0f} / {r[n][1]:.1f}" for n in args.prompt_lengths))
                    for g, r in results["llamacpp_by_gguf"].items()
                ),
            ),
        ]
    return lines


def sections_of_other_benches(out: Path) -> dict:
    """What other benches keep in the same JSON (bench_longdoc.py's "longdoc"), carried over when it is rewritten."""
    path = out.with_suffix(".json")
    return {k: v for k, v in json.loads(path.read_text()).items() if k in OTHER_SECTIONS} if path.exists() else {}

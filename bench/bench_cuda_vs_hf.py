"""Compiled decode on a GPU against Hugging Face transformers' static cache, which its `generate` compiles
(torch.compile, "reduce-overhead": CUDA graphs, here with fullgraph=True), in one run on the same weights:
Llama-3-8B-shaped random weights in bfloat16 (nothing to download), built once as a transformers model whose
tensors kvlab runs too (`kvlab.convert.model_from_hf`).

    python bench/bench_cuda_vs_hf.py                              # CUDA, Llama-3-8B shape, prompts of 512 and 2048
    python bench/bench_cuda_vs_hf.py --device cpu --shape tiny    # the same code on a tiny model (a check, no GPU)

Decode tokens/s: the median of --repeats runs after a warm-up run that compiles; HF's from the extra time of
N tokens over 1 (as bench_generate.py measures it). Beside them, the bytes a step reads (the weights but the
embedding table, as GPT-Fast counts them, and every slot of the static cache) per second, against the device's
copy bandwidth measured in the same run. The reference is GPT-Fast's published figure for Llama-3.1-8B in
bfloat16 (93.89 tok/s, 1,411 GB/s on an A100-80GB: 69% of its 2,039 GB/s; 5-token prompts), as a share of
bandwidth, since it was measured on another card. Writes bench/results/cuda_vs_hf_<device>.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from common import (
    after_warmup,
    bench_parser,
    machine,
    median_decode_rate,
    parse_bench_args,
    row,
    table,
    time_hf,
    write_results,
)
from kvlab.build import make_caches
from kvlab.compiled import CompiledStep, compiled_step_options
from kvlab.convert import model_from_hf
from kvlab.engine import compile_decode_step, generate, sync
from kvlab.model import Transformer

SHAPES = {
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
GPT_FAST = {"model": "Llama-3.1-8B", "card": "A100-80GB", "tok_s": 93.89, "gb_s": 1410.76, "card_gb_s": 2039.0}


def hf_llama(shape: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A transformers Llama of `shape` with its own random initialization (std 0.02), built on `device` in `dtype`."""
    import transformers

    config = transformers.LlamaConfig(
        **SHAPES[shape],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def copy_bandwidth(device: torch.device, gigabytes: float) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written (median of 10 after 3 warm-ups)."""
    src = torch.randn(int(gigabytes * 2**30 / 4), device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def bytes_per_step(model: Transformer, context: int) -> int:
    """What one decode step must read: every weight but the embedding table (one row of it is read), and
    the keys and values of `context` slots (a static cache's attention reads all of them, masked)."""
    a, table = model.config, model.tok_embeddings.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - table.numel() * table.element_size()
    return weights + 2 * a.n_layer * a.n_local_heads * a.head_dim * context * table.element_size()


def logits_error(model: Transformer, hf: torch.nn.Module, prompt: list[int]) -> float:
    """||kvlab - HF|| / ||HF|| of the prompt's logits in one prefill: that both sides compute the same model
    (bfloat16 rounding lands near 1e-2), which near-tied random logits keep greedy tokens from showing."""
    a, tokens = model.config, torch.tensor([prompt], device=step_device(model))
    model.setup_caches(
        make_caches(
            "full",
            a.n_layer,
            1,
            a.n_local_heads,
            len(prompt),
            a.head_dim,
            model.tok_embeddings.weight.dtype,
            tokens.device,
        )
    )
    ours = model(tokens, torch.arange(len(prompt), device=tokens.device)[None], prefill=True).float()
    ref = hf(tokens).logits.float()
    return float((ours - ref).norm() / ref.norm())


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(
    model: Transformer,
    step: CompiledStep,
    tuned: CompiledStep | None,
    hf: torch.nn.Module,
    prompt: list[int],
    args: argparse.Namespace,
    hf_compile: Any,
) -> dict:
    """kvlab's compiled decode (and with `tuned`, the step compiled with coordinate-descent tuning) and HF's
    compiled static-cache decode on one prompt, each side's cache `args.cache_length` slots long."""
    new_tokens, repeats = args.new_tokens, args.repeats
    t0 = time.perf_counter()
    generate(model, [prompt], new_tokens, decode_step=step, max_seq_length=args.cache_length)  # warm-up: compiles
    warm = time.perf_counter() - t0
    runs = [
        generate(model, [prompt], new_tokens, decode_step=step, max_seq_length=args.cache_length)
        for _ in range(repeats)
    ]
    kvlab_rate = median_decode_rate(runs)
    tuned_rate = float("nan")
    if tuned is not None:
        tuned_rate = median_decode_rate(
            after_warmup(
                lambda: generate(model, [prompt], new_tokens, decode_step=tuned, max_seq_length=args.cache_length),
                repeats,
            )
        )
    t0 = time.perf_counter()
    _, hf_rate, hf_tokens = time_hf(
        hf,
        prompt,
        new_tokens,
        repeats,
        cache_implementation="static",
        max_cache_len=args.cache_length,
        compile_config=hf_compile,
    )
    hf_seconds = time.perf_counter() - t0
    step_bytes = bytes_per_step(model, args.cache_length)
    return {
        "prompt": len(prompt),
        "logits_error": logits_error(model, hf, prompt),
        "kvlab": kvlab_rate,
        "kvlab_coordinate_descent": tuned_rate,
        "hf": hf_rate,
        "ratio": kvlab_rate / hf_rate,
        "kvlab_gb_s": kvlab_rate * step_bytes / 1e9,
        "hf_gb_s": hf_rate * step_bytes / 1e9,
        "same_tokens": shared_prefix(runs[0].tokens[0], hf_tokens),
        "kvlab_warmup_s": warm,
        "hf_all_s": hf_seconds,
    }


def step_device(model: Transformer) -> torch.device:
    return model.tok_embeddings.weight.device


def profile(model: Transformer, step: CompiledStep, prompt: list[int], args: argparse.Namespace) -> None:
    """The kernels of one kvlab generate (prefill and decode), by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profiled

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if step_device(model).type == "cuda" else [])]
    with run_profiled(activities=activities) as prof:
        generate(model, [prompt], args.new_tokens, decode_step=step, max_seq_length=args.cache_length)
    sort = "cuda_time_total" if step_device(model).type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=80), flush=True)


ROW_HEADER = (
    "prompt tokens | kvlab tok/s | kvlab, coordinate descent tok/s | HF tok/s | kvlab / HF | kvlab GB/s "
    "| HF GB/s | kvlab / copy bandwidth | GPT-Fast / its card | logits vs HF | same greedy tokens"
)


def table_row(r: dict, share: float, bandwidth: float, new_tokens: int) -> str:
    """A prompt length's row: both sides' rates and bandwidths, GPT-Fast's share of its card, the logits' error."""
    return row(
        r["prompt"],
        f"{r['kvlab']:.1f}",
        f"{r['kvlab_coordinate_descent']:.1f}",
        f"{r['hf']:.1f}",
        f"{r['ratio']:.2f}x",
        f"{r['kvlab_gb_s']:.0f}",
        f"{r['hf_gb_s']:.0f}",
        f"{r['kvlab_gb_s'] / bandwidth:.0%}",
        f"{share:.0%}",
        f"{r['logits_error']:.1e}",
        f"{r['same_tokens']} of {new_tokens}",
    )


def report(
    args: argparse.Namespace, device: torch.device, model: Transformer, rows: list[dict], bandwidth: float
) -> None:
    import transformers

    share = GPT_FAST["gb_s"] / GPT_FAST["card_gb_s"]
    lines = [
        f"# Compiled decode on {device.type} ({machine(device)}): kvlab against HF transformers' compiled static cache",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}; {args.shape}-shaped random "
        f"weights in bfloat16, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, the same "
        f"tensors on both sides; batch 1; greedy; {args.new_tokens} new tokens; median of {args.repeats} runs "
        "after a warm-up run (which compiles).",
        "kvlab: `generate` with `compile_decode_step` (Inductor, CUDA graphs, the step's graph replayed). "
        'HF: `generate(..., cache_implementation="static", max_cache_len=..., '
        "compile_config=CompileConfig(fullgraph=True))` (mode reduce-overhead).",
        f"Both caches hold {args.cache_length} slots at every prompt length (one compile a side), and a step "
        "attends over all of them. Read bandwidth: bytes a step reads (weights but the embedding table, and "
        f"those slots) x tokens/s; device copy bandwidth in this run: {bandwidth:.0f} GB/s (read + write). "
        f"GPT-Fast's published {GPT_FAST['model']} bf16 figure, {GPT_FAST['tok_s']} tok/s at "
        f"{GPT_FAST['gb_s']:.0f} GB/s on an {GPT_FAST['card']}, is {share:.0%} of that card's bandwidth.",
        "",
        *table(ROW_HEADER, (table_row(r, share, bandwidth, args.new_tokens) for r in rows), align="---:"),
        "Warm-up (compile) seconds, kvlab: "
        + ", ".join(f"{r['prompt']}: {r['kvlab_warmup_s']:.0f}" for r in rows)
        + "; HF, all its runs: "
        + ", ".join(f"{r['prompt']}: {r['hf_all_s']:.0f}" for r in rows)
        + ".",
        "Logits vs HF: ||kvlab - HF|| / ||HF|| over the prompt's prefill logits. Greedy tokens are compared "
        "from the start: random weights give near-tied logits, so the two sides' bfloat16 rounding parts them "
        "early.",
        "",
    ]
    results = {
        "device": machine(device),
        "shape": args.shape,
        "copy_gb_s": bandwidth,
        "gpt_fast": GPT_FAST,
        "rows": rows,
    }
    write_results(lines, args.out, "cuda_vs_hf", device, results=results)


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--shape", default="llama-3-8b", choices=list(SHAPES), help="model shape (default: llama-3-8b)")
    p.add_argument(
        "--prompt_lengths",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prompt lengths in tokens (default: 512 2048)",
    )
    p.add_argument("--new_tokens", type=int, default=128, help="tokens decoded per run (default: 128)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement; the median is reported (default: 3)"
    )
    p.add_argument(
        "--coordinate_descent",
        action="store_true",
        help="also time kvlab's step compiled with Inductor's coordinate-descent tuning (GPT-Fast's setting)",
    )
    p.add_argument(
        "--profile", action="store_true", help="print the device time of the kernels of one kvlab decode run, by kernel"
    )
    args = parse_bench_args(p, "cuda_vs_hf")
    import transformers

    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    hf = hf_llama(args.shape, device, torch.bfloat16, seed=0)
    model = model_from_hf(hf)
    hf_compile = transformers.CompileConfig(fullgraph=True)
    hf_compile._compile_all_devices = device.type != "cuda"  # HF compiles only on accelerators unless told
    bandwidth = copy_bandwidth(device, 4.0 if device.type == "cuda" else 0.25)
    vocab = SHAPES[args.shape]["vocab_size"]
    args.cache_length = max(args.prompt_lengths) + args.new_tokens  # one size for every prompt: each side compiles once
    step = compile_decode_step(device)
    tuned = (
        compile_decode_step(device, inductor={**compiled_step_options(device), "coordinate_descent_tuning": True})
        if args.coordinate_descent
        else None
    )
    rows = []
    with torch.no_grad():
        for n in args.prompt_lengths:
            prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            rows.append(measure(model, step, tuned, hf, prompt, args, hf_compile))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
            # after each prompt length: a cut-off run keeps what it measured
            report(args, device, model, rows, bandwidth)
        if args.profile:
            profile(model, step, prompt, args)


if __name__ == "__main__":
    main()

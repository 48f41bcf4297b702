"""Quantized KV storage on the default model: quality (next-token loss and logit error against the
full-precision cache, teacher-forced through the cache), real bytes, and decode speed.

    python bench/bench_quantization.py                  # CPU
    python bench/bench_quantization.py --device cuda

Writes bench/results/quantization_<device>.md. Keys quantized per token and per channel (KIVI) are both
measured at every bit width; the default per bit width follows from this table. 16 bits is a float16 cache
(no scales: what llama.cpp keeps by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from common import bench_parser, decode_rate, load_bench, machine, parse_bench_args, report, table, write_results
from kvlab.build import make_caches
from kvlab.engine import compile_decode_step, generate

SETTINGS = [
    (None, None),
    (16, None),
    (8, "token"),
    (8, "channel"),
    (4, "token"),
    (4, "channel"),
    (2, "token"),
    (2, "channel"),
]


BITS_NAMES = {16: "16 (float16)"}


def storage_options(bits: int | None, axis: str | None) -> dict:
    return {k: v for k, v in dict(cache_bits=bits, key_quant_axis=axis).items() if v is not None}


def teacher_forced(model, ids: list[int], n_prompt: int, bits: int | None, axis: str | None) -> torch.Tensor:
    """Logits of every token after the prompt, each decoded through the (quantized) cache."""
    a, weight = model.config, model.tok_embeddings.weight
    model.setup_caches(
        make_caches(
            "full",
            a.n_layer,
            1,
            a.n_local_heads,
            len(ids),
            a.head_dim,
            weight.dtype,
            weight.device,
            **storage_options(bits, axis),
        )
    )
    model.cache_key = None
    with torch.no_grad():
        model(
            torch.tensor([ids[:n_prompt]], device=weight.device),
            torch.arange(n_prompt, device=weight.device)[None],
            prefill=True,
        )
        steps = [
            model(torch.tensor([[ids[p]]], device=weight.device), torch.tensor([[p]], device=weight.device))[0]
            for p in range(n_prompt, len(ids) - 1)
        ]
    return torch.cat(steps).float()


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--prompt_length", type=int, default=1000, help="prompt tokens per sample (default: 1000)")
    p.add_argument(
        "--decode_length", type=int, default=64, help="teacher-forced tokens scored per sample (default: 64)"
    )
    p.add_argument("--samples", type=int, default=4, help="samples at different offsets of the text (default: 4)")
    p.add_argument(
        "--speed_tokens",
        type=int,
        default=None,
        help="decoded tokens for the speed column (default: 32 on CPU, 256 on CUDA)",
    )
    return parse_bench_args(p, "quantization")


def measure_quality(model, samples: list[list[int]], prompt_length: int, device: torch.device) -> dict:
    """Per storage setting, per sample: (next-token loss, max abs logit error against the unquantized cache, top-1
    agreement with it), each sample's tokens after `prompt_length` teacher-forced through the cache."""
    quality = {s: [] for s in SETTINGS}
    for sample in samples:
        targets = torch.tensor(sample[prompt_length + 1 :], device=device)
        reference = teacher_forced(model, sample, prompt_length, None, None)
        for bits, axis in SETTINGS:
            logits = reference if bits is None else teacher_forced(model, sample, prompt_length, bits, axis)
            quality[bits, axis].append(
                (
                    F.cross_entropy(logits, targets).item(),
                    (logits - reference).abs().max().item(),
                    (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                )
            )
        print(f"sample done: full nll {quality[None, None][-1][0]:.4f}", file=sys.stderr)
    return quality


def main() -> None:
    args = parse_args()

    bench = load_bench(args.device, args.dtype)
    model, device, dtype = bench.model, bench.device, bench.dtype
    torch._dynamo.config.cache_size_limit = 64
    span = args.prompt_length + args.decode_length + 1
    samples = [bench.ids[i * span : (i + 1) * span] for i in range(args.samples)]

    quality = measure_quality(model, samples, args.prompt_length, device)

    step = compile_decode_step(device)
    speed_tokens = args.speed_tokens or (256 if device.type == "cuda" else 32)
    prompt = bench.ids[: args.prompt_length]
    rows = []
    full_nll = statistics.mean(q[0] for q in quality[None, None])
    for bits, axis in SETTINGS:
        spec = bench.spec("full", **storage_options(bits, axis))
        kwargs = dict(decode_step=step, max_seq_length=len(prompt) + speed_tokens)
        generate(model, [prompt], speed_tokens, spec, **kwargs)  # compiles
        run = generate(model, [prompt], speed_tokens, spec, **kwargs)
        nll = statistics.mean(q[0] for q in quality[bits, axis])
        report(
            rows,
            f"| {BITS_NAMES.get(bits, bits) if bits else 'none (' + bench.dtype_name + ')'} | {axis or '-'} | "
            f"{nll:.4f} | {nll - full_nll:+.4f} | {max(q[1] for q in quality[bits, axis]):.3f} | "
            f"{statistics.mean(q[2] for q in quality[bits, axis]):.3f} | "
            f"{run.full_cache_bytes / run.kv_cache_bytes:.2f}x | {decode_rate(run):.1f} |",
        )

    write_results(
        [
            f"# Quantized KV storage, SmolLM2-135M-Instruct, {machine(device, 'CPU')}, {dtype}",
            "",
            f"{args.samples} samples of the Paul Graham essays: {args.prompt_length}-token prompt, then "
            f"{args.decode_length} tokens teacher-forced through the cache (each decode step attends to "
            "dequantized keys/values).",
            "Memory: allocated cache bytes against the same cache in the model's dtype. Speed: compiled "
            f"decode, one run, {speed_tokens} tokens after a {args.prompt_length}-token prompt, batch 1.",
            "",
            *table(
                "bits | key scales | next-token loss | vs full | max abs logit error | top-1 agreement | memory "
                "saved | decode tokens/s",
                rows,
            ),
        ],
        args.out,
        "quantization",
        device,
    )


if __name__ == "__main__":
    main()

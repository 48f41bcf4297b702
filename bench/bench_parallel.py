"""Tensor parallelism against one process: decode speed and memory per rank, for a full and a
compressed cache, by running generate.py itself (one process, then torchrun over --ranks processes).

    python bench/bench_parallel.py [--ranks 2] [--prompt_chars 2400] [--new_tokens 32] [--device cuda]

Writes bench/results/parallel_<device>.md. On the CPU every run gets the same cores: one process uses
all of them as threads, each of N ranks 1/N of them (OMP_NUM_THREADS), so the ratio shows what the
collectives (two all-reduces per layer and step, over gloo) cost against the work they divide.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import bench_parser, bench_text, parse_bench_args, table, write_results

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("full", "heavy_hitter", "kvcompress")
PATTERNS = {
    "params": r"\(([\d.]+)M params",
    "prompt": r"prefill: (\d+) tokens",
    "decode": r"decode: \d+ tokens in [\d.]+ s \(([\d.]+) tokens/s",
    "kv_mib": r"([\d.]+) MiB allocated",
    "peak_gib": r"peak [^:]+: ([\d.]+) GiB",
}


def run_generate(
    ranks: int, strategy: str, prompt: Path, new_tokens: int, device: str, threads: int
) -> dict[str, float]:
    """One generate.py run; the figures its report prints (rank 0's, under torchrun)."""
    flags = [
        "--prompt",
        str(prompt),
        "--max_new_tokens",
        str(new_tokens),
        "--ignore_eos",
        "--cache_strategy",
        strategy,
        "--device",
        device,
    ]
    if strategy != "full":
        flags += ["--max_cache_length", "0.5"]
    launch = (
        [sys.executable]
        if ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // ranks)))
    done = subprocess.run(
        [*launch, str(ROOT / "generate.py"), *flags], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"generate.py on {ranks} rank(s) failed:\n{done.stderr[-2000:]}")
    return {key: float(re.search(pattern, done.stderr).group(1)) for key, pattern in PATTERNS.items()}


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument(
        "--ranks", type=int, default=2, help="tensor-parallel ranks to compare with one process (default: 2)"
    )
    p.add_argument(
        "--prompt_chars",
        type=int,
        default=2400,
        help="prompt length in characters of the essay text (default: 2400, about 512 tokens)",
    )
    p.add_argument("--new_tokens", type=int, default=32, help="decoded tokens (default: 32)")
    args = parse_bench_args(p, "parallel")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    threads = os.cpu_count() or 1
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(bench_text()[: args.prompt_chars])
    rows = []
    for strategy in STRATEGIES:
        one = run_generate(1, strategy, Path(f.name), args.new_tokens, device, threads)
        many = run_generate(args.ranks, strategy, Path(f.name), args.new_tokens, device, threads)
        cells = [
            strategy,
            f"{one['params']:.1f} / {many['params']:.1f}",
            f"{one['kv_mib']:.1f} / {many['kv_mib']:.1f}",
            f"{one['peak_gib']:.2f} / {many['peak_gib']:.2f}",
            f"{one['decode']:.1f} / {many['decode']:.1f}",
            f"{many['decode'] / one['decode']:.2f}x",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    Path(f.name).unlink()
    header = (
        "cache | params per rank (M): 1 / N | KV MiB per rank: 1 / N | peak memory per rank (GiB): 1 / N | "
        "decode tokens/s: 1 / N | N ranks vs 1"
    )
    lines = [
        f"# Tensor parallelism, SmolLM2-135M-Instruct, {device}, {args.ranks} ranks vs 1 process, {threads} cores",
        "",
        f"generate.py, a {int(one['prompt'])}-token prompt, {args.new_tokens} tokens (eager), batch 1; "
        "compressed caches at --max_cache_length 0.5. Per-rank figures are rank 0's (the rank with the most KV "
        "heads when they do not divide).",
        "",
        *table(header, rows),
    ]
    write_results(lines, args.out, "parallel", torch.device(device))


if __name__ == "__main__":
    main()

"""Chunked prefill against one-shot prefill, same strategy and budget: peak KV bytes, peak RSS, prefill seconds.

    python bench/bench_chunked_prefill.py   # keydiff, budget 512, prompts of 2K/4K/8K, chunks 256 and 512

Each row runs in a process of its own (peak RSS is a process's high-water mark): the default model in
float32, one prompt of N - 1 tokens of the benchmark prose and 1 generated token (N in all, 8192 being
the model's context). Reported per row:
- peak KV bytes: the most, at any point of the prefill, of every layer's cache buffers plus the keys and
  values of the layer being prefilled (one-shot: the whole prompt's; chunked: the held tokens' and the
  chunk's, `KVCache.prefill_chunk`), counted from the tensors themselves;
- peak RSS of the process, and its RSS once the model is loaded and warmed up (the difference is what the
  prefill adds);
- prefill seconds, the median of `--repeats` runs after a warm-up on a short prompt.

Writes bench/results/chunked_prefill_cpu.md and .json: peak_kv_bytes_{oneshot,chunked}_N, prefill_s_{oneshot,chunked}_N
(chunk 512) for N in 2048, 4096, 8192, and every row under "rows".
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys

import torch

from common import bench_parser, load_bench, machine, parse_bench_args, row, table, write_results
from kvlab.engine import generate
from kvlab.eviction import EvictionCache
from kvlab.kvcompress import KVCompressCache

SIZES = (2048, 4096, 8192)
CHUNKS = (256, 512)


def rss_mb() -> float:
    """This process's peak resident memory so far, in MB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def count_kv_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Record the peak KV bytes of the prefills that follow (see the module's doc): every prefill call adds the
    bytes in flight to those of every layer's buffers (the paged pool's, once, for kvcompress)."""
    peak = {"bytes": 0}

    def held() -> int:
        return sum(block.attention.kv_cache.nbytes() for block in model.layers)

    def counted(attend):
        def seen(keys, values, key_pos):
            peak["bytes"] = max(peak["bytes"], held() + keys.nbytes + values.nbytes)
            return attend(keys, values, key_pos)

        return seen

    for cls in (EvictionCache, KVCompressCache):
        one_shot, chunked = cls.prefill, cls.prefill_chunk

        def prefill(self, input_pos, k, v, q, *args, one_shot=one_shot):
            one_shot(self, input_pos, k, v, q, *args)  # after it: the paged pool is sized at its first layer's
            peak["bytes"] = max(peak["bytes"], held() + k.nbytes + v.nbytes)

        def prefill_chunk(self, input_pos, k, v, q, attend, *args, chunked=chunked):
            return chunked(self, input_pos, k, v, q, counted(attend), *args)

        cls.prefill, cls.prefill_chunk = prefill, prefill_chunk
    return peak


def measure(strategy: str, budget: int, size: int, chunk: int | None, repeats: int) -> dict[str, float]:
    """One row, in this process: peak KV bytes, RSS before and at peak (MB), median prefill seconds."""
    bench = load_bench("cpu", "float32")
    settings = {"max_cache_length": budget} | ({} if chunk is None else {"prefill_chunk": chunk})
    spec = bench.spec(strategy, **settings)
    prompt = bench.ids[: size - 1]
    if len(prompt) < size - 1:
        raise SystemExit(f"the benchmark text has {len(bench.ids)} tokens; {size - 1} needed")
    generate(bench.model, [bench.ids[:256]], 1, spec)
    rss_before = rss_mb()
    peak = count_kv_bytes(bench.model)
    seconds = [generate(bench.model, [prompt], 1, spec).prefill_seconds for _ in range(repeats)]
    cfg = bench.model.config
    # a key and a value in every layer
    slot_bytes = 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * bench.dtype.itemsize
    return {
        "peak_kv_bytes": peak["bytes"],
        "rss_loaded_mb": rss_before,
        "rss_peak_mb": rss_mb(),
        "prefill_s": statistics.median(seconds),
        "slot_bytes": slot_bytes,
    }


def run_row(args, size: int, chunk: int | None) -> dict[str, float]:
    """`measure` in a new process."""
    command = [sys.executable, __file__, "--row", json.dumps([args.strategy, args.budget, size, chunk, args.repeats])]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
        return
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--strategy", default="keydiff", help="the cache strategy of every row (default: keydiff)")
    p.add_argument("--budget", type=int, default=512, help="slots per layer and KV head (default: 512)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed prefills per row, after a warm-up; the median is reported (default: 3)",
    )
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=SIZES,
        help="N, the prompt + generated tokens of each row (default: 2048 4096 8192)",
    )
    args = parse_bench_args(p, "chunked_prefill")
    results: dict = {"strategy": args.strategy, "budget": args.budget, "cpu": machine(torch.device("cpu")), "rows": {}}
    rows = []
    for size in args.sizes:
        for chunk in (None, *CHUNKS):
            label = "one-shot" if chunk is None else f"chunk {chunk}"
            got = run_row(args, size, chunk)
            results["rows"][f"{size}/{label}"] = got
            kind = "oneshot" if chunk is None else "chunked"
            if chunk in (None, 512):
                results[f"peak_kv_bytes_{kind}_{size}"], results[f"prefill_s_{kind}_{size}"] = (
                    got["peak_kv_bytes"],
                    got["prefill_s"],
                )
            rows.append(
                row(
                    size,
                    label,
                    f"{got['peak_kv_bytes'] / 2**20:.1f}",
                    f"{got['rss_loaded_mb']:.0f}",
                    f"{got['rss_peak_mb']:.0f}",
                    f"{got['prefill_s']:.2f}",
                )
            )
            print(rows[-1], file=sys.stderr, flush=True)
    kv_slots = got["slot_bytes"] * (args.budget + max(CHUNKS))  # every layer's budget + chunk slots, keys and values
    results["budget_plus_chunk_bytes"] = kv_slots
    lines = [
        f"# Chunked prefill against one-shot ({results['cpu']})",
        "",
        f"torch {torch.__version__}; SmolLM2-135M-Instruct in float32; --cache_strategy {args.strategy} "
        f"--max_cache_length {args.budget}; a prompt of N - 1 tokens and 1 generated token; median of "
        f"{args.repeats} prefills after a warm-up. Peak KV: every layer's cache buffers plus the keys and "
        "values of the layer being prefilled (the prompt's, or the held + chunk's). RSS: the process's, once "
        f"the model is loaded and warmed up, and its peak. Budget + chunk {max(CHUNKS)} slots in every layer: "
        f"{kv_slots / 2**20:.1f} MiB.",
        "",
        *table("N | prefill | peak KV (MiB) | RSS loaded (MB) | RSS peak (MB) | prefill (s)", rows, align="---:"),
    ]
    write_results(lines, args.out, "chunked_prefill", torch.device("cpu"), results=results)


if __name__ == "__main__":
    main()

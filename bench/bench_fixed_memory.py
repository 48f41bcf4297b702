"""Throughput at a fixed KV memory (KV-Compress's measure): the decode tokens/s each method reaches when its cache may
use the bytes of `--memory_sequences` full sequences, against the full cache's in the same bytes.

    python bench/bench_fixed_memory.py          # full, kvzip, kvzip_uniform, ada_expected_attention, kvcompress
    python bench/bench_fixed_memory.py --methods kvzip kvcompress --ratios 0.75 0.875

`--requests` prompts of `--prompt_length` tokens (stretches of the benchmark's essays), `--new_tokens` greedy tokens
each (stop tokens ignored), the decode step compiled (`--eager`: not) and warmed on short prompts at every batch size
first, so no cell pays a compilation (kvcompress's serving loop decodes eagerly: its rows in flight and block tables'
widths change from step to step). The full cache and the configs of configs/ at kvpress's compression ratio (their
compact store: each head holds what it keeps, every decoded token kept) run static batches of as many sequences as the
memory holds: a sequence holds (1 - ratio) x its prompt + its new tokens, so at most memory_sequences x (prompt + new) /
that many (the bytes each batch allocated are in the table). kvcompress serves every request by continuous batching in a
block pool of the same bytes, its budget 1 - ratio of each sequence's tokens (prompt and decoded alike), compressing
every 16 steps. Decode tokens/s: tokens produced by decode steps over their time; overall: every generated token over
the whole run, prefills (and KVzip's scoring) included.

Each cell is written to bench/results/real_bytes_<device>.json as it finishes ("fixed_memory": settings and cells;
"throughput_at_fixed_memory": decode tokens/s over the full cache's; "throughput_at_fixed_memory_overall" beside it)
and a rerun with the same settings skips the cells it holds (`--fresh`: measure again). The table:
bench/results/fixed_memory_<device>.md.
"""

from __future__ import annotations

import json
import math
import time

from bench_real_bytes import spec as config_spec

from common import RESULTS, bench_parser, load_bench, machine, mean, parse_bench_args, row, table, write_results
from kvlab.engine import compile_decode_step, decode_one_token, generate, sync
from kvlab.serving import serve

METHODS = ["full", "kvzip", "kvzip_uniform", "ada_expected_attention", "kvcompress"]
RATIOS = [0.5, 0.75, 0.875]
BLOCK = 16  # kvcompress's block size and compression interval


def build_parser():
    p = bench_parser(__doc__)
    p.add_argument(
        "--methods", nargs="+", default=METHODS, help=f"full and configs of configs/ (default: {' '.join(METHODS)})"
    )
    p.add_argument(
        "--ratios", nargs="+", type=float, default=RATIOS, help="compression ratios (default: 0.5 0.75 0.875)"
    )
    p.add_argument("--prompt_length", type=int, default=2000, help="prompt tokens per request (default: 2000)")
    p.add_argument("--new_tokens", type=int, default=512, help="tokens generated per request (default: 512)")
    p.add_argument("--requests", type=int, default=16, help="requests per cell (default: 16)")
    p.add_argument("--memory_sequences", type=int, default=4, help="KV memory, in full sequences (default: 4)")
    p.add_argument("--eager", action="store_true", help="decode eagerly (default: the compiled step)")
    p.add_argument("--fresh", action="store_true", help="measure every cell again (default: keep the JSON's)")
    return p


def decode_step(bench, eager: bool):
    """The step every cell decodes with: compiled (its own copy per cell) unless `eager`."""
    return decode_one_token if eager else compile_decode_step(bench.device)


def static_cell(bench, args, prompts: list[list[int]], method: str, ratio: float) -> dict:
    """Static batches of as many sequences as the memory holds, each through `method` at `ratio` (full: ratio 0)."""
    held = (1 - ratio) * args.prompt_length + args.new_tokens
    batch = min(len(prompts), math.floor(args.memory_sequences * (args.prompt_length + args.new_tokens) / held))
    spec = None if method == "full" else config_spec(bench, method, ratio, "compact")
    step = decode_step(bench, args.eager)
    seq = args.prompt_length + args.new_tokens
    sizes = [min(batch, len(prompts) - start) for start in range(0, len(prompts), batch)]  # each decodes as long
    for size in set(sizes):  # compiled once each
        generate(bench.model, [p[:64] for p in prompts[:size]], 4, spec, decode_step=step, max_seq_length=seq)
    t0 = time.perf_counter()
    decoded, decode_seconds, kv_bytes = 0, 0.0, 0
    for start in range(0, len(prompts), batch):
        result = generate(
            bench.model, prompts[start : start + batch], args.new_tokens, spec, decode_step=step, max_seq_length=seq
        )
        decoded += len(result.tokens) * result.decode_steps
        decode_seconds += result.first_step_seconds + result.decode_seconds
        kv_bytes = max(kv_bytes, result.kv_cache_bytes)
    sync(bench.device)
    seconds = time.perf_counter() - t0
    return cell(
        f"static batches of {batch}",
        sizes,
        decoded,
        decode_seconds,
        len(prompts) * args.new_tokens,
        seconds,
        kv_bytes,
    )


def paged_cell(bench, args, prompts: list[list[int]], ratio: float) -> dict:
    """kvcompress by continuous batching in a block pool of the memory's bytes, every request admitted as it fits;
    decoded eagerly (the rows in flight and each block table's width change from step to step)."""
    cfg = bench.model.config
    seq = args.prompt_length + args.new_tokens
    pool = args.memory_sequences * cfg.n_layer * cfg.n_local_heads * -(-seq // BLOCK)
    options = dict(kvc_pool_blocks=pool, kvc_block_size=BLOCK, kvc_compress_every=BLOCK)
    spec = bench.spec("kvcompress", 1 - ratio, **options)
    result = serve(bench.model, prompts, args.new_tokens, len(prompts), spec, max_seq_length=seq)
    flight = result.rows_in_flight
    engine = f"continuous batching, {pool} blocks"
    kv_bytes = result.peak_blocks * result.block_bytes
    return cell(engine, flight, sum(flight), result.decode_seconds, result.generated, result.seconds, kv_bytes)


def cell(
    engine: str,
    flight: list[int],
    decoded: int,
    decode_seconds: float,
    generated: int,
    seconds: float,
    kv_bytes: int,
) -> dict:
    """A cell's record: the engine, sequences in flight per step (mean, most), decode and overall tokens/s, KV MiB."""
    return {
        "engine": engine,
        "in_flight_mean": mean(flight),
        "in_flight_max": max(flight),
        "decode_tok_s": decoded / decode_seconds,
        "overall_tok_s": generated / seconds,
        "seconds": seconds,
        "kv_mib": kv_bytes / 2**20,
    }


def measure(bench, args, prompts: list[list[int]], key: str) -> dict:
    """The cell `key`: "full", or "<method>@<ratio>"."""
    method, _, ratio = key.partition("@")
    if method == "kvcompress":
        return paged_cell(bench, args, prompts, float(ratio))
    return static_cell(bench, args, prompts, method, float(ratio or 0))


def against(cell: dict, full: dict | None, field: str) -> str:
    return f"{cell[field] / full[field]:.2f}x" if full else "-"


def order(key: str) -> tuple[int, float]:
    """A cell's place in the table: the full cache first, then by method as METHODS lists them, then by ratio."""
    method, _, ratio = key.partition("@")
    return (METHODS.index(method) if method in METHODS else len(METHODS), float(ratio or 0))


def markdown(found: dict) -> list[str]:
    s = found["settings"]
    full = found["cells"].get("full")
    rows = []
    for key, c in sorted(found["cells"].items(), key=lambda item: order(item[0])):
        cells = (key, c["engine"], f"{c['in_flight_mean']:.1f}", c["in_flight_max"], f"{c['kv_mib']:.0f}")
        decode, overall = (f"{c[f]:.1f} | {against(c, full, f)}" for f in ("decode_tok_s", "overall_tok_s"))
        rows.append(row(*cells, decode, overall))
    return [
        f"# Throughput at a fixed KV memory, SmolLM2-135M-Instruct, {s['machine']}, float32",
        "",
        f"{s['requests']} requests of {s['prompt_length']} prompt tokens, {s['new_tokens']} new tokens each; "
        f"KV memory of {s['memory_sequences']} full sequences ({s['memory_mib']:.0f} MiB); decode step {s['decode']}. "
        "Rebuild: `python bench/bench_fixed_memory.py`.",
        "",
        *table(
            "cell | engine | sequences in flight (mean) | at most | KV MiB allocated | decode tokens/s | vs full | "
            "overall tokens/s | vs full",
            rows,
        ),
    ]


def main() -> None:
    args = parse_bench_args(build_parser(), "fixed_memory")
    bench = load_bench(args.device, args.dtype)
    cfg = bench.model.config
    text = bench.ids
    if len(text) < args.prompt_length * 2:
        raise SystemExit(f"the benchmark text has {len(text)} tokens, too few for --prompt_length {args.prompt_length}")
    stride = (len(text) - args.prompt_length) // max(args.requests - 1, 1)
    prompts = [text[i * stride : i * stride + args.prompt_length] for i in range(args.requests)]
    sequence_bytes = 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * 4 * (args.prompt_length + args.new_tokens)
    settings = dict(
        machine=machine(bench.device),
        prompt_length=args.prompt_length,
        new_tokens=args.new_tokens,
        requests=args.requests,
        memory_sequences=args.memory_sequences,
        decode="eager" if args.eager else "compiled",
        memory_mib=args.memory_sequences * sequence_bytes / 2**20,
    )
    path = (
        args.out or RESULTS / f"fixed_memory_{bench.device.type}.md"
    ).parent / f"real_bytes_{bench.device.type}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    found = results.get("fixed_memory", {})
    if args.fresh or found.get("settings") != settings:
        found = {"settings": settings, "cells": {}}
    keys = ["full" if m == "full" else f"{m}@{r}" for m in args.methods for r in ([0] if m == "full" else args.ratios)]
    for key in keys:
        if key in found["cells"]:
            continue
        print(f"measuring {key}", flush=True)
        found["cells"][key] = measure(bench, args, prompts, key)
        results["fixed_memory"] = found
        full = found["cells"].get("full")
        for name, field in (
            ("throughput_at_fixed_memory", "decode_tok_s"),
            ("throughput_at_fixed_memory_overall", "overall_tok_s"),
        ):
            results[name] = {
                k: round(c[field] / full[field], 2) for k, c in found["cells"].items() if full and k != "full"
            }
        path.write_text(json.dumps(results, indent=1) + "\n")
    write_results(markdown(found), args.out, "fixed_memory", bench.device)


if __name__ == "__main__":
    main()

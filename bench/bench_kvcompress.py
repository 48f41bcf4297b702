"""KV-Compress on the default model: physical KV bytes against the compression rate, and decode
throughput with a fixed KV memory budget (how many sequences fit, total tokens/s).

    python bench/bench_kvcompress.py [--prompt_length 2000] [--requests 32] [--memory_sequences 4] [--device cuda]

Writes bench/results/kvcompress_<device>.md.

1. Bytes: one prompt, `--new_tokens` greedy tokens, per compression rate r (each sequence's budget is
   1/r of its tokens x layers x KV heads): the blocks kvcompress holds at the end x block bytes (and the
   bytes its default pool allocates, sized from the budget), against a full cache's bytes; beside it the dense buffers
   of uniform SnapKV and of dense Ada-SnapKV (whose buffers must be as wide as the largest head's share) at the same
   budget.
2. Throughput: `--requests` prompts of `--prompt_length` tokens (different stretches of one text), each
   generating `--new_tokens` tokens (stop tokens ignored), with KV memory for `--memory_sequences`
   uncompressed sequences. The full cache runs static batches of that many; kvcompress serves them by
   continuous batching in a block pool of the same bytes, at 1x (paging alone), 4x and 8x, compressing
   every block_size steps (so a head outgrows its budget by one block at most, as admission reserves).
   Decode tokens/s (decode steps only, compression included) and overall tokens/s (prefills included).
"""

from __future__ import annotations

import time

from common import Bench, bench_parser, load_bench, mean, parse_bench_args, report, table, write_results
from kvlab.engine import generate, sync
from kvlab.recording import RecordedPrefill
from kvlab.serving import serve

SNAPKV = dict(prompt_compression_strategy="snapkv")


def bytes_table(bench: Bench, prompt: list[int], new_tokens: int, rates: list[int]) -> list[str]:
    shared = RecordedPrefill()
    model = bench.model
    full = generate(model, [prompt], new_tokens, recorded=shared)
    rows = []
    for rate in rates:
        length = 1.0 / rate
        paged = generate(model, [prompt], new_tokens, bench.spec("kvcompress", length), recorded=shared)
        blocks, in_use = paged.cache_stats["kvcompress: blocks in use"], paged.cache_stats["kvcompress: bytes in use"]
        dense = [
            generate(model, [prompt], new_tokens, bench.spec("heavy_hitter", length, **o), recorded=shared)
            for o in (SNAPKV, {**SNAPKV, "head_budget": "adakv"})
        ]
        held = mean(paged.tokens_held)
        spread = f"{min(paged.tokens_held):.0f}-{max(paged.tokens_held):.0f}"
        report(
            rows,
            f"| {rate}x | {held:.0f} ({spread}) | {blocks} | {in_use / 2**20:.1f} | "
            f"{full.full_cache_bytes / in_use:.2f}x | {paged.kv_cache_bytes / 2**20:.1f} | "
            f"{dense[0].kv_cache_bytes / 2**20:.1f} | {dense[1].kv_cache_bytes / 2**20:.1f} |",
        )
    return [
        f"## Physical KV bytes, one {len(prompt)}-token prompt + {new_tokens} tokens (full cache: "
        f"{full.full_cache_bytes / 2**20:.1f} MiB)",
        "",
        *table(
            "rate | tokens held per layer and head (layer range) | blocks in use | kvcompress MiB in use | full "
            "/ kvcompress in use | kvcompress pool MiB allocated (default pool) | dense SnapKV MiB | dense "
            "Ada-SnapKV MiB",
            rows,
        ),
    ]


def throughput_table(
    bench: Bench, prompts: list[list[int]], new_tokens: int, memory_sequences: int, max_batch: int
) -> list[str]:
    model = bench.model
    cfg = model.config
    block = 16
    seq = len(prompts[0]) + new_tokens
    pool = memory_sequences * cfg.n_layer * cfg.n_local_heads * -(-seq // block)
    t0 = time.perf_counter()
    generated = decoded = 0
    decode_seconds = 0.0
    for start in range(0, len(prompts), memory_sequences):
        result = generate(model, prompts[start : start + memory_sequences], new_tokens, max_seq_length=seq)
        generated += sum(map(len, result.tokens))
        decoded += len(result.tokens) * result.decode_steps
        decode_seconds += result.first_step_seconds + result.decode_seconds
    sync(model.tok_embeddings.weight.device)
    full_speed, full_decode = generated / (time.perf_counter() - t0), decoded / decode_seconds
    rows = []
    report(
        rows,
        f"| full cache, static batches | {memory_sequences} | {memory_sequences} | {full_decode:.1f} | 1.00x | "
        f"{full_speed:.1f} | 1.00x | 0 |",
    )
    for rate in (1, 4, 8):
        spec = bench.spec(
            "kvcompress", 1.0 / rate, kvc_pool_blocks=pool, kvc_block_size=block, kvc_compress_every=block
        )
        result = serve(model, prompts, new_tokens, max_batch, spec, max_seq_length=seq)
        flight = result.rows_in_flight
        speed, decode = result.generated / result.seconds, sum(flight) / result.decode_seconds
        report(
            rows,
            f"| kvcompress {rate}x, continuous batching | {mean(flight):.1f} | {max(flight)} | {decode:.1f} | "
            f"{decode / full_decode:.2f}x | {speed:.1f} | {speed / full_speed:.2f}x | {result.preemptions} |",
        )
    return [
        f"## Throughput with the KV memory of {memory_sequences} full sequences ({pool} blocks of {block})",
        "",
        f"{len(prompts)} requests of {len(prompts[0])} prompt tokens, {new_tokens} new tokens each (stop tokens "
        "ignored). Decode tokens/s: tokens produced by decode steps over their time (compression and block "
        "allocation included); overall: every generated token over the whole run, prefills included "
        "(kvcompress prefills one admitted request at a time, the full cache a batch).",
        "",
        *table(
            "engine | sequences in flight (mean) | at most | decode tokens/s | vs full | overall tokens/s | vs "
            "full | preempted",
            rows,
        ),
    ]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--prompt_length", type=int, default=2000, help="prompt tokens per request (default: 2000)")
    p.add_argument("--new_tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    p.add_argument(
        "--rates",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="compression rates for the bytes table (default: 1 2 4 8 16)",
    )
    p.add_argument("--requests", type=int, default=16, help="requests in the throughput run (default: 16)")
    p.add_argument("--memory_sequences", type=int, default=4, help="KV memory, in full sequences (default: 4)")
    p.add_argument("--max_batch", type=int, default=32, help="most sequences kvcompress decodes at once (default: 32)")
    args = parse_bench_args(p, "kvcompress")

    bench = load_bench(args.device, args.dtype)
    text = bench.ids
    if len(text) < args.prompt_length * 2:
        raise SystemExit(f"the benchmark text has {len(text)} tokens, too few for --prompt_length {args.prompt_length}")
    stride = (len(text) - args.prompt_length) // max(args.requests - 1, 1)
    prompts = [text[i * stride : i * stride + args.prompt_length] for i in range(args.requests)]
    lines = [
        f"# KV-Compress, SmolLM2-135M-Instruct, {bench.device.type}, {bench.dtype_name}",
        "",
        *bytes_table(bench, prompts[0], args.new_tokens, args.rates),
        *throughput_table(bench, prompts, args.new_tokens, args.memory_sequences, args.max_batch),
    ]
    write_results(lines, args.out, "kvcompress", bench.device)


if __name__ == "__main__":
    main()

"""Bytes held by uneven budgets: the KV bytes each method allocates after prefill, against a full cache's and against
the dense form's (`--kv_store dense`), and decode speed of the compact store against the dense one.

    python bench/bench_real_bytes.py                                   # the default methods at 0.5, 0.75, 0.875
    python bench/bench_real_bytes.py --methods kvzip --ratios 0.75 --decode_lengths 2048

Each method is a config of configs/ at kvpress's compression ratio (every decoded token kept), on a `--tokens`-token
prompt of the benchmark's essays, `--new_tokens` greedy tokens, in the model's dtype (float32: the full cache's
bytes are float32 too). Both forms share one recorded prefill (KVzip's repeat is scored once), must give the same
tokens, and the bytes are what the caches allocated (`Generation.kv_cache_bytes`: keys and values, the compact
form's scratch row per layer included). Decode: `--decode_method` at `--decode_ratio` on prompts of
`--decode_lengths` tokens, eager (or `--compile`d), the median of `--repeats` runs of each form, alternated.

`--parts` reruns some of the three (bytes, decode, longdoc) into the existing JSON, the tables rebuilt from it.
Writes bench/results/real_bytes_<device>.md and .json: {method: {ratio: {"bytes_held_over_full", "dense_over_full",
"same_tokens", ...}}, "methods": [...], "decode": {"lengths": {length: {"compact_tok_s", "dense_tok_s", "ratio"}},
its settings}, "kvzip_longdoc" (defaults: recorded in chunks) and "kvzip_longdoc_one_shot": {"prefill_s",
"plain_prefill_s", "peak_rss_mb", "bytes_held_over_full", "answer_right", ...}}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from common import (
    RESULTS,
    WEIGHTS,
    bench_parser,
    decode_rate,
    load_bench,
    machine,
    parse_bench_args,
    row,
    table,
    write_results,
)
from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config, resolve_settings
from kvlab.engine import compile_decode_step, generate
from kvlab.recording import RecordedPrefill

METHODS = ["kvzip", "ada_expected_attention", "pyramidkv"]
PARTS = ["bytes", "decode", "longdoc"]
RATIOS = [0.5, 0.75, 0.875]


def build_parser():
    p = bench_parser(__doc__, weights=True)
    p.add_argument("--methods", nargs="+", default=METHODS, help=f"configs of configs/ (default: {' '.join(METHODS)})")
    p.add_argument(
        "--ratios", nargs="+", type=float, default=RATIOS, help="compression ratios (default: 0.5 0.75 0.875)"
    )
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the bytes rows (default: 2048)")
    p.add_argument("--new_tokens", type=int, default=32, help="tokens generated per run (default: 32)")
    p.add_argument("--decode_method", default="kvzip", help="the config whose decode is timed (default: kvzip)")
    p.add_argument("--decode_ratio", type=float, default=0.75, help="its compression ratio (default: 0.75)")
    p.add_argument(
        "--decode_lengths", nargs="*", type=int, default=[2048, 8000], help="its prompt lengths (default: 2048 8000)"
    )
    p.add_argument("--decode_tokens", type=int, default=64, help="tokens generated per timed run (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each form (default: 3)")
    p.add_argument("--compile", action="store_true", help="time the compiled decode step (default: eager)")
    p.add_argument(
        "--longdoc_tokens", type=int, default=7300, help="kvzip on bench_longdoc's document of this many tokens"
    )
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=PARTS,
        help="what to measure; the rest kept from the JSON (default: all)",
    )
    return p


def spec(bench, method: str, ratio: float, store: str):
    """The config `method` at compression ratio `ratio` with `--kv_store store`."""
    settings = resolve_settings({"compression_ratio": ratio, "kv_store": store}, load_cache_config(method))
    return cache_spec(settings, bench.model.config.n_layer, bench.tokenizer)


def bytes_cells(bench, args) -> dict:
    """Per method and ratio: compact and dense bytes against the full cache's, and whether both gave the same tokens."""
    prompt = bench.ids[: args.tokens]
    results = {}
    for method in args.methods:
        recorded = RecordedPrefill()  # one prefill (and one KVzip scoring) for every ratio and form
        results[method] = {}
        for ratio in args.ratios:
            compact, dense = (
                generate(bench.model, [prompt], args.new_tokens, spec(bench, method, ratio, store), recorded=recorded)
                for store in ("compact", "dense")
            )
            results[method][str(ratio)] = cell = {
                "bytes_held_over_full": compact.kv_cache_bytes / compact.full_cache_bytes,
                "dense_over_full": dense.kv_cache_bytes / dense.full_cache_bytes,
                "compact_mib": compact.kv_cache_bytes / 2**20,
                "dense_mib": dense.kv_cache_bytes / 2**20,
                "full_mib": compact.full_cache_bytes / 2**20,
                "target": 1 - ratio + 0.03,
                "same_tokens": compact.tokens == dense.tokens,
            }
            print(method, ratio, cell, file=sys.stderr)
    return results


def decode_cells(bench, args) -> dict:
    """Decode tokens/s of the compact store against the dense one, per prompt length (alternated runs)."""
    results = {}
    step = (
        {"decode_step": compile_decode_step(bench.device)} if args.compile else {}
    )  # one step for every length and form
    for length in args.decode_lengths:
        prompt = (bench.ids * (length // len(bench.ids) + 1))[:length]
        recorded = RecordedPrefill()
        specs = {store: spec(bench, args.decode_method, args.decode_ratio, store) for store in ("compact", "dense")}
        rates: dict[str, list[float]] = {"compact": [], "dense": []}
        tokens = {}
        for i in range(args.repeats):
            for store in ("compact", "dense")[:: 1 if i % 2 == 0 else -1]:
                result = generate(bench.model, [prompt], args.decode_tokens, specs[store], recorded=recorded, **step)
                rates[store].append(decode_rate(result))
                tokens[store] = result.tokens
        compact, dense = statistics.median(rates["compact"]), statistics.median(rates["dense"])
        same = tokens["compact"] == tokens["dense"]
        results[str(length)] = {
            "compact_tok_s": compact,
            "dense_tok_s": dense,
            "ratio": compact / dense,
            "same_tokens": same,
        }
        print(length, results[str(length)], file=sys.stderr)
    settings = ("decode_method", "decode_ratio", "decode_tokens", "repeats", "compile", "weights")
    return {"lengths": results, "machine": machine(bench.device), **{name: getattr(args, name) for name in settings}}


def decode_key(weights: str) -> str:
    """The JSON key of the decode part run on these weights: "decode" for the float checkpoint."""
    return "decode" if weights == "float" else f"decode_{weights}"


def longdoc_rows(bench, tokens: int) -> dict:
    """KVzip (the model-wide ranking) at 1,024 slots on bench_longdoc.py's document, each side a process of its own
    (generate.py --chat, 32 tokens): with generate.py's defaults ("kvzip_longdoc": float16, the prompt recorded 512
    tokens at a time) and one-shot ("kvzip_longdoc_one_shot": the prompt recorded at once): prefill seconds against
    the full cache's (generate.py's defaults), peak RSS, the bytes held against a full cache, and whether the answer
    is right."""
    from bench_longdoc import document, kvlab_row

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(document(bench.tokenizer, tokens))
    kvzip = ["--cache_config", "kvzip", "--max_cache_length", "1024"]
    try:
        plain = kvlab_row(f.name, 32, [], False)
        forms = {key: kvlab_row(f.name, 32, kvzip + extra, False) for key, extra in LONGDOC_FORMS.items()}
    finally:
        os.unlink(f.name)
    return {
        key: {
            "prefill_s": run["prefill_s"],
            "plain_prefill_s": plain["prefill_s"],
            "peak_rss_mb": run["peak_rss_mb"],
            "bytes_held_over_full": round(run["kv_mib"] / (run["full_mib"] / 2), 3),  # a full cache in float16 too
            "answer_right": run["answer_right"],
            "wall_s": run["wall_s"],
            "plain_peak_rss_mb": plain["peak_rss_mb"],
            "tokens": tokens,
            "flags": run["flags"],
            "machine": machine(bench.device),
        }
        for key, run in forms.items()
    }


LONGDOC_FORMS = {"kvzip_longdoc": [], "kvzip_longdoc_one_shot": ["--prefill_chunk", "8192"]}


def markdown(results: dict) -> list[str]:
    """The tables of the parts the results hold (so a rerun of some parts rebuilds all of them)."""
    decode = [line for weights in WEIGHTS if decode_key(weights) in results for line in decode_lines(results, weights)]
    return ["# Bytes held by uneven budgets", "", *bytes_lines(results), *decode, *longdoc_lines(results)]


def bytes_lines(results: dict) -> list[str]:
    """The bytes part: what ran, then its table; nothing when it has not run."""
    if "methods" not in results:
        return []
    rows = []
    for method in results["methods"]:
        for ratio, cell in results[method].items():
            mib = [f"{cell[k]:.1f}" for k in ("full_mib", "dense_mib", "compact_mib")]
            shares = [f"{cell[k]:.3f}" for k in ("dense_over_full", "bytes_held_over_full", "target")]
            rows.append(row(method, ratio, *mib, *shares, "yes" if cell["same_tokens"] else "**no**"))
    return [
        f"{results['machine']}; {results['dtype']}; a {results['prompt_tokens']}-token prompt, "
        f"{results['new_tokens']} new tokens, "
        "kvpress's compression ratio (every decoded token kept). `python bench/bench_real_bytes.py`.",
        "",
        *table(
            "method | ratio | full MiB | dense MiB | compact MiB | dense / full | compact / full | target "
            "| same tokens",
            rows,
        ),
    ]


def longdoc_lines(results: dict) -> list[str]:
    """The long-document part: its setting, then a row per recording form; nothing when it has not run."""
    docs = [(key, results[key]) for key in LONGDOC_FORMS if key in results]
    if not docs:
        return []
    longdoc = [
        row(
            "recorded in chunks of 512 (default)" if key == "kvzip_longdoc" else "recorded at once",
            f"{doc['prefill_s']:.1f}",
            f"{doc['prefill_s'] / doc['plain_prefill_s']:.1f}x",
            f"{doc['peak_rss_mb']:.0f}",
            f"{doc['bytes_held_over_full']:.3f}",
            "yes" if doc["answer_right"] else "**no**",
        )
        for key, doc in docs
    ]
    doc = docs[0][1]
    return [
        f"KVzip (the model-wide ranking) at 1,024 slots on bench_longdoc.py's {doc['tokens']}-token document, "
        f"float16 cache, a process per row, its peak its own VmHWM, {doc['machine']}; the "
        f"full cache (generate.py's defaults): prefill {doc['plain_prefill_s']:.1f} s, peak "
        f"{doc['plain_peak_rss_mb']:.0f} MB:",
        "",
        *table("kvzip | prefill s | / full prefill | peak RSS MB | bytes / full | answer right", longdoc),
    ]


def decode_lines(results: dict, weights: str) -> list[str]:
    """The decode part run on `weights`: what ran, then its table."""
    decode = results[decode_key(weights)]
    timed = [
        row(
            length,
            f"{d['dense_tok_s']:.1f}",
            f"{d['compact_tok_s']:.1f}",
            f"{d['ratio']:.2f}x",
            "yes" if d["same_tokens"] else "**no**",
        )
        for length, d in decode["lengths"].items()
    ]
    return [
        f"Decode of {decode['decode_method']} at {decode['decode_ratio']}, {weights} weights, "
        f"{'compiled' if decode['compile'] else 'eager'}, {decode['decode_tokens']} tokens, median of "
        f"{decode['repeats']} runs (each run's first step, which compiles, left out), "
        f"{decode['machine']}:",
        "",
        *table("prompt tokens | dense tok/s | compact tok/s | compact / dense | same tokens", timed),
    ]


def main() -> None:
    args = parse_bench_args(build_parser(), "real_bytes")
    bench = load_bench(args.device, args.dtype, args.weights)
    out = args.out or RESULTS / f"real_bytes_{bench.device.type}.md"
    kept = out.with_suffix(".json")
    results = json.loads(kept.read_text()) if kept.is_file() else {}  # bench_fixed_memory.py's cells live here too
    if "bytes" in args.parts:  # the settings of the bytes rows, which the other parts leave as they were
        results.update(bytes_cells(bench, args), methods=args.methods, machine=machine(bench.device))
        results.update(prompt_tokens=args.tokens, new_tokens=args.new_tokens, dtype=bench.dtype_name)
    if "decode" in args.parts:
        results[decode_key(args.weights)] = decode_cells(bench, args)
    if "longdoc" in args.parts:
        results.update(longdoc_rows(bench, args.longdoc_tokens))
    write_results(markdown(results), out, "real_bytes", bench.device, results=results)


if __name__ == "__main__":
    main()

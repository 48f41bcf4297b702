"""The first compiled decode step, cold and warm: how long a new user waits for `generate.py --compile`.

    python bench/bench_first_compile.py   # 2 processes on an empty compile cache, 2 on the warm one,
                                          # 2 on the warm one with a prompt of another length

Each run is `python generate.py --compile --max_new_tokens 16` as a new process. The first runs on an
empty compile cache (a new $KVLAB_COMPILE_CACHE directory): Dynamo traces, Inductor generates and builds
C++, and generate.py saves the step whole (kvlab/saved_steps.py). The later ones load that saved step instead of
tracing; the last ones give a prompt of another length (the caches' slot axis is dynamic, so the saved step serves
it). Reported: the first decode step (the
compile, as generate.py reports it) and the process's wall time, load and warm-up included.

Writes bench/results/first_compile_cpu.md and .json: {"cold": {"first_step_s", "wall_s"}, "warm": {...},
"warm_other_length": {...}, "second_length_first_step_s": the last row's first step}.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import bench_parser, machine, parse_bench_args, row, table, write_results

ROOT = Path(__file__).resolve().parent.parent


# not the default's length
OTHER_PROMPT = "In a small village at the edge of a great forest, there lived an old clockmaker who"
ROWS = {"cold": [], "warm": [], "warm_other_length": ["--prompt", OTHER_PROMPT]}  # row -> generate.py's extra flags


def first_step(cache_dir: str, flags: list[str]) -> tuple[float, float]:
    """(the first decode step's seconds, the process's wall seconds) of one compiled generate.py run."""
    t0 = time.perf_counter()
    env = {**os.environ, "KVLAB_COMPILE_CACHE": cache_dir}
    command = [sys.executable, str(ROOT / "generate.py"), "--compile", "--max_new_tokens", "16", *flags]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    return float(re.search(r"first step \(compile\): ([\d.]+) s", proc.stderr)[1]), wall


def main() -> None:
    p = bench_parser(__doc__, dtype=False)
    p.add_argument("--repeats", type=int, default=2, help="processes per row; each row reports the median (default: 2)")
    args = parse_bench_args(p, "first_compile")
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for label, flags in ROWS.items():
            runs = []
            for i in range(args.repeats):
                cache = os.path.join(scratch, f"cold{i}") if label == "cold" else os.path.join(scratch, "cold0")
                runs.append(first_step(cache, flags))
            step, wall = (sorted(values)[len(values) // 2] for values in zip(*runs, strict=True))
            results[label] = {"first_step_s": step, "wall_s": wall}
            rows.append(row(label, f"{step:.1f}", f"{wall:.1f}"))
            print(rows[-1], flush=True)
    results["second_length_first_step_s"] = results["warm_other_length"]["first_step_s"]
    lines = [
        f"# The first compiled decode step, cold and warm ({machine(torch.device('cpu'))})",
        "",
        f"torch {torch.__version__}; `generate.py --compile --max_new_tokens 16` on the default prompt, each "
        f"run a new process; median of {args.repeats}. cold: an empty compile cache; warm: the cache a cold run "
        "filled; warm_other_length: that cache, a prompt of another length.",
        "",
        *table("compile cache | first decode step (s) | process wall (s)", rows, align="---:"),
    ]
    write_results(lines, args.out, "first_compile", torch.device("cpu"), results=results)


if __name__ == "__main__":
    main()

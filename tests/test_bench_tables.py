"""The benches' tables are rebuilt from their JSON: a rerun of some parts renders the parts the JSON holds."""

from __future__ import annotations

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_real_bytes as real_bytes  # noqa: E402

RESULTS = json.loads((ROOT / "bench/results/real_bytes_cpu.json").read_text())


def test_real_bytes_tables_are_the_committed_ones():
    assert "\n".join(real_bytes.markdown(RESULTS)) in (ROOT / "bench/results/real_bytes_cpu.md").read_text()


def test_real_bytes_renders_each_part_alone():
    """`--parts decode` or `longdoc` into an empty JSON: that part's table, and nothing of the others."""
    keys = [real_bytes.decode_key(weights) for weights in real_bytes.WEIGHTS]
    decode = {key: RESULTS[key] for key in keys if key in RESULTS}
    lines = real_bytes.markdown(decode)
    assert any(line.startswith("Decode of kvzip at 0.75") for line in lines)
    assert not any("KVzip (the model-wide ranking)" in line or "compact MiB" in line for line in lines)
    lines = real_bytes.markdown({"kvzip_longdoc": RESULTS["kvzip_longdoc"]})
    assert [line for line in lines if line.startswith("| recorded in chunks of 512")]
    assert not any(line.startswith("Decode of") or "compact MiB" in line for line in lines)

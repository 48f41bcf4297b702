"""scripts/sweep_tables.py: the docs' tables of an eval.py sweep, built from its records as tables.yaml lays them
out, and the committed ones match their records."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import sweep_tables  # noqa: E402


def write(sweep, config, run, job, records):
    config_dir = sweep / "SmolLM2-135M-Instruct" / config
    config_dir.mkdir(parents=True, exist_ok=True)
    with (config_dir / "records.jsonl").open("a") as f:
        for i, r in enumerate(records):
            task = job.split("@")[0]
            f.write(json.dumps({"run": run, "job": job, "id": f"{task}/{i}", "seconds": 30, **r}) + "\n")


def needle(score, prediction):
    return {"score": score, "prediction": prediction, "answers": ["1234567"], "compression": 2.0}


def ppl(nll, at500):
    return {"nll_sum": nll, "tokens": 10, "checkpoints": {"500": at500}, "compression": 4.0}


def test_tables_from_records_with_metrics_fields_and_overrides(tmp_path):
    write(tmp_path, "full", "full", "niah_single_2@2048", [needle(1.0, "1234567"), needle(1.0, "1234567")])
    write(tmp_path, "snapkv", "0.5", "niah_single_2@2048", [needle(1.0, "1234567"), needle(0.0, "12399")])
    write(tmp_path, "full", "full", "book@2048", [ppl(10.0, 3.0), ppl(10.0, 5.0)])
    write(tmp_path, "snapkv", "0.5", "book@2048", [ppl(20.0, 4.0), ppl(20.0, 6.0)])
    write(tmp_path / "other", "snapkv", "512", "niah_single_2@4096", [needle(0.0, "9")])
    specs = [
        {
            "corner": "niah",
            "rows": {"full": {"config": "full", "run": "full", "only": ["score"]}, "snapkv": {"config": "snapkv"}},
            "columns": {
                "score": {},
                "digits": {"cell": "{digits:.1f}%"},
                "4K": {"sweep": "other", "run": 512, "job": "niah_single_2@4096", "cell": "{score:.0f}"},
            },
            "run": 0.5,
            "job": "niah_single_2@2048",
            "cell": "{score:.0f} ({relative:.2f})",
        },
        {
            "rows": {"full": {"config": "full", "at": {"0.5": {"run": "full"}}}, "snapkv": {"config": "snapkv"}},
            "columns": {"0.5": {"run": 0.5}, "missing": {"run": 0.1}},
            "job": "book@2048",
            "cell": "{score:.3f} ({ppl_gap:+.1f}%, {ppl_diff:+.2f}) @500 {at500:.1f} {minutes:.0f} min",
        },
    ]
    (tmp_path / "tables.yaml").write_text(yaml.safe_dump(specs, sort_keys=False))
    text = sweep_tables.write_tables(tmp_path)
    assert text == (tmp_path / "tables.md").read_text()
    niah, book = text.split("\n\n")
    # digits: the whole needle 1, "12399" shares "123" of 7 digits; the 4K column: another sweep, run 512
    assert niah.splitlines() == [
        "| niah | score | digits | 4K |",
        "|---|---|---|---|",
        "| full | 100 (1.00) |  |  |",
        "| snapkv | 50 (0.50) | 71.4% | 0 |",
    ]
    # exp(mean nll per token): exp(1) full, exp(2) snapkv; the full row's 0.5 cell is its own run
    assert book.splitlines()[2:] == [
        "| full | 2.718 (+0.0%, +0.00) @500 4.0 1 min |  |",
        "| snapkv | 7.389 (+171.8%, +4.67) @500 5.0 1 min |  |",
    ]


def test_a_runs_jobs_pooled_at_a_length_against_the_full_cache_paired(tmp_path):
    """all@<length>: every generation example of a run at that length; gap: its mean score minus the full cache's,
    with the paired standard error over the examples both ran; removed: 1 - 1 / compression."""
    write(tmp_path, "full", "full", "vt@1024", [needle(1.0, "1234567")] * 2)
    write(tmp_path, "full", "full", "qa_1@1024", [needle(1.0, "x"), needle(0.0, "x")])
    write(tmp_path, "duo", "1.0", "vt@1024", [needle(1.0, "1234567"), needle(0.0, "9")])
    write(tmp_path, "duo", "1.0", "qa_1@1024", [needle(1.0, "x"), needle(1.0, "x")])
    write(tmp_path, "full", "full", "book@1024", [ppl(10.0, 3.0)])  # perplexities are not pooled
    specs = [
        {
            "rows": {"duo": {"config": "duo", "run": "1.0"}},
            "columns": {"all": {}, "vt": {"job": "vt@1024", "cell": "{score:.0f}"}},
            "job": "all@1024",
            "cell": "{score:.1f} {gap:+.1f} ± {gap_se:.1f} {removed:.2f}",
        }
    ]
    (tmp_path / "tables.yaml").write_text(yaml.safe_dump(specs, sort_keys=False))
    # per example duo - full: vt 0, -1; qa_1 0, +1 -> mean 0, SE = stdev(0, -1, 0, 1) / 2 = 0.41; compression 2.0
    assert sweep_tables.write_tables(tmp_path).splitlines()[2] == "| duo | 75.0 +0.0 ± 40.8 0.50 | 50 |"


def test_a_sweep_without_a_layout_says_so(tmp_path):
    with pytest.raises(ValueError, match="tables.yaml"):
        sweep_tables.write_tables(tmp_path)


@pytest.mark.parametrize("name", ["smollm2_2k", "duo_smollm2_1k_ruler13", "duo_smollm2_1k"])
def test_the_committed_sweep_tables_match_their_records(name):
    sweep = ROOT / "docs" / "sweeps" / name
    committed = (sweep / "tables.md").read_text()
    assert sweep_tables.write_tables(sweep) == committed

"""eval.py over ranks: two processes sharing one sweep equal one process, resume in one, stop together on an
error; a compiled sweep compiles once per config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from eval_helpers import KJV, M, job_records, jobs_under, run_eval, task_metrics, use_echo_task

from conftest import ROOT, two_ranks
from kvlab import evaluate
from kvlab.results import RECORDS, read_config_records, read_records

# A generation and a perplexity task, two configs, two batches of one example each per task: four units.
SWEEP = [
    "--tasks",
    "qa_1",
    "book_kjv",
    "--cache_config",
    "full",
    "recent_global",
    "--cache_sizes",
    "0.5",
    "--num_samples",
    "2",
    "--batch_size",
    "1",
]


SWEEP += ["--context_lengths", "256", "--ppl_prompt_tokens", "240"]


def torchrun_eval(out_dir, *args) -> subprocess.CompletedProcess:
    """eval.py under `torchrun --standalone --nproc_per_node 2` (gloo on the CPU, a free port per run)."""
    command = [*two_ranks("torch.distributed.run"), "eval.py", "--out_dir", str(out_dir), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def without_seconds(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "seconds"}


@pytest.fixture(scope="module")
def two_rank_sweep(tmp_path_factory):
    pytest.importorskip("long_context_eval")
    out = tmp_path_factory.mktemp("two_ranks")
    proc = torchrun_eval(out, *SWEEP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_ranks_share_a_sweep_out_and_equal_one_process(two_rank_sweep, tmp_path):
    """Each rank runs every other batch, with all configs, into its own files; together they hold the
    records, metrics and summary one process writes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # the threads each rank has: the same float sums
    try:
        run_eval(tmp_path, *SWEEP)
    finally:
        torch.set_num_threads(threads)
    runs = jobs_under(tmp_path)
    assert runs == [
        (f"{M}/{config}", run, task)
        for config, run in (("full", "full"), ("recent_global", "0.5"))
        for task in ("book_kjv+prompt240@256", "qa_1@256")
    ]
    assert jobs_under(two_rank_sweep) == runs
    for config, run, job in runs:
        one = [without_seconds(r) for r in job_records(tmp_path / config, run, job)]
        ranks = [
            [
                r
                for r in read_records(two_rank_sweep / config / f"records.rank{rank}.jsonl")
                if (r["run"], r["job"]) == (run, job)
            ]
            for rank in (0, 1)
        ]
        # batch 0 on rank 0, batch 1 on rank 1
        assert [[r["id"] for r in records] for records in ranks] == [[r["id"]] for r in one]
        assert [without_seconds(r) for records in ranks for r in records] == one
        assert not (two_rank_sweep / config / RECORDS).exists()
        metrics = [task_metrics(out / config, run, job) for out in (tmp_path, two_rank_sweep)]
        assert without_seconds(metrics[0]) == without_seconds(metrics[1])
    assert (two_rank_sweep / "summary.csv").read_text() == (tmp_path / "summary.csv").read_text()


@pytest.mark.slow
def test_a_sweep_of_two_ranks_resumes_in_one_process(two_rank_sweep, tmp_path, monkeypatch, capsys):
    """The ranks' files count as done for a rerun with another number of processes: nothing is recomputed
    but a missing example, which goes to the one process's own file."""
    shutil.copytree(two_rank_sweep, tmp_path, dirs_exist_ok=True)
    config_dir = tmp_path / f"{M}/recent_global"
    rank1 = read_records(config_dir / "records.rank1.jsonl")
    removed = [r for r in rank1 if r["job"] == "qa_1@256"]
    (config_dir / "records.rank1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rank1 if r["job"] != "qa_1@256")
    )
    generated, scored = [], []
    original_generate, original_nll = evaluate.generate, evaluate.document_nll
    monkeypatch.setattr(
        evaluate,
        "generate",
        lambda model, prompts, *a, **k: generated.append(len(prompts)) or original_generate(model, prompts, *a, **k),
    )
    monkeypatch.setattr(
        evaluate, "document_nll", lambda model, docs, *a: scored.append(len(docs)) or original_nll(model, docs, *a)
    )
    capsys.readouterr()
    run_eval(tmp_path, *SWEEP)
    assert "resuming: 7 example(s) already done" in capsys.readouterr().err
    assert generated == [1] and scored == []  # the missing example, for its config alone
    assert [r["id"] for r in read_records(config_dir / RECORDS)] == [r["id"] for r in removed] and len(removed) == 1
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.glob(f"*/*/{RECORDS}")] == [
        f"{M}/recent_global/{RECORDS}"
    ]
    assert task_metrics(config_dir, "0.5", "qa_1@256")["n"] == 2


@pytest.mark.slow
def test_a_tensor_parallel_sweep_writes_one_process_records(two_rank_sweep, tmp_path):
    """--tensor_parallel: the ranks shard one model and run every job together; rank 0 alone writes the
    plain files, with the predictions of one process (here: those the 2-rank sweep made) and perplexities
    equal up to the sharded sums' rounding."""
    proc = torchrun_eval(tmp_path, *SWEEP, "--tensor_parallel")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp_path.glob("*/*/records.rank*.jsonl"))
    assert jobs_under(tmp_path) == jobs_under(two_rank_sweep)
    for config, run, job in jobs_under(tmp_path):
        sharded = read_config_records(tmp_path / config)[run, job]
        alone = read_config_records(two_rank_sweep / config)[run, job]
        assert list(sharded) == sorted(alone)
        for id, record in sharded.items():
            if "prediction" in record:
                assert record["prediction"] == alone[id]["prediction"]
            else:
                assert (
                    record["perplexity"] == pytest.approx(alone[id]["perplexity"], rel=1e-4)
                    and record["tokens"] == alone[id]["tokens"]
                )


@pytest.mark.slow
def test_an_error_on_rank_0_stops_every_rank_at_once(tmp_path):
    (tmp_path / "file").write_text("")
    proc = torchrun_eval(tmp_path / "file", *KJV)  # a hang would wait out the timeout
    error = f"error: --out_dir {tmp_path / 'file'} is a file, not a directory; choose a directory"
    assert proc.returncode != 0 and [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        error,
        error,
    ]


@pytest.mark.slow
def test_compiled_sweep_compiles_once_per_config_not_per_batch(tmp_path, monkeypatch):
    use_echo_task(monkeypatch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run_eval(
        tmp_path,
        "--tasks",
        "echo",
        "--cache_config",
        "heavy_hitter",
        "--cache_sizes",
        "0.9",
        "--num_samples",
        "6",
        "--compile",
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # three batches, one compiled decode step
    assert len(job_records(tmp_path / f"{M}/heavy_hitter", "0.9", "echo@64")) == 6

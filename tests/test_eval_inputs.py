"""eval.py's refusals and errors: a rerun with other settings, two writers, a torn record, bad directories and
lengths, Ctrl-C, a malformed summary; numeric needles' digits recorded."""

from __future__ import annotations

import csv
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from eval_helpers import KJV, M, job_records, jobs_under, run_eval, task_metrics, use_echo_task

import eval as kv_eval
from conftest import ROOT
from kvlab import evaluate
from kvlab.jobs import jobs_for
from kvlab.results import RECORDS, read_records, read_runs
from kvlab.tasks import resolve_tasks
from kvlab.tasks.ruler import TASKS
from kvlab.tasks.ruler_base import needle_digits
from kvlab.tasks.sizing import ContextTooShortError

sys.path.insert(0, str(ROOT / "scripts"))
from plot import main as plot_main  # noqa: E402


def test_a_rerun_with_other_settings_is_refused_and_the_same_settings_resume(tmp_path, capsys):
    run_eval(tmp_path, *KJV)
    config_dir = tmp_path / f"{M}/full"
    args_json = read_runs(config_dir)["full"]["args"]
    assert args_json["key"]["seed"] == 0 and args_json["key"]["chat"] is True and args_json["key"]["dtype"] == "float32"
    assert args_json["key"]["checkpoint"] == M and args_json["key"]["ppl_prompt_tokens"] == 1  # no machine's path
    capsys.readouterr()
    run_eval(tmp_path, *KJV)  # the same settings: resumed, nothing recomputed
    assert "1 example(s) already done" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"seed: 0 -> 1.*another --out_dir"):
        run_eval(tmp_path, *KJV, "--seed", "1")
    with pytest.raises(SystemExit, match=r"chat: True -> False"):
        run_eval(tmp_path, *KJV, "--no_chat")
    assert read_runs(config_dir)["full"]["args"] == args_json  # left as it was


def test_two_cache_configs_with_one_stem_are_refused(tmp_path):
    (tmp_path / "snapkv.yaml").write_text("cache_strategy: recent_global\n")
    with pytest.raises(SystemExit, match=r"--cache_config 'snapkv' and '.*snapkv.yaml' both write to snapkv/"):
        run_eval(tmp_path, *KJV[:2], "--cache_config", "snapkv", str(tmp_path / "snapkv.yaml"), *KJV[4:])


def test_a_second_writer_to_one_out_dir_is_refused(tmp_path):
    import fcntl

    with (tmp_path / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match=f"another eval.py is writing to {tmp_path}"):
            run_eval(tmp_path, *KJV)
    assert not list(tmp_path.glob("*/*/runs.json"))


def test_read_records_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / RECORDS
    a, c = '{"run": "full", "job": "echo@64", "id": "a", "score": 1}', '{"run": "full", "job": "echo@64", "id": "c"}'
    path.write_text(a + '\n{"run": "full", "job": "echo@64", "id": "b", "sc')
    assert [r["id"] for r in read_records(path)] == ["a"]
    path.write_text(a + '\n{"id": "b", "sc\n' + c + "\n")
    with pytest.raises(ValueError, match=f"{path} line 2: not a JSON record"):
        read_records(path)
    path.write_text(a + '\n{"run": "full", "id": "b"}\n' + c + "\n")
    with pytest.raises(ValueError, match=f"{path} line 2: a record without run, job, id"):
        read_records(path)


def test_bad_out_dir_and_context_lengths_are_one_error_before_any_runs_json(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=f"--out_dir {tmp_path / 'file'} is a file"):
        run_eval(tmp_path / "file", *KJV)
    for bad, message in [
        ("1", "--context_lengths 1 is below the 2 tokens book_kjv needs"),
        ("9000", "--context_lengths 9000 is over"),
    ]:
        with pytest.raises(SystemExit, match=f"{message}.*context length of 8192 tokens"):
            run_eval(tmp_path / "out", *KJV[:-1], bad)
    assert not list(tmp_path.rglob("runs.json"))


def drop_write_override() -> None:
    """In a child run as root: take CAP_DAC_OVERRIDE out of its bounding set, so the program it executes
    obeys file modes (a root process otherwise writes into a 0o555 directory)."""
    if ctypes.CDLL(None, use_errno=True).prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def test_a_read_only_out_dir_is_one_error_naming_it(tmp_path):
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    command = [sys.executable, "eval.py", *KJV, "--out_dir", str(out)]
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            preexec_fn=drop_write_override if os.geteuid() == 0 else None,
        )
    except subprocess.SubprocessError:
        pytest.skip("running as root without CAP_SETPCAP: cannot make a directory read-only for the child")
    finally:
        out.chmod(0o755)
    assert proc.returncode == 1 and not list(out.iterdir())
    # one line, no traceback
    assert (
        proc.stderr.strip()
        == f"error: --out_dir {out} is not writable (Permission denied); choose a writable directory"
    )


def test_a_context_too_short_for_a_ruler_task_is_one_error_naming_its_minimum(tmp_path, smollm):
    pytest.importorskip("long_context_eval")
    with pytest.raises(
        SystemExit,
        match=r"--context_lengths 10 is below the \d+ tokens niah_single_2 needs.*context length of 8192 tokens",
    ) as error:
        run_eval(tmp_path, "--tasks", "niah_single_2", "--num_samples", "2", "--context_lengths", "10")
    minimum = int(re.search(r"below the (\d+) tokens", str(error.value)).group(1))
    assert f"valid: {minimum} to the model's context length of 8192 tokens" in str(error.value)
    task, tokenizer = resolve_tasks(["niah_single_2"])[0], smollm[1]
    assert [len(e.input_ids) + e.max_new_tokens <= minimum for e in task.examples(tokenizer, 2, 0, minimum)] == [
        True,
        True,
    ]
    with pytest.raises(ContextTooShortError):  # the minimum: one token fewer does not fit
        task.examples(tokenizer, 2, 0, minimum - 1)
    assert not list(tmp_path.rglob("runs.json"))


def test_numeric_needles_record_and_summarise_the_needle_digits(tmp_path, monkeypatch):
    pytest.importorskip("long_context_eval")
    # room for the 7 digits; RULER's 128 cost minutes here
    monkeypatch.setattr(TASKS["niah_single_2"], "max_new_tokens", 16)
    run_eval(tmp_path, "--tasks", "niah_single_2", "--num_samples", "2", "--context_lengths", "200")
    config_dir = tmp_path / f"{M}/full"
    records = job_records(config_dir, "full", "niah_single_2@200")
    assert [list(r)[:5] for r in records] == [["run", "job", "id", "score", "needle_digits"]] * 2  # next to the score
    assert [r["needle_digits"] for r in records] == [needle_digits(r["prediction"], r["answers"]) for r in records]
    mean = 100 * sum(r["needle_digits"] for r in records) / 2
    assert task_metrics(config_dir, "full", "niah_single_2@200")["needle_digits"] == mean
    assert float(next(csv.DictReader((tmp_path / "summary.csv").open()))["needle_digits"]) == mean
    assert f"digits {mean:.1f}%" in (tmp_path / "summary.md").read_text()


def test_ctrl_c_exits_130_without_a_traceback(tmp_path, monkeypatch, capsys):
    class Interrupted:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, jobs):
            raise KeyboardInterrupt

    monkeypatch.setattr(kv_eval, "Evaluator", Interrupted)
    with pytest.raises(SystemExit) as exit_info:
        run_eval(tmp_path, *KJV)
    assert exit_info.value.code == 130 and capsys.readouterr().err.strip().endswith(
        "interrupted (Ctrl-C); rerun the same command to resume"
    )


def test_plot_reports_a_malformed_summary(tmp_path):
    (tmp_path / "summary.csv").write_text(
        "model,config,size,task,context_length,metric,value\nm,full,full,t,64,perplexity,3.0\n"
    )
    with pytest.raises(SystemExit, match=f"{tmp_path / 'summary.csv'}: missing column.*compression"):
        plot_main([str(tmp_path)])
    (tmp_path / "summary.csv").write_text(
        "model,config,size,task,context_length,metric,value,compression\nm,full,full,t,64,perplexity,high,1.0\n"
    )
    with pytest.raises(SystemExit, match=f"{tmp_path / 'summary.csv'} line 2: value 'high' is not a number"):
        plot_main([str(tmp_path)])


def test_a_checkpoint_name_cannot_leave_out_dir(tmp_path, smollm_dir):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for f in smollm_dir.iterdir():  # copies: a checkpoint may not name files outside its directory
        if f.name != "config.json":
            try:
                os.link(f, checkpoint / f.name)
            except OSError:
                shutil.copy(f, checkpoint / f.name)
    config = json.loads((smollm_dir / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"name": "../../escaped"}))
    with pytest.raises(SystemExit, match=r"checkpoint name '\.\./\.\./escaped'"):
        run_eval(tmp_path / "a" / "b" / "out", *KJV, "--checkpoint_path", str(checkpoint))
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "a" / "escaped").exists()


def test_without_sizes_each_config_runs_at_its_strategys_default_size():
    """No --cache_sizes: a config runs at its strategy's own default (duo_attention and hybrid keep every
    token in their retrieval heads or policies, so a 0.5 cache could not hold their prompts); given sizes
    and ratios apply to every compressing config."""
    tasks = resolve_tasks(["niah_single_1"])
    planned = jobs_for(["full", "snapkv", "duo_attention", "hybrid"], None, tasks, [1024])
    assert [(j.config, j.size) for j in planned] == [
        ("full", "full"),
        ("snapkv", "0.5"),
        ("duo_attention", "1.0"),
        ("hybrid", "1.0"),
    ]
    planned = jobs_for(["snapkv", "duo_attention"], ["0.25", "ratio0.5"], tasks, [1024])
    assert [(j.config, j.size) for j in planned] == [
        ("snapkv", "0.25"),
        ("snapkv", "ratio0.5"),
        ("duo_attention", "0.25"),
        ("duo_attention", "ratio0.5"),
    ]


def test_prefill_chunk_runs_each_compressing_config_chunked_beside_its_one_shot_run(tmp_path, monkeypatch):
    use_echo_task(monkeypatch)
    chunks = []
    original = evaluate.generate
    monkeypatch.setattr(
        evaluate,
        "generate",
        lambda model, prompts, n, spec, *a, **k: (
            chunks.append(spec.prefill_chunk) or original(model, prompts, n, spec, *a, **k)
        ),
    )
    run_eval(
        tmp_path,
        "--tasks",
        "echo",
        "--cache_config",
        "full",
        "heavy_hitter",
        "--cache_sizes",
        "0.5",
        "--num_samples",
        "2",
        "--prefill_chunk",
        "16",
    )
    assert jobs_under(tmp_path) == [
        (f"{M}/full", "full", "echo@64"),
        (f"{M}/heavy_hitter", "0.5+prefill_chunk16", "echo@64"),
    ]
    assert read_runs(tmp_path / f"{M}/heavy_hitter")["0.5+prefill_chunk16"]["args"]["key"]["prefill_chunk"] == 16
    assert chunks == [None, 16]  # full keeps every token: one-shot
    rows = {r["config"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert (rows["heavy_hitter"]["size"], rows["heavy_hitter"]["prefill_chunk"], rows["full"]["prefill_chunk"]) == (
        "0.5",
        "16",
        "",
    )
    assert "heavy_hitter@0.5+prefill_chunk16" in (tmp_path / "summary.md").read_text()


def test_book_perplexity_refuses_prefill_chunk_in_one_line(tmp_path):
    with pytest.raises(
        SystemExit, match=r"book_shakespeare prefills 1 prompt token\(s\) and decodes the rest token by token"
    ):
        run_eval(
            tmp_path,
            "--tasks",
            "book_shakespeare",
            "--cache_config",
            "recent_global",
            "--num_samples",
            "1",
            "--prefill_chunk",
            "16",
        )


def test_results_kept_one_directory_per_run_are_compacted_and_resume(tmp_path, capsys):
    """scripts/compact_results.py: a run directory's args.json (a full checkpoint path cut to its name), records (a
    torn line dropped, rank files joined) and metrics become the config's records.jsonl and runs.json, which eval.py
    resumes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compact_results", ROOT / "scripts" / "compact_results.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run_eval(tmp_path / "new", *KJV[:-1], "64", "--num_samples", "2")
    config_dir = tmp_path / "new" / M / "full"
    [entry] = read_runs(config_dir).values()
    records = read_records(config_dir / RECORDS)
    run_dir = tmp_path / "old" / M / "full" / "full"
    run_dir.mkdir(parents=True)
    key = {**entry["args"]["key"], "checkpoint": "/elsewhere/checkpoints/" + M}
    (run_dir / "args.json").write_text(json.dumps({**entry["args"], "key": key}))
    (run_dir / "book_kjv@64.json").write_text(json.dumps(entry["tasks"]["book_kjv@64"]))
    old = [{k: v for k, v in r.items() if k not in ("run", "job")} for r in records]
    (run_dir / "book_kjv@64.jsonl").write_text(json.dumps(old[0]) + "\n" + json.dumps(old[1])[:20])
    (run_dir / "book_kjv@64.rank1.jsonl").write_text(json.dumps(old[1]) + "\n")
    script.main([str(tmp_path / "old")])
    compacted = tmp_path / "old" / M / "full"
    assert sorted(p.name for p in compacted.iterdir()) == [RECORDS, "runs.json"]
    assert read_runs(compacted) == read_runs(config_dir) and read_records(compacted / RECORDS) == records
    capsys.readouterr()
    run_eval(tmp_path / "old", *KJV[:-1], "64", "--num_samples", "2")
    assert "2 example(s) already done" in capsys.readouterr().err
    assert read_records(compacted / RECORDS) == records

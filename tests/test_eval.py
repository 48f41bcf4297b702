"""eval.py: book perplexity through the cache, results on disk, resume after a kill, summaries."""

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
import torch
import torch.nn.functional as F

import eval as kv_eval
from conftest import ROOT
from kvlab import evaluate
from kvlab.build import make_caches
from kvlab.config import cache_spec
from kvlab.jobs import jobs_for
from kvlab.prompt_compression import AttentionScores
from kvlab.recording import PrefillRecorder
from kvlab.results import RECORDS, config_dirs, read_config_records, read_records, read_runs, write_runs
from kvlab.sweep_groups import batch_width
from kvlab.tasks import Example, GenerationTask, resolve_tasks
from kvlab.tasks.book import TASKS as BOOKS
from kvlab.tasks.book import pg19_books
from kvlab.tasks.ruler import TASKS
from kvlab.tasks.ruler_base import needle_digits
from kvlab.tasks.sizing import ContextTooShortError

sys.path.insert(0, str(ROOT / "scripts"))
from plot import main as plot_main  # noqa: E402

M = "SmolLM2-135M-Instruct"


def use_echo_task(monkeypatch) -> None:
    """Both the CLI (which plans the jobs) and the harness (which runs them) resolve task names."""
    for module in (kv_eval, evaluate):
        monkeypatch.setattr(module, "resolve_tasks", lambda names: [EchoTask()])


class EchoTask(GenerationTask):
    """A generation task needing no data: score 1 when the answer contains the prompt's last word."""

    name, family, metric = "echo", "test", "contains"

    def examples(self, tokenizer, num_samples, seed=0, context_length=None, chat=True):
        words = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano"]
        return [
            Example(
                f"echo/{i}",
                tokenizer.encode(
                    f"Here is a word to remember for later, so please repeat it exactly once: {words[i % len(words)]}."
                ),
                [words[i % len(words)]],
                4,
            )
            for i in range(num_samples)
        ]

    def score(self, prediction, example):
        return float(example.answers[0] in prediction.lower())


def test_book_documents_are_deterministic_and_sized(smollm):
    _, tokenizer, _ = smollm
    plays = BOOKS["book_shakespeare"].documents(tokenizer, 3, 1200)
    assert [len(d.input_ids) for d in plays] == [1200] * 3 and len({d.id for d in plays}) == 3
    assert plays[0].checkpoints == [500, 1000, 1199]
    # nested
    assert [d.id for d in BOOKS["book_shakespeare"].documents(tokenizer, 2, 1200)] == [d.id for d in plays[:2]]
    kjv = BOOKS["book_kjv"].documents(tokenizer, 2, 500)
    assert tokenizer.decode(kjv[0].input_ids).lstrip().startswith("In the beginning God created") and kjv[
        1
    ].id.endswith("/500/500")


def test_pg19_reads_a_directory_and_explains_how_to_get_it_offline(tmp_path, monkeypatch):
    (tmp_path / "b.txt").write_text("second book")
    (tmp_path / "a.txt").write_text("first book")
    assert pg19_books(tmp_path) == [("a", "first book"), ("b", "second book")]
    monkeypatch.delenv("KVLAB_PG19_DIR", raising=False)

    def offline(**kwargs):
        raise ConnectionError("no network\n(a second line of the hub's message)")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(
        ValueError, match="task pg19 needs the hub dataset emozilla/pg19-test, .*no network .* set KVLAB_PG19_DIR"
    ) as info:
        pg19_books()
    assert "\n" not in str(info.value)


def test_unknown_task_lists_families_and_tasks():
    with pytest.raises(
        ValueError, match=r"unknown task 'nope'; choose task names, a family \(book, longbench, needle, ruler\) or all"
    ):
        resolve_tasks(["nope"])
    assert [t.name for t in resolve_tasks(["book"])] == ["book_shakespeare", "book_kjv", "pg19"]


def test_full_cache_perplexity_equals_one_forward_pass(smollm):
    """Token-by-token decoding through the cache gives the losses of a single causal forward."""
    model, tokenizer, _ = smollm
    doc = BOOKS["book_shakespeare"].documents(tokenizer, 1, 96)[0].input_ids
    spec = cache_spec({}, model.config.n_layer, tokenizer)
    losses, held = evaluate.document_nll(model, [doc], spec, evaluate.score_one_token)
    with torch.no_grad():
        a = model.config
        model.setup_caches(make_caches("full", a.n_layer, 1, a.n_local_heads, 96, a.head_dim, torch.float32))
        logits = model(torch.tensor([doc]), torch.arange(96)[None], prefill=True, logits_at=torch.arange(95)[None])
    torch.testing.assert_close(
        losses[0], F.cross_entropy(logits[0], torch.tensor(doc[1:]), reduction="none"), atol=2e-4, rtol=1e-4
    )
    assert held.tolist() == [95.0]  # the last token is predicted, never inserted
    compressed, held = evaluate.document_nll(
        model,
        [doc],
        cache_spec({"cache_strategy": "recent_global", "max_cache_length": 32}, 30, tokenizer),
        evaluate.score_one_token,
    )
    assert held.tolist() == [32.0] and not torch.allclose(compressed, losses)


def run_eval(tmp_path, *extra):
    kv_eval.main(["--out_dir", str(tmp_path), "--context_lengths", "64", "--batch_size", "2", *extra])


def job_records(config_dir, run: str, job: str) -> list[dict]:
    """One job's records in the config's records.jsonl, in file order."""
    return [r for r in read_records(config_dir / RECORDS) if (r["run"], r["job"]) == (run, job)]


def task_metrics(config_dir, run: str, job: str) -> dict:
    return read_runs(config_dir)[run]["tasks"][job]


def jobs_under(out_dir) -> list[tuple[str, str, str]]:
    """(config directory, run, job) of every job with records under out_dir."""
    return sorted(
        (d.relative_to(out_dir).as_posix(), *key) for d in config_dirs(out_dir) for key in read_config_records(d)
    )


@pytest.mark.slow
def test_sweep_writes_results_summaries_and_resumes_after_a_kill(tmp_path, monkeypatch):
    args = [
        "--tasks",
        "book_shakespeare",
        "--cache_config",
        "full",
        "recent_global",
        "--cache_sizes",
        "0.5",
        "--num_samples",
        "3",
    ]
    run_eval(tmp_path, *args)
    assert jobs_under(tmp_path) == [
        (f"{M}/full", "full", "book_shakespeare@64"),
        (f"{M}/recent_global", "0.5", "book_shakespeare@64"),
    ]
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["config"], r["size"]) for r in rows] == [("full", "full"), ("recent_global", "0.5")]
    # perplexity rises under compression
    assert float(rows[0]["relative_to_full"]) == 1.0 and float(rows[1]["relative_to_full"]) > 1.0
    assert abs(float(rows[1]["compression"]) - 2.0) < 0.1

    # A kill mid-run: metrics not written, the last line torn. Resuming redoes only the missing documents.
    config_dir = tmp_path / f"{M}/recent_global"
    jsonl = config_dir / RECORDS
    finished = jsonl.read_text().splitlines()
    runs = read_runs(config_dir)
    del runs["0.5"]["tasks"]["book_shakespeare@64"]
    write_runs(config_dir, runs)
    jsonl.write_text(finished[0] + "\n" + finished[1][:20])
    computed = []
    original = evaluate.document_nll
    monkeypatch.setattr(
        evaluate, "document_nll", lambda model, docs, *a: computed.append(len(docs)) or original(model, docs, *a)
    )
    run_eval(tmp_path, *args)
    assert computed == [2]  # one batch (padded to 2) for the two unfinished documents; the full run was not touched
    resumed = jsonl.read_text().splitlines()
    assert resumed[0] == finished[0] and sorted(json.loads(x)["id"] for x in resumed) == sorted(
        json.loads(x)["id"] for x in finished
    )
    assert task_metrics(config_dir, "0.5", "book_shakespeare@64")["n"] == 3
    plot_main([str(tmp_path)])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def counted_generate_rows(monkeypatch) -> list[int]:
    """The rows of every batch eval.py decodes from now on, in order (generate still runs)."""
    calls = []
    original = evaluate.generate
    monkeypatch.setattr(
        evaluate,
        "generate",
        lambda model, prompts, *a, **k: calls.append(len(prompts)) or original(model, prompts, *a, **k),
    )
    return calls


def test_generation_jobs_score_and_resume(tmp_path, monkeypatch):
    use_echo_task(monkeypatch)
    args = ["--tasks", "echo", "--cache_config", "heavy_hitter", "--cache_sizes", "0.9", "--num_samples", "5"]
    calls = counted_generate_rows(monkeypatch)
    run_eval(tmp_path, *args)
    config_dir = tmp_path / f"{M}/heavy_hitter"
    records = job_records(config_dir, "0.9", "echo@64")
    # the last batch padded to 2
    assert [r["id"] for r in records] == [f"echo/{i}" for i in range(5)] and calls == [2, 2, 2]
    assert all(r["score"] == float(r["answers"][0] in r["prediction"].lower()) for r in records)
    metrics = task_metrics(config_dir, "0.9", "echo@64")
    assert metrics["n"] == 5 and metrics["value"] == 100 * sum(r["score"] for r in records) / 5
    run_eval(tmp_path, *args[:-1], "7")  # more samples: the first five are kept; one batch holds the two new ones
    lines = (config_dir / RECORDS).read_text().splitlines()
    assert calls == [2, 2, 2, 2] and len(lines) == 7 and task_metrics(config_dir, "0.9", "echo@64")["n"] == 7
    run_eval(tmp_path, *args)  # fewer again: nothing to compute, metrics over the first five
    assert calls == [2, 2, 2, 2] and task_metrics(config_dir, "0.9", "echo@64")["value"] == metrics["value"]


def test_a_task_with_fewer_examples_than_a_batch_decodes_no_copies(tmp_path, monkeypatch):
    """The batch is as wide as a rank's share of the task when that is less than --batch_size: one example
    decodes one row (not --batch_size copies of it), and every batch of the task keeps that width."""
    use_echo_task(monkeypatch)
    calls = counted_generate_rows(monkeypatch)
    run_eval(tmp_path, "--tasks", "echo", "--cache_config", "full", "--num_samples", "1")
    assert calls == [1]
    # two ranks share three examples: batches of two, whatever --batch_size allows; eight fill batches of four
    assert [batch_width(4, n, 2) for n in (1, 3, 8, 9)] == [1, 2, 4, 4] and batch_width(4, 3, 1) == 3
    flags = ["--tasks", "echo", "--num_samples", "3", "--batch_size", "4", "--out_dir", str(tmp_path / "ranks")]
    evaluator = evaluate.Evaluator(kv_eval.build_parser().parse_args(flags), "cpu", shard=(0, 2))
    assert evaluator.group("echo", 64, []).width == 2


@pytest.mark.slow
def test_one_prefill_is_shared_by_every_config_and_changes_nothing(tmp_path, monkeypatch):
    """Prefill once per batch for all configs and sizes, prompt scores once per compressor: the same
    predictions as separate runs, with one prefill and one H2O scoring per batch."""
    use_echo_task(monkeypatch)
    recorded, scored = [], []
    original_record, original_score = PrefillRecorder.prefill, AttentionScores.__call__
    monkeypatch.setattr(
        PrefillRecorder, "prefill", lambda self, *a, **kw: recorded.append(1) or original_record(self, *a, **kw)
    )
    monkeypatch.setattr(
        AttentionScores, "__call__", lambda self, *a, **kw: scored.append(1) or original_score(self, *a, **kw)
    )
    configs, sizes = ["full", "heavy_hitter", "hybrid", "snapkv", "squeeze_heavy_hitter"], ["0.9", "0.8"]
    run_eval(
        tmp_path / "together",
        "--tasks",
        "echo",
        "--cache_config",
        *configs,
        "--cache_sizes",
        *sizes,
        "--num_samples",
        "4",
    )
    # two batches x 30 layers, for 9 runs (squeeze plans from the same prefill)
    assert len(recorded) == len(scored) == 2 * 30
    for config in configs:
        for size in ["full"] if config == "full" else sizes:
            run_eval(
                tmp_path / config / size,
                "--tasks",
                "echo",
                "--cache_config",
                config,
                "--cache_sizes",
                sizes[size == "0.8"],
                "--num_samples",
                "4",
            )
            together = job_records(tmp_path / "together" / M / config, size, "echo@64")
            alone = job_records(tmp_path / config / size / M / config, size, "echo@64")
            assert [r["prediction"] for r in together] == [r["prediction"] for r in alone]


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
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "eval.py",
        "--out_dir",
        str(out_dir),
        *args,
    ]
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


def test_pg19_reads_parquet_files(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(
        pa.table({"short_book_title": ["Moby", "Emma"], "text": ["Call me Ishmael.", "Emma Woodhouse, handsome."]}),
        tmp_path / "test-0.parquet",
    )
    assert pg19_books(tmp_path) == [("Moby", "Call me Ishmael."), ("Emma", "Emma Woodhouse, handsome.")]


def test_layer_budget_planners_need_a_perplexity_prompt(tmp_path):
    with pytest.raises(
        SystemExit,
        match="--layer_budget squeeze plans from the prompt at prefill, but book_kjv decodes .* --ppl_prompt_tokens N",
    ):
        run_eval(
            tmp_path,
            "--tasks",
            "book_kjv",
            "--cache_config",
            "squeeze_heavy_hitter",
            "--num_samples",
            "1",
            "--context_lengths",
            "32",
        )
    run_eval(
        tmp_path,
        "--tasks",
        "book_kjv",
        "--cache_config",
        "squeeze_heavy_hitter",
        "--num_samples",
        "1",
        "--context_lengths",
        "96",
        "--ppl_prompt_tokens",
        "48",
    )
    [record] = job_records(tmp_path / f"{M}/squeeze_heavy_hitter", "0.5", "book_kjv+prompt48@96")
    assert record["tokens"] == 95 and 1.9 < record["compression"] < 2.1
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["task"], r["context_length"]) for r in rows] == [("book_kjv+prompt48", "96")]


@pytest.mark.slow
def test_a_prefilled_document_prompt_scores_like_one_forward_pass(smollm):
    """With a 40-token prompt and a full cache, the prompt's predictions (from the prefill) and the rest
    (decoded through the cache) together equal one causal forward; a compressed cache differs only after the prompt."""
    model, tokenizer, _ = smollm
    doc = BOOKS["book_shakespeare"].documents(tokenizer, 1, 96)[0].input_ids
    one_token, _ = evaluate.document_nll(model, [doc], cache_spec({}, 30, tokenizer), evaluate.score_one_token)
    prompted, held = evaluate.document_nll(
        model, [doc], cache_spec({}, 30, tokenizer), evaluate.score_one_token, prompt_tokens=40
    )
    torch.testing.assert_close(prompted, one_token, atol=2e-4, rtol=1e-4)
    assert held.tolist() == [95.0]
    squeezed, held = evaluate.document_nll(
        model,
        [doc],
        cache_spec(
            {"cache_strategy": "heavy_hitter", "max_cache_length": 0.5, "layer_budget": "squeeze"}, 30, tokenizer
        ),
        evaluate.score_one_token,
        prompt_tokens=40,
    )
    torch.testing.assert_close(squeezed[:, :40], one_token[:, :40], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(squeezed, one_token) and held.item() == pytest.approx(48.0, abs=0.5)


def test_attention_metrics_record_recall_per_example(tmp_path, monkeypatch):
    """--attention_metrics: every example records its attention loss and top-B recall; a budget covering
    the sequence recalls everything; the summary carries the means."""
    use_echo_task(monkeypatch)
    (tmp_path / "quest.yaml").write_text("cache_strategy: quest\nsink_tokens: 2\npage_size: 4\n")
    (tmp_path / "clusterkv.yaml").write_text("cache_strategy: clusterkv\nsink_tokens: 2\ntokens_per_cluster: 4\n")
    configs = [str(tmp_path / "quest.yaml"), str(tmp_path / "clusterkv.yaml")]
    run_eval(
        tmp_path,
        "--tasks",
        "echo",
        "--cache_config",
        *configs,
        "--cache_sizes",
        "1.0",
        "10",
        "--num_samples",
        "2",
        "--attention_metrics",
    )
    rows = {(r["config"], r["size"]): r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    for config in ("quest", "clusterkv"):
        covering = job_records(tmp_path / M / config, "1.0", "echo@64")
        assert [r["topb_recall"] for r in covering] == [1.0, 1.0] and all(
            abs(r["attention_loss"]) < 1e-6 for r in covering
        )
        assert 0 < float(rows[(config, "10")]["topb_recall"]) < 1 and float(rows[(config, "10")]["attention_loss"]) > 0
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="--attention_metrics runs eagerly on generation tasks"):
        kv_eval.main(["--tasks", "book_shakespeare", "--attention_metrics", "--out_dir", str(tmp_path)])


KJV = ["--tasks", "book_kjv", "--cache_config", "full", "--num_samples", "1", "--context_lengths", "32"]


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

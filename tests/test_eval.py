"""eval.py: book perplexity through the cache, results on disk, resume after a kill, summaries."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from eval_helpers import M, job_records, jobs_under, run_eval, task_metrics, use_echo_task

import eval as kv_eval
from conftest import ROOT
from kvlab import evaluate
from kvlab.build import make_caches
from kvlab.config import cache_spec
from kvlab.prompt_compression import AttentionScores
from kvlab.recording import PrefillRecorder
from kvlab.results import RECORDS, read_runs, write_runs
from kvlab.sweep_groups import batch_width
from kvlab.tasks import resolve_tasks
from kvlab.tasks.book import TASKS as BOOKS
from kvlab.tasks.book import pg19_books

sys.path.insert(0, str(ROOT / "scripts"))
from plot import main as plot_main  # noqa: E402


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

"""The tables and pictures the sweep scripts make from a sweep's files: scripts/leaderboard.py (the mean score per
method, ratio and protocol, its plot and commands), scripts/needle_heatmap.py and scripts/leaderboard_details.py."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys

import matplotlib.figure
import pytest

from conftest import ROOT, two_ranks

SUMMARY_ROWS = [
    ("full", "full", False, "vt", 1024, 90.0),
    ("full", "full", False, "qa_1", 1024, 50.0),
    ("kvzip", "ratio0.5", True, "vt", 1024, 80.0),
    ("kvzip", "ratio0.5", True, "qa_1", 1024, 40.0),
    ("kvzip", "ratio0.5", False, "vt", 1024, 70.0),
    ("snapkv", "ratio0.5", True, "vt", 1024, 20.0),
    ("snapkv", "0.5", True, "vt", 1024, 99.0),  # a cache size, not a ratio
    ("snapkv", "ratio0.5", True, "vt", 2048, 99.0),  # another context length
    ("ea_epsilon", "ratio0.5", True, "vt", 1024, 30.0),  # an ablation in the same out_dir, not in --methods
    ("ea_epsilon", "ratio0.5", True, "qa_1", 1024, 10.0),
    ("quest", "ratio0.5", True, "vt", 1024, 95.0),  # recallable: its own rows
    ("quest", "ratio0.5", True, "qa_1", 1024, 45.0),
]


@pytest.fixture
def leaderboard(monkeypatch):
    """scripts/leaderboard.py as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # leaderboard.py imports leaderboard_details from there
    spec = importlib.util.spec_from_file_location("leaderboard", ROOT / "scripts" / "leaderboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def summary_dir(tmp_path):
    """An out_dir whose summary.csv holds SUMMARY_ROWS."""
    with (tmp_path / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", "size", "query_agnostic", "task", "context_length", "value"])
        writer.writerows(SUMMARY_ROWS)
    return tmp_path


def saved_figures(monkeypatch) -> list:
    """The figures savefig is called on from now on, instead of their files."""
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: figures.append(fig))
    return figures


def test_leaderboard_averages_tasks_per_method_ratio_and_protocol(leaderboard, summary_dir):
    """The table from a summary.csv: the mean over tasks per (protocol, method, ratio), the full cache the
    reference of both protocols, cache-size runs, other context lengths and configs not in --methods left out; a
    cell over fewer tasks than the full cache flagged in the table and left out of the JSON."""
    leaderboard.main(["--table_only", "--out_dir", str(summary_dir), "--context_length", "1024"])
    table = list(csv.DictReader((summary_dir / "leaderboard.csv").open()))
    assert [(r["mode"], r["method"], float(r["ratio"]), float(r["score"]), int(r["tasks"])) for r in table] == [
        ("query_agnostic", "full", 0.0, 70.0, 2),
        ("query_agnostic", "kvzip", 0.5, 60.0, 2),
        ("query_agnostic", "quest", 0.5, 70.0, 2),
        ("query_agnostic", "snapkv", 0.5, 20.0, 1),
        ("query_aware", "full", 0.0, 70.0, 2),
        ("query_aware", "kvzip", 0.5, 70.0, 1),
    ]
    markdown = (summary_dir / "leaderboard.md").read_text()
    assert "| kvzip | 60.0 |\n| snapkv | 20.0 (1/2 tasks) |\n| quest ‡ | 70.0 |\n\n‡ recallable" in markdown
    assert "| kvzip | 70.0 (1/2 tasks) |" in markdown  # a sweep still running
    assert (summary_dir / "leaderboard.png").stat().st_size > 10_000
    # the cells over every task, as a script reads them
    assert json.loads((summary_dir / "leaderboard.json").read_text()) == {
        "full": {"query_agnostic": {"0": 70.0}, "query_aware": {"0": 70.0}},
        "kvzip": {"query_agnostic": {"0.5": 60.0}},
        "quest": {"query_agnostic": {"0.5": 70.0}},
    }


def test_leaderboard_plots_complete_cells_and_a_colour_per_method(leaderboard, summary_dir, monkeypatch):
    """The plot leaves out the cells over fewer tasks than the full cache, and a method has one colour in every
    panel, whatever the other panels hold."""
    figures = saved_figures(monkeypatch)
    leaderboard.main(["--table_only", "--out_dir", str(summary_dir), "--context_length", "1024"])
    plotted = [{line.get_label(): list(line.get_ydata()) for line in ax.get_lines()} for ax in figures[0].axes]
    assert plotted == [{"kvzip": [70.0, 60.0], "quest": [70.0, 70.0]}]
    figures.clear()
    points = [
        ("query_agnostic", "full", 0.0),
        ("query_agnostic", "ablation", 0.5),
        ("query_agnostic", "kvzip", 0.5),
        ("query_aware", "full", 0.0),
        ("query_aware", "kvzip", 0.5),
    ]
    leaderboard.plot(
        [dict(mode=mode, method=method, ratio=ratio, score=50.0) for mode, method, ratio in points],
        summary_dir / "again.png",
    )
    colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in figures[0].axes]
    assert set(colours[0]) == {"ablation", "kvzip"} and set(colours[1]) == {"kvzip"}
    assert colours[0]["kvzip"] == colours[1]["kvzip"]  # a method keeps its colour when another panel has fewer methods


def test_leaderboard_methods_name_configs_and_ablation_files(leaderboard, summary_dir):
    """--methods takes config names and config files (an ablation named by its stem); the rest is left out."""
    argv = ["--table_only", "--out_dir", str(summary_dir), "--context_length", "1024"]
    leaderboard.main([*argv, "--methods", "kvzip", "docs/ablations/ea_epsilon.yaml"])
    markdown = (summary_dir / "leaderboard.md").read_text()
    assert "| kvzip | 60.0 |\n| ea_epsilon | 20.0 |\n" in markdown and "snapkv" not in markdown


def test_leaderboard_runs_eval_per_protocol_in_one_process_or_launched(leaderboard):
    """Each protocol's sweep is one eval.py command, query-agnostic flagged; --processes launches it on ranks."""
    args = leaderboard.build_parser().parse_args(["--methods", "kvzip", "--ratios", "0.5", "--num_samples", "3"])
    assert leaderboard.sweep_args(args, True)[-1] == "--query_agnostic"
    assert "--compression_ratios" in leaderboard.sweep_args(args, False)
    eval_py = str(ROOT / "eval.py")
    assert leaderboard.sweep_command(args, True) == [sys.executable, eval_py, *leaderboard.sweep_args(args, True)]
    args.processes = 2
    launched = [*two_ranks("kvlab.launch"), eval_py, *leaderboard.sweep_args(args, False)]
    assert leaderboard.sweep_command(args, False) == launched


def test_needle_heatmap_draws_each_method_by_depth_and_ratio_beside_the_full_cache(tmp_path, monkeypatch):
    """The needle grid from a summary.csv: a method's score per (protocol, ratio, depth), the full cache under ratio
    0 of both protocols, other tasks, lengths, cache sizes and chunked runs left out; one picture per method and
    protocol, named by the context length, its cells the scores down the depths and across the ratios."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import needle_heatmap

    rows = [
        ("full", "full", False, "", "needle_depth_0", 8192, 100.0),
        ("full", "full", False, "", "needle_depth_50", 8192, 50.0),
        ("snapkv", "ratio0.5", True, "", "needle_depth_0", 8192, 0.0),
        ("snapkv", "ratio0.5", True, "", "needle_depth_50", 8192, 100.0),
        ("snapkv", "ratio0.875", True, "", "needle_depth_0", 8192, 0.0),
        ("snapkv", "ratio0.5", False, "", "needle_depth_50", 8192, 25.0),
        ("snapkv", "ratio0.5", True, "4096", "needle_depth_0", 8192, 99.0),  # chunked: not kvpress's protocol
        ("snapkv", "0.5", True, "", "needle_depth_0", 8192, 99.0),  # a cache size
        ("snapkv", "ratio0.5", True, "", "needle_depth_0", 4096, 99.0),  # another length
        ("snapkv", "ratio0.5", True, "", "niah_single_2", 8192, 99.0),  # another task
        ("kvzip", "ratio0.5", True, "", "needle_depth_0", 8192, 99.0),  # not in --methods
    ]
    with (tmp_path / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", "size", "query_agnostic", "prefill_chunk", "task", "context_length", "value"])
        writer.writerows(rows)
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: figures.append((fig, path)))
    argv = ["--table_only", "--out_dir", str(tmp_path), "--methods", "snapkv", "--depths", "0", "50"]
    needle_heatmap.main([*argv, "--modes", "query_agnostic", "query_aware", "--figures_dir", str(tmp_path / "f")])
    assert json.loads((tmp_path / "needle.json").read_text()) == {
        "full": {m: {"0": {"0": 100.0, "50": 50.0}} for m in ("query_agnostic", "query_aware")},
        "snapkv": {
            "query_agnostic": {"0.5": {"0": 0.0, "50": 100.0}, "0.875": {"0": 0.0}},
            "query_aware": {"0.5": {"50": 25.0}},
        },
    }
    table = (tmp_path / "needle.md").read_text()
    assert "| full | 0 | 100 | 50 | 75 |\n| snapkv | 0.5 | 0 | 100 | 50 |\n| snapkv | 0.875 | 0 |  | 0 |\n" in table
    assert "| snapkv | 0.5 |  | 25 | 25 |" in table
    names = [path.name for _, path in figures]
    assert names == [
        "needle_8k_full.png",
        "needle_8k_snapkv.png",
        "needle_8k_full_query_aware.png",
        "needle_8k_snapkv_query_aware.png",
    ]
    cells = [[t.get_text() for t in fig.axes[0].texts] for fig, _ in figures]
    assert cells[1] == ["100", "0", "0", "50", "100", ""]  # depth 0: full, 0.5, 0.875; then depth 50
    with pytest.raises(SystemExit):
        needle_heatmap.main([*argv[:-2], "--depths", "5"])


def test_leaderboard_details_pair_each_cell_with_the_full_cache_and_the_other_protocol(tmp_path, monkeypatch):
    """leaderboard_details.md from the records: a method's gap to the full cache and query-aware minus
    query-agnostic, each the mean paired difference +- its standard error over the examples both ran; scores per
    task; runs of another context length or a chunked prefill left out."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import leaderboard_details

    def write(config, run, job, scores):
        config_dir = tmp_path / "SmolLM2-135M-Instruct" / config
        config_dir.mkdir(parents=True, exist_ok=True)
        task = job.split("@")[0]
        with (config_dir / "records.jsonl").open("a") as f:
            for i, score in enumerate(scores):
                f.write(json.dumps({"run": run, "job": job, "id": f"{task}/1024/{i}", "score": score}) + "\n")

    write("full", "full", "vt@1024", [1.0, 1.0, 0.0, 1.0])
    write("full", "full", "niah_single_1@1024", [1.0, 1.0])
    write("kvzip", "ratio0.5+query_agnostic", "vt@1024", [1.0, 0.0, 0.0, 1.0])
    write("kvzip", "ratio0.5+query_agnostic", "niah_single_1@1024", [1.0, 0.0])
    write("kvzip", "ratio0.5", "vt@1024", [1.0, 1.0, 1.0, 1.0])
    write("kvzip", "ratio0.5", "niah_single_1@1024", [1.0, 1.0])
    write("kvzip", "ratio0.5+query_agnostic", "vt@2048", [0.0])  # another length
    write("kvzip", "ratio0.5+prefill_chunk512+query_agnostic", "vt@1024", [0.0] * 4)  # chunked
    write("oracle", "ratio0.5+query_agnostic", "vt@1024", [1.0, 1.0, 0.0, 0.0])
    write("oracle", "ratio0.5+query_agnostic", "niah_single_1@1024", [1.0, 1.0])
    write("quest", "ratio0.5+query_agnostic", "vt@1024", [1.0, 1.0, 1.0, 1.0])  # recallable: no evicting method
    write("quest", "ratio0.5+query_agnostic", "niah_single_1@1024", [1.0, 1.0])
    text = leaderboard_details.details_markdown(tmp_path, 1024, ["kvzip", "oracle", "quest"], frozenset({"quest"}))
    # agnostic - full per example: 0, -1, 0, 0, 0, -1 -> mean -33.3, SE = stdev / sqrt(6) = 21.1
    assert "**query_agnostic**: score - full cache (83.3), paired SE" in text
    assert "| kvzip | -33.3 ± 21.1 |" in text
    # aware - agnostic: 0, 1, 1, 0, 0, 1 -> +50.0, SE 22.4
    assert "**query_aware - query_agnostic**, paired SE" in text and "| kvzip | +50.0 ± 22.4 |" in text
    assert "| method | s1 | vt | mean |" in text
    rows = ["| full | 100 | 75 | 83.3 |", "| quest | 100 | 100 | 100.0 |", "| oracle | 100 | 50 | 66.7 |"]
    assert "\n".join([*rows, "| kvzip | 50 | 50 | 50.0 |"]) in text
    # the best evicting method (quest recalls): kvzip - oracle per example 0, -1, 0, +1, 0, -1 -> -16.7, SE 30.7
    assert "| query_agnostic | 0.5 | oracle | 66.7 | kvzip | 50.0 | -16.7 ± 30.7 |" in text

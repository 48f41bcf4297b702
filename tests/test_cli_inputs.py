"""Bad and edge inputs on every command line: each gives its one-line `error:` (naming the bad value) or
its correct run, and none loses the user's files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, one_line_error, two_ranks

sys.path.insert(0, str(ROOT / "scripts"))
import convert_hf_checkpoint  # noqa: E402

import generate  # noqa: E402


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--cache_config", "{tmp}/dup.yaml"], "not valid YAML: duplicate key 'recent_window'"),
        (["--cache_config", "{tmp}/latin1.yaml"], "latin1.yaml: not UTF-8 text"),
        (
            ["--cache_config", "{tmp}/empty_tile.yaml"],
            "empty_tile.yaml: max_cache_length: an empty list; give one value, or one per layer",
        ),
        (
            ["--cache_config", "{tmp}/empty_repeat.yaml"],
            "empty_repeat.yaml: cache_strategy: an empty list; give one value, or one per layer",
        ),
        (["--prompts_file", "{tmp}"], "is a directory; give a UTF-8 text file, one prompt per line"),
        (["--prompts_file", "{tmp}/latin1.yaml"], "latin1.yaml' is not a UTF-8 text file"),
        (["--prompt", "{tmp}/empty.txt"], "the prompt is empty (0 tokens)"),
        (["--cache_strategy", "l2", "--value_epsilon", "inf"], "value_epsilon must be a number >= 0, got inf"),
        (["--cache_strategy", "heavy_hitter", "--count_threshold", "inf"], "count_threshold must be"),
        (
            ["--cache_strategy", "clusterkv", "--kmeans_iterations", "100000"],
            "kmeans_iterations must be an integer from 1 to 1000, got 100000",
        ),
        (["--cache_strategy", "lagkv", "--lagkv_size", str(2**40)], "lagkv_size must be an integer from 1 to 131072"),
        (["--batch_size", "100000000"], "--batch_size 100000000 needs about"),
        (["--cache_strategy", "kvcompress", "--kvc_pool_blocks", "100000000"], "kvc_pool_blocks 100000000 needs about"),
        (
            ["--cache_strategy", "window", "--head_budget", "adakv"],
            "WindowCache: --head_budget adakv shares a layer's slots by how each head scores",
        ),
        (
            ["--cache_config", "kvcompress", "--prompts_file", "{tmp}/two.txt", "--prefill_chunk", "64"],
            "--attention_loss or --prefill_chunk",
        ),
    ],
)
def test_bad_generate_inputs_are_one_line_naming_the_value(argv, error, tmp_path, capsys):
    (tmp_path / "dup.yaml").write_text("cache_strategy: l2\nrecent_window: 4\nrecent_window: 8\n")
    (tmp_path / "latin1.yaml").write_bytes("cache_strategy: l2 # café\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "two.txt").write_text("The history of\nOnce upon\n")
    (tmp_path / "empty_tile.yaml").write_text(
        "cache_strategy: l2\nmax_cache_length: []\nmax_cache_length_pattern: tile\n"
    )
    (tmp_path / "empty_repeat.yaml").write_text("cache_strategy: []\ncache_strategy_pattern: repeat\n")
    with pytest.raises(SystemExit) as exit_info:
        generate.main([arg.format(tmp=tmp_path) for arg in argv])
    lines = capsys.readouterr().err.splitlines()  # the error, after at most the line saying the model loaded
    assert (
        exit_info.value.code in (1, 2) and lines[-1].startswith("error: ") and error in lines[-1] and len(lines) <= 2
    ), lines


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("n_layer", "30", "model config n_layer must be an integer, got '30'"),
        ("n_local_heads", 0, "model config n_local_heads must be > 0"),
        ("rope_base", 0.0, "model config rope_base must be > 0 (and finite), got 0.0"),
        ("norm_eps", -1e-5, "model config norm_eps must be > 0 (and finite), got -1e-05"),
        ("tie_embeddings", "yes", "model config tie_embeddings must be true or false, got 'yes'"),
    ],
)
def test_a_checkpoint_config_out_of_range_is_refused(field, value, error, tiny_ckpt):
    from kvlab.checkpoint import CheckpointError, load_checkpoint

    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["model"][field] = value
    (tiny_ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"{tiny_ckpt / 'config.json'}: bad 'model' section ({error}")):
        load_checkpoint(tiny_ckpt)


def test_eval_writes_each_cache_size_one_way_and_refuses_repeats(capsys):
    import eval as kv_eval
    from kvlab.jobs import parse_size

    assert [parse_size(text) for text in ("0.5", ".5", "0.50", "512", "1.0", "1")] == [
        "0.5",
        "0.5",
        "0.5",
        "512",
        "1.0",
        "1",
    ]
    with pytest.raises(SystemExit):
        kv_eval.main(["--tasks", "niah_single_1", "--cache_config", "l2", "--cache_sizes", "0.5", ".5", "0.50"])
    assert capsys.readouterr().err == "error: --cache_sizes gives the same value twice: 0.5 0.5 0.5; give each once\n"


def test_leaderboard_checks_its_ratios_before_any_sweep(capsys):
    import leaderboard

    with pytest.raises(SystemExit):
        leaderboard.main(["--ratios", "0.5", "1"])
    assert "a compression ratio is the share of the prompt removed, in [0, 1), got '1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        leaderboard.main(["--processes", "0"])
    assert "argument --processes: must be >= 1, got 0" in capsys.readouterr().err


def test_out_of_memory_is_one_line_naming_what_to_lower(capsys):
    from kvlab.cli import run_cli

    def allocate(args):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 10 GB"
        )

    with pytest.raises(SystemExit) as exit_info:
        run_cli(allocate, None)
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 1
        and err.startswith("error: out of memory (")
        and "lower --batch_size" in err
        and err.count("\n") == 1
    )


@pytest.mark.parametrize("bits", [[], ["--cache_bits", "4"]])
def test_duo_attention_finds_the_shipped_gates_of_the_default_model(bits, generate_cli):
    """No --duo_gates: the gates shipped for the default model; quantized storage works too, though some
    layers have no retrieval (or no streaming) heads."""
    run = generate_cli("--cache_strategy", "duo_attention", *bits, "--prompt", "Hello", "--max_new_tokens", "2")
    err = run.stderr
    assert run.returncode == 0, err
    assert (
        "duo_attention: the gates calibrated for SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.json)" in err
        and "heads retrieval: 45" in err
    )


@pytest.mark.parametrize(
    "config, weights, error",
    [
        ("[1, 2]", None, "config.json: expected a JSON object of model settings, got list"),
        ('{"model_type": "llama"}', None, "config.json: no 'num_attention_heads', which a llama config.json gives"),
        ("{oops", None, "config.json: not valid JSON ("),
        (
            '{"model_type": "llama", "vocab_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, '
            '"hidden_size": 4, "intermediate_size": 8}',
            b"garbage" * 10,
            "model.safetensors: not a readable safetensors file (",
        ),
    ],
)
def test_a_bad_hugging_face_directory_is_one_line_naming_the_file(config, weights, error, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(config)
    if weights:
        (hf / "model.safetensors").write_bytes(weights)
    with pytest.raises(SystemExit) as exit_info:
        convert_hf_checkpoint.main(["--hf_dir", str(hf), "--out_dir", str(tmp_path / "out")])
    assert str(hf) in one_line_error(capsys, exit_info) and error in str(exit_info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            [
                "--tasks",
                "niah_single_1",
                "--cache_config",
                "heavy_hitter",
                "--cache_sizes",
                "8",
                "--context_lengths",
                "512",
            ],
            "HeavyHitterCache: --max_cache_length gives 8 slots",
        ),
        (["--tasks", "book_kjv", "--ppl_prompt_tokens", "0"], "--ppl_prompt_tokens must lie in [1, 2047]"),
    ],
)
def test_a_refused_eval_leaves_no_directory_behind(flags, error, tmp_path, capsys):
    import eval as kv_eval

    with pytest.raises(SystemExit):
        kv_eval.main([*flags, "--num_samples", "1", "--out_dir", str(tmp_path / "sweep")])
    assert error in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_damaged_results_are_one_line_naming_the_file(tmp_path, capsys):
    import leaderboard
    import plot

    from kvlab.results import write_summary

    (tmp_path / "summary.csv").write_text("config,task\nl2,vt\n")
    with pytest.raises(SystemExit) as exit_info:
        leaderboard.main(["--table_only", "--out_dir", str(tmp_path)])
    assert "summary.csv: no column(s) size, query_agnostic, context_length, value" in one_line_error(capsys, exit_info)
    (tmp_path / "summary.csv").write_text(
        "config,size,query_agnostic,context_length,value\nfull,full,False,1024,50\nl2,512,False,1024,40\n"
    )
    with pytest.raises(SystemExit) as exit_info:  # the full cache and a cache size: no ratio to rank
        leaderboard.main(["--table_only", "--out_dir", str(tmp_path), "--context_length", "1024"])
    assert (
        "summary.csv holds no run of --methods at a ratio (size ratio<r>, prompt prefilled at once) with "
        "--context_length 1024" in one_line_error(capsys, exit_info)
    )
    rows = ["full,full,False,vt,1024,50", "full,full,False,qa_1,1024,60", "kvzip,ratio0.5,True,vt,1024,40"]
    (tmp_path / "summary.csv").write_text(
        "\n".join(["config,size,query_agnostic,task,context_length,value", *rows]) + "\n"
    )
    leaderboard.main(["--table_only", "--out_dir", str(tmp_path), "--context_length", "1024", "--methods", "kvzip"])
    # a sweep still running: its table
    assert "| kvzip | 40.0 (1/2 tasks) |" in (tmp_path / "leaderboard.md").read_text()
    # but no complete cell to plot
    assert "no plot" in capsys.readouterr().err and not (tmp_path / "leaderboard.png").exists()
    (tmp_path / "summary.csv").write_text("config,task,context_length,metric,value,compression\nl2,vt,512,acc,50,inf\n")
    with pytest.raises(SystemExit) as exit_info:
        plot.main([str(tmp_path)])
    assert "line 2: compression 'inf' cannot be plotted (a finite number, > 0)" in one_line_error(capsys, exit_info)
    config_dir = tmp_path / "SmolLM2-135M-Instruct" / "l2"
    config_dir.mkdir(parents=True)
    (config_dir / "runs.json").write_text('{"0.5": {"tasks": {"vt@512": {"metric": "acc", "value": 50.0}}}}')
    with pytest.raises(
        ValueError, match=r"runs.json 0.5 vt@512: no n, compression; remove that task from it and rerun"
    ):
        write_summary(tmp_path)
    (config_dir / "runs.json").write_text("{garbage")
    with pytest.raises(ValueError, match=r"runs.json: not valid JSON"):
        write_summary(tmp_path)


@pytest.mark.parametrize("content", ["{garbage", '{"model": 3}', ""])
def test_a_damaged_tokenizer_file_is_one_error_naming_it(content, tiny_ckpt):
    from kvlab.checkpoint import load_checkpoint

    (tiny_ckpt / "tokenizer.json").write_text(content)
    with pytest.raises(
        ValueError, match=re.escape(f"{tiny_ckpt / 'tokenizer.json'}: not a readable bpe tokenizer file (")
    ):
        load_checkpoint(tiny_ckpt)


@pytest.mark.parametrize("command", ["generate.py", "eval.py"])
def test_ctrl_c_while_torch_loads_is_one_line(command):
    """SIGINT half a second in, while the command still imports torch (seconds on these machines): one line, status
    130."""
    proc = subprocess.Popen(
        [sys.executable, command, "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "interrupted (Ctrl-C)\n")


def test_a_rank_failing_under_kvlab_launch_ends_with_its_error_and_one_line():
    """torchrun answers a rank's one-line error with its own traceback; kvlab.launch ends with the ranks' error and
    one line naming the rank and its status, which it exits with."""
    cmd = [*two_ranks("kvlab.launch"), "generate.py", "--max_new_tokens", "-3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert set(lines[:-1]) == {"error: argument --max_new_tokens: must be >= 1, got -3 (see --help)"}
    assert re.fullmatch(r"generate\.py: rank [01] failed with exit status 2", lines[-1]), lines[-1]


@pytest.mark.parametrize(
    "flags,code,error",
    [
        (["--nproc_per_node", "0"], 2, "error: --nproc_per_node must be >= 1 (or auto, cpu, gpu), got 0"),
        (
            ["--nnodes", "0", "--nproc_per_node", "1"],
            1,
            "error: torchrun could not start the ranks: min_nodes must be > 0",
        ),
    ],
)
def test_kvlab_launch_refuses_bad_launcher_flags_in_one_line(flags, code, error):
    """What torchrun answers with an AssertionError or ValueError traceback before any rank runs."""
    done = subprocess.run(
        [sys.executable, "-m", "kvlab.launch", *flags, "generate.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code and done.stderr.startswith(error) and done.stderr.count("\n") == 1, done.stderr[
        -2000:
    ]


def test_ctrl_c_under_kvlab_launch_ends_with_the_ranks_line_and_130():
    """SIGINT to the terminal's process group while 2 ranks decode: each rank's one line, no launcher traceback."""
    cmd = [sys.executable, "-m", "kvlab.launch", "--nproc_per_node", "2", "generate.py", "--max_new_tokens", "4000"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    time.sleep(8)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err and "could not start" not in err, err[-2000:]
    assert err.rstrip("\n").endswith("interrupted (Ctrl-C)"), err[-2000:]

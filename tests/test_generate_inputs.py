"""generate.py's bad inputs: each a one-line error naming the value and the valid choices, none a traceback."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

import generate as cli
from conftest import run_main
from kvlab.model import ModelArgs
from test_generate import run_cli

BAD_INPUTS = {
    "unknown strategy": (
        ["--cache_strategy", "bogus"],
        "error: argument --cache_strategy: cache_strategy must be one of full, window, recent_global",
    ),
    "bad dtype": (["--dtype", "fp8"], "error: unknown dtype 'fp8'; choose from: auto, float32, bfloat16, float16"),
    "bad device": (["--device", "tpu"], "error: unknown device 'tpu'; choose from: auto, cpu, cuda, cuda:N"),
    "no cuda": (["--device", "cuda"], "error: --device cuda was given but no CUDA GPU is available"),
    "zero tokens": (["--max_new_tokens", "0"], "error: argument --max_new_tokens: must be >= 1, got 0 (see --help)"),
    "not a number": (
        ["--max_new_tokens", "many"],
        "error: argument --max_new_tokens: invalid positive_int value: 'many' (see --help)",
    ),
    "unknown flag": (["--cache_size", "3"], "error: unrecognized arguments: --cache_size 3 (see --help)"),
    "negative temperature": (
        ["--temperature", "-1"],
        "error: --temperature must be 0 (greedy) or a finite number >= 0.0001, got -1.0",
    ),
    "missing prompt file": (["--prompt", "nowhere.txt"], "error: prompt file 'nowhere.txt' does not exist"),
    "prompt is a directory": (
        ["--prompt", "tests/data"],
        "error: --prompt 'tests/data' is a directory; give a text file or the prompt text itself",
    ),
    "prompt is a binary file": (
        ["--prompt", sys.executable],
        f"error: --prompt {sys.executable!r} is not a UTF-8 text file",
    ),
    "nan temperature": (
        ["--temperature", "nan"],
        "error: --temperature must be 0 (greedy) or a finite number >= 0.0001, got nan",
    ),
    "infinite temperature": (
        ["--temperature", "inf"],
        "error: --temperature must be 0 (greedy) or a finite number >= 0.0001, got inf",
    ),
    "subnormal temperature": (
        ["--temperature", "1e-310"],
        "error: --temperature must be 0 (greedy) or a finite number >= 0.0001, got 1e-310",
    ),
    "top_k when greedy": (
        ["--top_k", "5"],
        "error: --top_k 5 applies to sampling; give a --temperature > 0 with it (0, the default, is greedy)",
    ),
    "system prompt without chat": (
        ["--system_prompt", "Be brief."],
        "error: --system_prompt applies to --chat; add --chat, or drop --system_prompt",
    ),
    "missing checkpoint": (
        ["--checkpoint_path", "/nonexistent/ckpt"],
        "error: no kvlab checkpoint at /nonexistent/ckpt (no config.json)",
    ),
    "cache length for full": (
        ["--max_cache_length", "0.5"],
        "error: --max_cache_length needs a compressing --cache_strategy; full keeps every token",
    ),
    "bad cache length": (
        ["--cache_strategy", "l2", "--max_cache_length", "1.5"],
        "error: argument --max_cache_length: max_cache_length must be a slot count >= 1 or a fraction in (0, "
        "1], got 1.5",
    ),
    "bad cache bits": (
        ["--cache_bits", "3"],
        "error: argument --cache_bits: cache_bits must be one of 32, 16, 8, 4, 2, got 3",
    ),
    "option of another strategy": (
        ["--cache_strategy", "l2", "--history_window", "8"],
        "error: --history_window does not apply to --cache_strategy l2; it applies to: heavy_hitter",
    ),
    "eviction option for full": (
        ["--global_tokens", "2"],
        "error: --global_tokens does not apply to --cache_strategy full; it applies to: window",
    ),
    "cache too small": (
        ["--cache_strategy", "l2", "--max_cache_length", "8"],
        "error: L2Cache: --max_cache_length gives 8 slots here; the cache needs more than --global_tokens 4 + "
        "--recent_window 10: raise --max_cache_length or lower --recent_window/--global_tokens",
    ),
    "unknown compressor": (
        ["--cache_strategy", "l2", "--prompt_compression_strategy", "bogus"],
        "error: argument --prompt_compression_strategy: prompt_compression_strategy must be one of full, recent_global",
    ),
    "bad snapkv option": (
        ["--cache_strategy", "l2", "--prompt_compression_strategy", "snapkv", "--snapkv_pooling", "median"],
        "error: argument --snapkv_pooling: snapkv_pooling must be max or avg, got 'median'",
    ),
    "attention loss compiled": (
        ["--attention_loss", "--compile"],
        "error: --attention_loss runs eagerly (it records every step); drop --compile",
    ),
    "longer than context": (
        ["--max_new_tokens", "9000"],
        "error: --max_new_tokens 9000 with a prompt of 7 tokens exceeds the model's context of 8192 tokens; "
        "give --max_new_tokens <= 8185",
    ),
    "huge max_new_tokens": (
        ["--max_new_tokens", "1000000000000"],
        "error: --max_new_tokens 1000000000000 with a prompt of 7 tokens exceeds the model's context of 8192 "
        "tokens; give --max_new_tokens <= 8185",
    ),
    "prompt fills the context": (
        ["--prompt", "word " * 8200],
        "error: a prompt of 8201 tokens leaves no room in the model's context of 8192 tokens; shorten it",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_error_line(case, capsys):
    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    args, message = BAD_INPUTS[case]
    # in this process: an exception other than the one-line exit fails the test
    proc = run_main(cli.main, capsys, *args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(message)
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error") and not line.startswith(message)]


def test_checkpoint_of_unknown_shape_is_one_error_line(tmp_path, smollm_dir):
    config = json.loads((smollm_dir / "config.json").read_text())
    config["model"]["n_embd"] = 576
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_cli("--checkpoint_path", str(tmp_path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    # from the code: a checkpoint on disk may predate a field
    valid = sorted(f.name for f in dataclasses.fields(ModelArgs))
    unknown = f"unknown model config keys ['n_embd']; valid keys: {valid}"
    reconvert = f"reconvert it (scripts/convert_hf_checkpoint.py, or delete {tmp_path} and convert again)"
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'}: bad 'model' section ({unknown}); {reconvert}"
    ]

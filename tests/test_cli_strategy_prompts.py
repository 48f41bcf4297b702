"""Every strategy and config on a one-token and a long prompt with generate.py's defaults: a fraction below
what a strategy protects raised to it with one line, and each strategy's own prompt options taken."""

from __future__ import annotations

import re

import pytest
import torch

import generate
from conftest import ROOT, miniature_smollm, paul_graham_text
from kvlab.build import make_caches
from kvlab.strategies import CACHE_STRATEGIES

STRATEGIES_AND_CONFIGS = [["--cache_strategy", s] for s in CACHE_STRATEGIES] + [
    ["--cache_config", f"configs/{p.name}"] for p in sorted((ROOT / "configs").glob("*.yaml"))
]


@pytest.mark.parametrize("case", STRATEGIES_AND_CONFIGS, ids=lambda case: case[1])
def test_every_strategy_and_config_runs_on_a_one_token_prompt(case, generate_cli):
    """Defaults that fit any prompt: a fraction below what the strategy protects is raised to it, which one line
    says; on a prompt this short, a strategy protecting 4 sinks and 10 recent tokens then evicts nothing, and one
    protecting only the newest token (as kvpress's presses) keeps its half of the 9 tokens, with no note."""
    run = generate_cli(*case, "--prompt", "Hello", "--max_new_tokens", "8", "--ignore_eos")
    err = run.stderr
    assert run.returncode == 0, err
    assert "prefill: 1 tokens" in err and "decode: 6 tokens" in err, err  # the first step is timed apart
    report = next(line for line in err.splitlines() if line.startswith("KV cache ("))
    held = int(re.search(r": (\d+) of 8 tokens held", report).group(1))
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert all(note.endswith(("so nothing is evicted", f"so using {held}")) for note in notes), notes
    if case[1] in WITHOUT_A_FLOOR or any(note.endswith("so nothing is evicted") for note in notes):
        assert held == 8 or "hybrid" in case[1], report  # FastGen's policies drop tokens by design
    assert bool(notes) == (case[1] not in WITHOUT_A_FLOOR | PROTECTING_THE_NEWEST_ONLY), notes
    assert (held == 4) == (case[1] in PROTECTING_THE_NEWEST_ONLY), report  # int(0.5 x 9)


# kvpress's presses (and SnapKV as its paper ran it) protect only the newest token: half of 9 tokens is above their
# floor (2), so nothing is raised.
PROTECTING_THE_NEWEST_ONLY = {
    f"configs/{name}.yaml"
    for name in (
        "l2", "keydiff", "tova", "snapkv", "snapkv_paper", "pyramidkv", "chunkkv", "critical_snapkv",
        "critical_ada_snapkv",
    )
}  # fmt: skip
# Nothing to raise: keeps every token, sizes itself (FastGen, the paged pool, DuoAttention's retrieval heads),
# or a slot count of its own (the ClusterKV and Quest configs: 512 slots, more than this run's 9 tokens).
WITHOUT_A_FLOOR = {"full", "hybrid", "kvcompress", "duo_attention"} | {
    f"configs/{name}.yaml"
    for name in (
        "full",
        "hybrid",
        "kvcompress",
        "kvcompress_full",
        "kvc_ada_snapkv",
        "duo_attention",
        "duo_attention_ring",
        "quantized_4bit",
        "clusterkv",
        "quest",
    )
}


@pytest.mark.parametrize(
    "flags, note",
    [
        (
            ["--max_cache_length", "0.5"],
            "note: --max_cache_length 0.5 gives 9 of 18 slots here; heavy_hitter needs at least 15 (its "
            "protected tokens + 1), so using 15",
        ),
        (
            ["--compression_ratio", "0.9"],
            "note: --compression_ratio 0.9 keeps 0 of 6 prompt tokens here; heavy_hitter needs at least 15 (its "
            "protected tokens + 1), so nothing is evicted",
        ),
        (
            ["--compression_ratio", "0"],
            "note: --compression_ratio 0.0 keeps 6 of 6 prompt tokens here; heavy_hitter needs at least 15 (its "
            "protected tokens + 1), so nothing is evicted",
        ),
    ],
)
def test_a_fraction_below_the_protected_tokens_is_raised_to_them(flags, note, generate_cli):
    """The design card's command on a short prompt: 6 prompt + 12 new tokens (a cache of 17 tokens:
    the last one generated is never stored)."""
    run = generate_cli(
        "--cache_strategy",
        "heavy_hitter",
        *flags,
        "--prompt",
        "The history of the printing press",
        "--max_new_tokens",
        "12",
        "--ignore_eos",
    )
    err = run.stderr
    assert run.returncode == 0, err
    held = 15 if flags[0] == "--max_cache_length" else 17
    assert f"KV cache (heavy_hitter): {held} of 17 tokens held" in err, err
    assert [line for line in err.splitlines() if line.startswith("note:")] == [note], err


@pytest.fixture(scope="module")
def long_prompt(smollm, tmp_path_factory):
    tokenizer = smollm[1]
    path = tmp_path_factory.mktemp("prompt") / "long.txt"
    path.write_text(tokenizer.decode(tokenizer.encode(paul_graham_text())[:3000]))
    assert len(tokenizer.encode(path.read_text())) == 3000
    return path


@pytest.mark.slow
@pytest.mark.parametrize("case", STRATEGIES_AND_CONFIGS, ids=lambda case: case[1])
def test_every_strategy_and_config_runs_on_a_long_prompt(case, long_prompt, smollm, smollm_dir, monkeypatch, capsys):
    """3,000 prompt tokens, 8 new, through the command line on the miniature: the defaults compress without a note."""
    # the default model's name: its shipped DuoAttention gates
    miniature = (miniature_smollm(), smollm[1], {"name": "SmolLM2-135M-Instruct"})
    monkeypatch.setattr(generate, "load_checkpoint", lambda *args, **kwargs: miniature)
    monkeypatch.setattr(generate, "default_checkpoint", lambda: smollm_dir)
    generate.main([*case, "--prompt", str(long_prompt), "--max_new_tokens", "8", "--ignore_eos"])
    err = capsys.readouterr().err
    report = next(line for line in err.splitlines() if line.startswith("KV cache ("))
    assert "prefill: 3000 tokens" in err and "of 3007 tokens held" in report and "note:" not in err, err
    if case[0] == "--cache_strategy" and case[1] in (
        "window",
        "recent_global",
        "l2",
        "keydiff",
        "heavy_hitter",
        "tova",
        "expected_attention",
        "lagkv",
        "rkv",
        "random",
    ):
        assert "1504 of 3007 tokens held" in report, report  # the default 0.5 of 3,008 slots


@pytest.mark.parametrize(
    "strategy, option, value, attribute",
    [
        ("lagkv", "lagkv_size", 8, "lag"),
        ("rkv", "rkv_window", 4, "window"),
        ("expected_attention", "ea_future", 64, "future"),
    ],
)
def test_a_strategy_takes_its_own_prompt_options(strategy, option, value, attribute):
    """--lagkv_size with --cache_strategy lagkv configures lagkv's own prompt compressor (no
    --prompt_compression_strategy needed); with another strategy it stays an error naming the owner."""
    cache = make_caches(strategy, 1, 1, 1, 32, 8, torch.float32, **{option: value})[0]
    assert getattr(cache.prompt_compressor, attribute) == value
    with pytest.raises(ValueError, match=rf"got \['{option}'\] \(they apply to {strategy}\)"):
        make_caches("l2", 1, 1, 1, 32, 8, torch.float32, **{option: value})

"""YAML cache configs: validation, per-layer patterns, precedence, and every shipped config runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from kvlab.config import CONFIGS_DIR, per_layer
from kvlab.config_files import load_cache_config, resolve_settings

SHIPPED = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def test_per_layer_patterns():
    assert per_layer("l2", None, 3) == ["l2", "l2", "l2"]
    assert per_layer(["full", "recent_global"], "tile", 5) == ["full", "recent_global", "full", "recent_global", "full"]
    assert per_layer([0.9, 0.5, 0.1], "repeat", 6) == [0.9, 0.9, 0.5, 0.5, 0.1, 0.1]
    assert per_layer([1, 2, 3], None, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="a list of 2 values for 5 layers needs a pattern: tile, repeat"):
        per_layer([1, 2], None, 5)


def test_command_line_overrides_config_which_overrides_defaults():
    config = {"cache_strategy": "heavy_hitter", "max_cache_length": 0.5, "recent_window": 10}
    cli = {"cache_strategy": None, "max_cache_length": 64, "recent_window": None, "global_tokens": None}
    assert resolve_settings(cli, config) == {
        "cache_strategy": "heavy_hitter",
        "max_cache_length": 64,
        "recent_window": 10,
    }
    # a size on the command line replaces the config's, of either kind
    ratio = {"compression_ratio": 0.75, "max_cache_length": None}
    assert resolve_settings(ratio, config) == {
        "cache_strategy": "heavy_hitter",
        "compression_ratio": 0.75,
        "recent_window": 10,
    }
    patterned = {**config, "max_cache_length": [0.2, 0.8], "max_cache_length_pattern": "tile"}
    assert resolve_settings({"max_cache_length": 0.3}, patterned) == {**config, "max_cache_length": 0.3}


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "cache_strategy: l2\ncache_lenght: 5\n",
            "unknown key 'cache_lenght'; valid keys: cache_strategy, max_cache_length",
        ),
        ("max_cache_length: 1.5\n", "max_cache_length must be a slot count >= 1 or a fraction in (0, 1], got 1.5"),
        ("cache_bits: 3\n", "cache_bits must be one of 32, 16, 8, 4, 2, got 3"),
        ("cache_strategy: h2o\n", "cache_strategy must be one of full, window, recent_global"),
        ("global_tokens: four\n", "global_tokens must be an integer from 0 to 131072, got 'four'"),
        ("compress_first_token: 1\n", "compress_first_token must be true or false, got 1"),
        ("max_cache_length: [0.5, 2.5]\nmax_cache_length_pattern: tile\n", "got 2.5"),
        (
            "cache_strategy: [full, l2]\ncache_strategy_pattern: zigzag\n",
            "cache_strategy_pattern must be one of tile, repeat, got 'zigzag'",
        ),
        ("- a list\n", "expected a mapping of settings, got list"),
        ("cache_strategy: [l2\n", "not valid YAML"),
    ],
)
def test_bad_configs_are_rejected_with_the_key_and_valid_values(tmp_path: Path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_cache_config(str(path))
    assert message in str(e.value)


def test_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(
        ValueError,
        match="cache config .nope. not found; give a .yaml path or one of: ada_expected_attention, "
        "ada_pyramidkv, ada_snapkv",
    ):
        load_cache_config("nope")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_runs(name, generate_cli):
    # 160 tokens: 10% = 17 slots
    prompt = " ".join(["The history of the printing press begins in the fifteenth century, in Mainz."] * 10)
    proc = generate_cli("--cache_config", name, "--max_new_tokens", "8", "--prompt", prompt)
    assert proc.returncode == 0, proc.stderr
    report = next(line for line in proc.stderr.splitlines() if line.startswith("KV cache ("))
    assert report.startswith(f"KV cache ({name}): ")
    if name in (
        "pyramid",
        "funnel",
        "pyramidkv",
        "squeeze_heavy_hitter",
        "squeeze_recent_global",
        "ada_pyramidkv",
        "kvc_ada_pyramidkv",
    ):
        assert (
            "tokens held per layer: " in proc.stderr
            and "layer budgets (slots per layer, first sequence): " in proc.stderr
        )
    # Ada-KV's configs, kvzip's ranking over the model, their oracles
    split = load_cache_config(name).get("head_budget", "uniform") != "uniform"
    assert ("head budgets (slots per KV head and layer, first sequence): " in proc.stderr) == split
    assert split == (name.startswith(("ada_", "critical_ada_", "oracle_")) or name == "kvzip")


def test_flags_override_a_shipped_config(generate_cli):
    proc = generate_cli(
        "--cache_config", "heavy_hitter", "--max_cache_length", "16", "--recent_window", "4", "--max_new_tokens", "8"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "KV cache (heavy_hitter): 14 of 14 tokens held per layer and KV head on average (1.00x compression)"
        in proc.stderr
    )
    assert (ROOT / "configs" / "heavy_hitter.yaml").exists()


def test_per_layer_list_of_the_wrong_length_names_the_key():
    from kvlab.config import cache_spec

    settings = {"cache_strategy": "l2", "max_cache_length": [0.5, 0.25, 0.1]}
    with pytest.raises(
        ValueError, match=r"^max_cache_length: a list of 3 values for 30 layers needs max_cache_length_pattern"
    ):
        cache_spec(settings, 30)


def test_per_layer_list_of_the_wrong_length_names_the_file(tmp_path: Path, generate_cli):
    """Only YAML gives lists, so the command line's error names the file as well as the key."""
    path = tmp_path / "three.yaml"
    path.write_text("cache_strategy: l2\nmax_cache_length: [0.5, 0.25, 0.1]\n")
    proc = generate_cli("--cache_config", str(path), "--max_new_tokens", "2")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {path}: max_cache_length: a list of 3 values for 30 layers needs max_cache_length_pattern: "
        "tile, repeat (or exactly 30 values)"
    )

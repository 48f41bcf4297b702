"""Cache configurations: YAML files (configs/*.yaml) and command-line flags share one schema.

Keys are generate.py's flag names. Precedence: a flag given on the command line > the YAML file >
defaults. `cache_strategy` and `max_cache_length` may be per-layer lists, spread over the model's
layers by `<key>_pattern`: `tile` (a b a b ...) or `repeat` (a a ... b b ..., equal blocks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
PER_LAYER_KEYS = ("cache_strategy", "max_cache_length")
PATTERNS = ("tile", "repeat")
# key: (accepted types, description of valid values)
CACHE_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "cache_strategy": ((str,), "a strategy name"),
    "max_cache_length": ((int, float), "a slot count >= 1 or a fraction in (0, 1]"),
    "global_tokens": ((int,), "an integer >= 0"),
    "recent_window": ((int,), "an integer >= 1"),
    "prompt_compression_strategy": ((str,), "a prompt compressor name"),
    "snapkv_window": ((int,), "an integer >= 1"),
    "snapkv_kernel": ((int,), "an odd integer >= 1"),
    "snapkv_pooling": ((str,), "max or avg"),
    "snapkv_gqa": ((str,), "mean, max or sum"),
    "compress_first_token": ((bool,), "true or false"),
}


def check_cache_length(value: Any) -> int | float:
    """An absolute slot count (an integer >= 1) or a fraction in (0, 1] of prompt + max_new_tokens."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (isinstance(value, int) and value >= 1 or 0 < value <= 1):
        raise ValueError(f"max_cache_length: expected a slot count >= 1 or a fraction in (0, 1], got {value!r}")
    return value


def load_cache_config(name_or_path: str) -> dict[str, Any]:
    """A validated config: a path to a .yaml file, or the name of one in configs/."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIGS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
        raise ValueError(f"cache config {name_or_path!r} not found; give a .yaml path or one of: {known}")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(config).__name__}")
    valid = [*CACHE_KEYS, *(f"{k}_pattern" for k in PER_LAYER_KEYS)]
    for key, value in config.items():
        if key not in valid:
            raise ValueError(f"{path}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        if key.endswith("_pattern"):
            if value not in PATTERNS:
                raise ValueError(f"{path}: {key} must be one of {', '.join(PATTERNS)}, got {value!r}")
            continue
        values = value if isinstance(value, list) and key in PER_LAYER_KEYS else [value]
        types, description = CACHE_KEYS[key]
        for v in values:
            if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
                raise ValueError(f"{path}: {key} must be {description}{' (or a list of them)' if key in PER_LAYER_KEYS else ''}, got {v!r}")
            if key == "max_cache_length":
                check_cache_length(v)
    return config


def resolve_settings(cli: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """CLI values that were given (not None) override the config's."""
    return {**config, **{k: v for k, v in cli.items() if v is not None}}


def per_layer(value: Any, pattern: str | None, n_layer: int) -> list[Any]:
    """A scalar for every layer, or a list spread over the layers by `pattern` (a list of exactly
    n_layer values needs none)."""
    if not isinstance(value, list):
        return [value] * n_layer
    if len(value) == n_layer and pattern is None:
        return list(value)
    if pattern == "tile":
        return [value[i % len(value)] for i in range(n_layer)]
    if pattern == "repeat":
        return [value[i * len(value) // n_layer] for i in range(n_layer)]
    raise ValueError(f"a list of {len(value)} values for {n_layer} layers needs a pattern: {', '.join(PATTERNS)}")

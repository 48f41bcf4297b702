"""Cache config files: configs/*.yaml by name or path, read strictly (a repeated key is refused, not overwritten), and
merged with the flags a command line gives (a given flag wins)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvlab.config import CACHE_KEYS, CONFIGS_DIR, PATTERNS, PER_LAYER_KEYS, check_value


def config_path(name_or_path: str) -> Path:
    """A config's file: the path itself, or for a bare name the file in configs/."""
    path = Path(name_or_path)
    return CONFIGS_DIR / f"{name_or_path}.yaml" if not path.suffix else path


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives one key twice (where the last would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_cache_config(name_or_path: str) -> dict[str, Any]:
    """A validated config: a path to a .yaml file, or the name of one in configs/."""
    path = config_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
        raise ValueError(f"cache config {name_or_path!r} not found; give a .yaml path or one of: {known}")
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
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
        for v in value if isinstance(value, list) and key in PER_LAYER_KEYS else [value]:
            try:
                check_value(key, v)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
    return config


def resolve_settings(cli: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """CLI values that were given (not None) override the config's; a cache size given (--compression_ratio or
    --max_cache_length) replaces the config's size of either kind."""
    given = {k: v for k, v in cli.items() if v is not None}
    if {"compression_ratio", "max_cache_length"} & set(given):
        config = {
            k: v
            for k, v in config.items()
            if k not in ("compression_ratio", "max_cache_length", "max_cache_length_pattern")
        }
    return {**config, **given}

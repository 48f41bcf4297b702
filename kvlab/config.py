"""Cache configuration: YAML files (configs/*.yaml) and command-line flags -> one `CacheSpec`.

Every setting is declared once, as an `Option`, by what uses it (a strategy, a prompt compressor,
storage, a budget planner, or the few general ones below); the flags, `--help`, YAML validation and
the README's table are derived from those declarations. Precedence: a flag given on the command
line > the YAML file > defaults. `cache_strategy` and `max_cache_length` may be per-layer lists,
spread over the model's layers by `<key>_pattern`: `tile` (a b a b ...) or `repeat` (a a ... b b ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.budget import LAYER_BUDGET_OPTION, PLANNER_OPTIONS
from kvlab.cache import KVCache
from kvlab.options import Option, by_name, choice, integer, switch
from kvlab.prompt_compression import PromptCompressor
from kvlab.reconstruction import RepeatRequest, repeat_request
from kvlab.strategies import CACHE_STRATEGIES, PROMPT_COMPRESSORS, make_prompt_compressor
from kvlab.tokenizer import Tokenizer

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
PER_LAYER_KEYS = ("cache_strategy", "max_cache_length")
PATTERNS = ("tile", "repeat")


def _is_cache_length(value: Any) -> bool:
    return isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value <= 1


GENERAL_OPTIONS = (
    choice("cache_strategy", tuple(CACHE_STRATEGIES), "full", "KV cache strategy"),
    Option(
        "max_cache_length",
        (int, float),
        "a slot count >= 1 or a fraction in (0, 1]",
        "KV slots per sequence, layer and KV head for a compressing strategy: a count (512) or a fraction of "
        "each sequence's own prompt + max_new_tokens (0.5)",
        check=_is_cache_length,
        default_help="0.5; 1.0 for hybrid and duo_attention",
    ),
    choice(
        "prompt_compression_strategy",
        tuple(PROMPT_COMPRESSORS),
        None,
        "how prompt tokens are chosen when the prompt is longer than the cache",
        default_help="the cache strategy's own score, e.g. heavy_hitter for heavy_hitter, recent_global for window",
    ),
    Option(
        "compression_ratio",
        (int, float),
        "a fraction in [0, 1)",
        "kvpress's protocol, instead of max_cache_length: remove this share of each prompt's tokens at prefill "
        "and keep every token decoded after it (evicting strategies that rank the prompt; for duo_attention, as "
        "kvpress's DuoAttentionPress: the share of KV heads that stream, replacing duo_retrieval)",
        check=lambda v: 0 <= v < 1,
        default_help="unset",
    ),
    integer(
        "full_layers",
        0,
        "keep the first N layers uncompressed, whatever the strategy (ClusterKV and Quest leave 2)",
        minimum=0,
    ),
    integer(
        "prefill_chunk",
        None,
        "prefill the prompt N tokens at a time, compressing every layer back to its budget after each chunk: "
        "memory bounded by the budget + N whatever the prompt's length",
        default_help="the whole prompt at once; generate.py with a full cache: 512",
    ),
    switch(
        "compress_first_token",
        "decode the prompt's last token through the compressed cache, so the first generated token already sees "
        "compression",
    ),
    LAYER_BUDGET_OPTION,
    *dict.fromkeys(o for options in PLANNER_OPTIONS.values() for o in options),
)
# what CacheSpec holds apart from cache options
SPEC_KEYS = {o.name for o in GENERAL_OPTIONS if o.name != "prompt_compression_strategy"}


def strategy_options(cls: type[KVCache]) -> dict[str, Option]:
    """Every setting a strategy takes: its own, and a prompt compressor's where it keeps prompt tokens by one."""
    options = by_name(cls.options)
    if cls.takes_prompt_compressor:
        options["prompt_compression_strategy"] = by_name(GENERAL_OPTIONS)["prompt_compression_strategy"]
        options |= {o.name: o for c in PROMPT_COMPRESSORS.values() for o in c.options}
    return options


CACHE_KEYS: dict[str, Option] = {
    **by_name(GENERAL_OPTIONS),
    **{name: o for cls in CACHE_STRATEGIES.values() for name, o in strategy_options(cls).items()},
}


@dataclass
class CacheSpec:
    """Everything that decides the caches, per layer: the one object passed from config to caches to engine."""

    strategies: list[str]
    lengths: list[int | float | None]  # per layer: slots, a fraction of each sequence, or None (every token)
    # cache settings by flag name (each layer takes those its strategy declares)
    options: dict[str, Any] = field(default_factory=dict)
    compress_first_token: bool = False
    # kvpress's: the share of the prefilled tokens removed; None: sized by `lengths`
    compression_ratio: float | None = None
    layer_budget: str = "uniform"  # how each sequence's total budget is split over the layers (budget.py)
    budget_options: dict[str, Any] = field(default_factory=dict)  # the planner's settings (squeeze_p, pyramid_beta)
    # special_ids, punctuation_ids for caches that read tokens
    token_classes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # KVzip's request to repeat the context, encoded (filled when given the tokenizer)
    repeat: RepeatRequest | None = None
    # prefill this many tokens at a time, compressing between chunks (chunked.py); None: at once
    prefill_chunk: int | None = None

    @classmethod
    def full(cls, n_layer: int) -> CacheSpec:
        return cls(["full"] * n_layer, [None] * n_layer)


def cache_spec(
    settings: dict[str, Any], n_layer: int, tokenizer: Tokenizer | None = None, source: str | None = None
) -> CacheSpec:
    """Validate resolved settings (YAML + flags, by flag name) and spread them over the layers. A strategy
    that reads token ids (hybrid) takes the tokenizer's special and punctuation ids (none without one).
    `source` (the YAML file the settings came from) is named in errors about per-layer lists, which only YAML gives."""
    for key, value in settings.items():
        if key not in CACHE_KEYS and not key.endswith("_pattern"):
            raise ValueError(f"unknown cache setting {key!r}; valid: {', '.join(CACHE_KEYS)}")
        if key not in PER_LAYER_KEYS and key in CACHE_KEYS:
            CACHE_KEYS[key].validate(value)
    strategy = settings.get("cache_strategy", "full")
    names = list(dict.fromkeys(strategy if isinstance(strategy, list) else [strategy]))
    options = {k: v for k, v in settings.items() if k in CACHE_KEYS and k not in SPEC_KEYS}
    if names == ["full"] and "max_cache_length" in settings:
        raise ValueError("--max_cache_length needs a compressing --cache_strategy; full keeps every token")
    for option in options:
        if not any(option in strategy_options(CACHE_STRATEGIES[name]) for name in names):
            takers = [name for name, cls in CACHE_STRATEGIES.items() if option in strategy_options(cls)]
            raise ValueError(
                f"--{option} does not apply to --cache_strategy {', '.join(names)}; it applies to: {', '.join(takers)}"
            )
    strategies = per_layer(strategy, settings.get("cache_strategy_pattern"), n_layer, "cache_strategy", source)
    for name in strategies:
        CACHE_KEYS["cache_strategy"].validate(name)
    lengths = cache_lengths(settings, strategies, n_layer, source)
    token_classes = {}
    if tokenizer is not None and any(CACHE_STRATEGIES[s].needs_tokens for s in strategies):
        token_classes = dict(
            special_ids=tuple(sorted(tokenizer.specials.values())), punctuation_ids=tokenizer.punctuation_ids
        )
    full_layers = settings.get("full_layers", 0)
    if full_layers >= n_layer:
        raise ValueError(
            f"--full_layers {full_layers} leaves none of the model's {n_layer} layers to compress; give fewer"
        )
    strategies = ["full"] * full_layers + strategies[full_layers:]
    lengths = [None if s == "full" else n for s, n in zip(strategies, lengths, strict=True)]
    planner = settings.get("layer_budget", "uniform")
    budget_options = layer_budget_options(settings, planner, strategies, lengths)
    repeat = repeat_request(tokenizer) if model_scored(strategies, options) else None
    ratio = settings.get("compression_ratio")
    if ratio is not None and {s for s in strategies if s != "full"} == {"duo_attention"}:
        # kvpress's protocol for DuoAttentionPress: the ratio is the share of KV heads that stream
        options["duo_retrieval"] = check_value("duo_retrieval", 1 - float(ratio))
        ratio = None
    if ratio is not None:
        check_ratio(ratio, strategies, lengths, planner, "max_cache_length" in settings)
    first_token = bool(settings.get("compress_first_token", False))
    ratio, chunk = None if ratio is None else float(ratio), settings.get("prefill_chunk")
    return CacheSpec(
        strategies, lengths, options, first_token, ratio, planner, budget_options, token_classes, repeat, chunk
    )


def cache_lengths(settings: dict[str, Any], strategies: list[str], n_layer: int, source: str | None) -> list:
    """Each layer's cache length: --max_cache_length (one, or per layer from YAML), else each strategy's default."""
    if "max_cache_length" not in settings:
        return [CACHE_STRATEGIES[s].default_cache_length for s in strategies]
    lengths = per_layer(
        settings["max_cache_length"], settings.get("max_cache_length_pattern"), n_layer, "max_cache_length", source
    )
    for length in lengths:
        CACHE_KEYS["max_cache_length"].validate(length)
    return lengths


def layer_budget_options(
    settings: dict[str, Any], planner: str, strategies: list[str], lengths: list
) -> dict[str, Any]:
    """The layer budget planner's options, refused where they do not apply (another planner's, or a planner over
    layers that evict nothing)."""
    budget_options = {
        o.name: settings[o.name] for options in PLANNER_OPTIONS.values() for o in options if o.name in settings
    }
    for option in budget_options:
        takers = [p for p, options in PLANNER_OPTIONS.items() if option in by_name(options)]
        if planner not in takers:
            raise ValueError(f"--{option} applies to --layer_budget {' or '.join(takers)}, not {planner}")
    if planner != "uniform" and all(n is None for n in lengths):
        raise ValueError(f"--layer_budget {planner} needs a compressing --cache_strategy; full keeps every token")
    if planner != "uniform" and any(CACHE_STRATEGIES[s].keeps_history for s in strategies):
        raise ValueError(
            f"--layer_budget {planner} splits an evicting cache's budget; clusterkv and quest keep every token "
            "and take none"
        )
    return budget_options


def model_scored(strategies: list[str], options: dict[str, Any]) -> list[PromptCompressor]:
    """The prompt compressors of these layers whose scores need a further pass of the model (KVzip, the oracle)."""
    takers = [CACHE_STRATEGIES[s] for s in dict.fromkeys(strategies) if CACHE_STRATEGIES[s].takes_prompt_compressor]
    name = options.get("prompt_compression_strategy")
    if name and takers:  # as the caches build it, with its options (kvzip_chunk)
        compressors = [
            make_prompt_compressor(
                name, **{o.name: options[o.name] for o in PROMPT_COMPRESSORS[name].options if o.name in options}
            )
        ]
    else:
        compressors = [cls.own_prompt_compressor() for cls in takers]
    return [c for c in compressors if c.needs_model]


def check_ratio(ratio: float, strategies: list[str], lengths: list[Any], planner: str, sized: bool) -> None:
    """--compression_ratio sizes each prompt's share of an evicting cache (of a recallable one: the tokens each step
    attends); it replaces the cache length and the layer planners."""
    takers = [name for name, cls in CACHE_STRATEGIES.items() if cls.takes_prompt_compressor or cls.keeps_history]
    wrong = sorted({s for s, n in zip(strategies, lengths, strict=True) if n is not None and s not in takers})
    if sized:
        raise ValueError(
            "give --compression_ratio or --max_cache_length, not both: the ratio sizes the cache from each prompt"
        )
    if wrong:
        raise ValueError(
            f"--compression_ratio {ratio} applies to strategies that rank the prompt or recall it "
            f"({', '.join(takers)}), not {', '.join(wrong)}"
        )
    if planner not in ("uniform", "pyramid", "funnel"):
        raise ValueError(
            "--compression_ratio takes --layer_budget uniform, pyramid or funnel (kvpress's PyramidKVPress "
            f"counts), not {planner}"
        )
    if all(n is None for n in lengths):
        raise ValueError("--compression_ratio needs a compressing --cache_strategy; full keeps every token")


def check_value(key: str, value: Any) -> Any:
    """`value` if it is valid for `key`, else a ValueError naming the key and its valid values."""
    return CACHE_KEYS[key].validate(value)


def parse_flag(key: str, text: str) -> Any:
    """A command-line value for `key`: a number where the key takes numbers, checked like a YAML value."""
    types = CACHE_KEYS[key].types
    value: Any = text
    try:
        if int in types and text.lstrip("-").isdigit():
            value = int(text)
        elif float in types:
            value = float(text)
    except ValueError:
        pass
    return check_value(key, value)


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per declared setting, its help from the declaration."""
    group = parser.add_argument_group("cache settings (also YAML keys of the same name)")
    for key, option in CACHE_KEYS.items():
        if option.types == (bool,):
            group.add_argument(f"--{key}", action="store_true", default=None, help=option.describe())
        else:
            group.add_argument(
                f"--{key}",
                type=_flag_parser(key),
                default=None,
                metavar=key.upper(),
                help=f"{option.describe()}; {option.valid}",
            )


def _flag_parser(key: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_flag(key, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key
    return parse


def options_table() -> str:
    """The README's table of cache settings, derived from the declarations."""
    rows = ["| flag / YAML key | valid values | what it does |", "|---|---|---|"]
    rows += [f"| `--{key}` | {o.valid} | {o.describe()} |" for key, o in CACHE_KEYS.items()]
    return "\n".join(rows)


def per_layer(
    value: Any, pattern: str | None, n_layer: int, key: str | None = None, source: str | None = None
) -> list[Any]:
    """A scalar for every layer, or a list spread over the layers by `pattern` (a list of exactly
    n_layer values needs none); `key` names the setting in errors, `source` its YAML file."""
    if not isinstance(value, list):
        return [value] * n_layer
    if not value:
        raise ValueError(
            f"{f'{source}: ' if source else ''}{key or 'a per-layer setting'}: an empty list; give one value, "
            "or one per layer"
        )
    if len(value) == n_layer and pattern is None:
        return list(value)
    if pattern == "tile":
        return [value[i % len(value)] for i in range(n_layer)]
    if pattern == "repeat":
        return [value[i * len(value) // n_layer] for i in range(n_layer)]
    if key is None:
        raise ValueError(f"a list of {len(value)} values for {n_layer} layers needs a pattern: {', '.join(PATTERNS)}")
    where = f"{source}: " if source else ""
    raise ValueError(
        f"{where}{key}: a list of {len(value)} values for {n_layer} layers needs {key}_pattern: "
        f"{', '.join(PATTERNS)} (or exactly {n_layer} values)"
    )


if __name__ == "__main__":  # python -m kvlab.config > the README's table
    print(options_table())

"""Cache configurations: YAML files (configs/*.yaml) and command-line flags share one schema.

Keys are generate.py's flag names. Precedence: a flag given on the command line > the YAML file >
defaults. `cache_strategy` and `max_cache_length` may be per-layer lists, spread over the model's
layers by `<key>_pattern`: `tile` (a b a b ...) or `repeat` (a a ... b b ..., equal blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from budget import DEFAULT_PYRAMID_BETA, DEFAULT_SQUEEZE_P, LAYER_BUDGETS
from cache import CACHE_STRATEGIES, DEFAULT_ADAKV_FLOOR, HEAD_BUDGETS
from paged import KVC_METRICS, KVC_SCOPES
from prompt_compression import PROMPT_COMPRESSORS
from recall import RECALL_SELECT, SLOW_TIERS
from storage import KEY_QUANT_AXES, QUANT_BITS

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
PER_LAYER_KEYS = ("cache_strategy", "max_cache_length")
PATTERNS = ("tile", "repeat")


@dataclass(frozen=True)
class CacheKey:
    """One cache setting: a YAML key and the generate.py flag of the same name."""

    types: tuple[type, ...]
    valid: str  # the valid values, in words, for error messages
    help: str
    check: Callable[[Any], bool] = lambda value: True


def _is_cache_length(value: Any) -> bool:
    return isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value <= 1


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: value in choices


CACHE_KEYS: dict[str, CacheKey] = {
    "cache_strategy": CacheKey((str,), f"one of {', '.join(CACHE_STRATEGIES)}", "KV cache strategy (default: full)", _one_of(*CACHE_STRATEGIES)),
    "max_cache_length": CacheKey(
        (int, float),
        "a slot count >= 1 or a fraction in (0, 1]",
        "KV slots per sequence, layer and KV head for a compressing strategy: a count (512) or a fraction of each sequence's own "
        "prompt + max_new_tokens (0.5) (default: 0.5 for compressing strategies)",
        _is_cache_length,
    ),
    "global_tokens": CacheKey((int,), "an integer >= 0", "first tokens never evicted, attention sinks (default: 4; 0 for window)", lambda v: v >= 0),
    "recent_window": CacheKey(
        (int,), "an integer >= 1", "newest tokens never evicted, the incoming one included (default: 10; 1 for hybrid)", lambda v: v >= 1
    ),
    "prompt_compression_strategy": CacheKey(
        (str,),
        f"one of {', '.join(PROMPT_COMPRESSORS)}",
        "how prompt tokens are chosen when the prompt is longer than the cache (default: the cache strategy's own, e.g. heavy_hitter "
        "for heavy_hitter, recent_global for window)",
        _one_of(*PROMPT_COMPRESSORS),
    ),
    "snapkv_window": CacheKey((int,), "an integer >= 1", "snapkv: observation window of last prompt queries (default: 16)", lambda v: v >= 1),
    "snapkv_kernel": CacheKey((int,), "an odd integer >= 1", "snapkv: odd pooling kernel size (default: 7)", lambda v: v >= 1 and v % 2 == 1),
    "snapkv_pooling": CacheKey((str,), "max or avg", "snapkv: max or avg pooling (default: max)", _one_of("max", "avg")),
    "snapkv_gqa": CacheKey(
        (str,),
        "mean, max, sum or query",
        "snapkv: aggregation over the query heads of a KV head (mean, max, sum), or query: select per query head as the reference "
        "code does, repeating KVs per query head (group-size x memory) (default: mean)",
        _one_of("mean", "max", "sum", "query"),
    ),
    "history_window": CacheKey(
        (int,), "an integer >= 1", "heavy_hitter (Scissorhands): count attention over the last N decode steps only (default: all steps)", lambda v: v >= 1
    ),
    "count_threshold": CacheKey(
        (int, float),
        "a number > 0",
        "heavy_hitter (Scissorhands): count the steps where a token's attention reaches this multiple of uniform attention, "
        "instead of summing it (default: sum)",
        lambda v: v > 0,
    ),
    "min_recovery_frac": CacheKey(
        (int, float), "a fraction in (0, 1]", "hybrid (FastGen): attention a head's policy must recover at prefill (default: 0.9)", lambda v: 0 < v <= 1
    ),
    "heavy_hitter_frac": CacheKey(
        (int, float), "a fraction in (0, 1]", "hybrid: share of the sequence a heavy-hitter policy keeps (default: 0.3)", lambda v: 0 < v <= 1
    ),
    "window_frac": CacheKey((int, float), "a fraction in (0, 1]", "hybrid: share of the sequence a window policy keeps (default: 0.3)", lambda v: 0 < v <= 1),
    "cache_bits": CacheKey(
        (int,),
        f"one of {', '.join(map(str, QUANT_BITS))}",
        "store keys and values as packed 8, 4 or 2-bit integers, with any strategy (default: the model's dtype)",
        _one_of(*QUANT_BITS),
    ),
    "key_quant_axis": CacheKey(
        (str,),
        f"one of {', '.join(KEY_QUANT_AXES)}",
        "with --cache_bits: key scales per token or per channel (KIVI) (default: token at 8 bits, channel below)",
        _one_of(*KEY_QUANT_AXES),
    ),
    "layer_budget": CacheKey(
        (str,),
        f"one of {', '.join(LAYER_BUDGETS)}",
        "split each sequence's total budget (max_cache_length x compressing layers) over the layers at prefill, per prompt: uniform "
        "(as configured), pyramid (PyramidKV), funnel (pyramid reversed) or squeeze (SqueezeAttention) (default: uniform)",
        _one_of(*LAYER_BUDGETS),
    ),
    "squeeze_p": CacheKey(
        (int, float),
        "a fraction in (0, 1]",
        f"layer_budget squeeze: the least important layers' share of the uniform budget (default: {DEFAULT_SQUEEZE_P})",
        lambda v: 0 < v <= 1,
    ),
    "pyramid_beta": CacheKey(
        (int,),
        "an integer >= 1",
        f"layer_budget pyramid/funnel: the smallest layer keeps 1/beta of the average's unprotected slots (default: {DEFAULT_PYRAMID_BETA})",
        lambda v: v >= 1,
    ),
    "head_budget": CacheKey(
        (str,),
        f"one of {', '.join(HEAD_BUDGETS)}",
        "split each layer's budget over its KV heads at prefill, per prompt: uniform (every head the same) or adakv (Ada-KV: heads "
        "whose prompt scores rank higher overall get more; buffers are widened to the largest share) (default: uniform)",
        _one_of(*HEAD_BUDGETS),
    ),
    "adakv_floor": CacheKey(
        (int, float),
        "a fraction in [0, 1]",
        f"head_budget adakv: the share of the uniform per-head budget every head is guaranteed (default: {DEFAULT_ADAKV_FLOOR})",
        lambda v: 0 <= v <= 1,
    ),
    "sink_tokens": CacheKey((int,), "an integer >= 0", "clusterkv/quest: first tokens always attended, attention sinks (default: 16)", lambda v: v >= 0),
    "recall_select": CacheKey(
        (str,),
        f"one of {', '.join(RECALL_SELECT)}",
        "clusterkv/quest: choose the attended tokens per KV head (query scores summed over its group) or per query head (default: kv_head)",
        _one_of(*RECALL_SELECT),
    ),
    "reuse_steps": CacheKey(
        (int,), "an integer >= 1", "clusterkv/quest: count a selected token as a hit when selected in the last N steps too (default: 1)", lambda v: v >= 1
    ),
    "slow_tier": CacheKey(
        (str,),
        f"one of {', '.join(SLOW_TIERS)}",
        "clusterkv/quest: where the full history lives: a store on the compute device, or host memory (pinned on CUDA) with only the last "
        "step's attended KVs on the device, copying just the newly selected ones each step (eager only) (default: device)",
        _one_of(*SLOW_TIERS),
    ),
    "tokens_per_cluster": CacheKey(
        (int,), "an integer >= 1", "clusterkv: prompt tokens per cluster, C0 = prompt / N clusters per KV head (default: 80)", lambda v: v >= 1
    ),
    "cluster_every": CacheKey((int,), "an integer >= 1", "clusterkv: cluster the decoded tokens every N steps (default: 320)", lambda v: v >= 1),
    "new_clusters": CacheKey((int,), "an integer >= 1", "clusterkv: clusters made from each cluster_every decoded tokens (default: 8)", lambda v: v >= 1),
    "kmeans_iterations": CacheKey((int,), "an integer >= 1", "clusterkv: k-means iterations (default: 20)", lambda v: v >= 1),
    "page_size": CacheKey((int,), "an integer >= 1", "quest: tokens per page (default: 16)", lambda v: v >= 1),
    "kvc_block_size": CacheKey(
        (int,), "an integer >= 1", "kvcompress: KVs per block of one (layer, KV head); eviction frees whole blocks (default: 16)", lambda v: v >= 1
    ),
    "kvc_pool_blocks": CacheKey(
        (int,),
        "an integer >= 1",
        "kvcompress: blocks in the pool shared by all layers, heads and sequences, i.e. the KV memory (default: enough for every sequence uncompressed)",
        lambda v: v >= 1,
    ),
    "kvc_window": CacheKey(
        (int,), "an integer >= 1", "kvcompress (KVC-w): last prompt queries whose squared attention scores the prompt (default: 8)", lambda v: v >= 1
    ),
    "kvc_kernel": CacheKey(
        (int,), "an odd integer >= 1", "kvcompress (KVC-w): max-pooling kernel over the prompt metric (default: 7)", lambda v: v >= 1 and v % 2 == 1
    ),
    "kvc_full": CacheKey((bool,), "true or false", "kvcompress (KVC-full): score the prompt with every prompt query instead of the last kvc_window"),
    "kvc_skip": CacheKey(
        (int,), "an integer >= 0", "kvcompress (KVC-full): leave out query-key pairs closer than this many positions (default: 10)", lambda v: v >= 0
    ),
    "kvc_protect": CacheKey((int,), "an integer >= 0", "kvcompress: newest tokens never evicted (default: 8; 32 with kvc_full)", lambda v: v >= 0),
    "kvc_metric": CacheKey(
        (str,),
        f"one of {', '.join(KVC_METRICS)}",
        "kvcompress: sum squared attention probabilities (KV-Compress) or the probabilities (l1) (default: squared)",
        _one_of(*KVC_METRICS),
    ),
    "kvc_scope": CacheKey(
        (str,),
        f"one of {', '.join(KVC_SCOPES)}",
        "kvcompress: one budget over all layers and heads of a sequence (model: KV-Compress) or one per layer shared by its heads (layer: Ada-KV) (default: model)",
        _one_of(*KVC_SCOPES),
    ),
    "kvc_head_floor": CacheKey(
        (int, float),
        "a fraction in [0, 1]",
        "kvcompress: every head keeps its best KVs up to this share of its layer's per-head budget (Ada-KV's floor) (default: 0)",
        lambda v: 0 <= v <= 1,
    ),
    "kvc_compress_every": CacheKey(
        (int,),
        "an integer >= 0",
        "kvcompress: compress again every N decode steps with the accumulated decode attention; 0: at prefill only (default: 1)",
        lambda v: v >= 0,
    ),
    "full_layers": CacheKey(
        (int,), "an integer >= 0", "keep the first N layers uncompressed, whatever the strategy (ClusterKV and Quest leave 2) (default: 0)", lambda v: v >= 0
    ),
    "compress_first_token": CacheKey(
        (bool,),
        "true or false",
        "decode the prompt's last token through the compressed cache, so the first generated token already sees compression",
    ),
}
BUDGET_OPTIONS = {"squeeze_p": ("squeeze",), "pyramid_beta": ("pyramid", "funnel")}  # planner settings and the planners that take them
CACHE_OPTIONS = tuple(
    k for k in CACHE_KEYS if k not in (*PER_LAYER_KEYS, "compress_first_token", "full_layers", "layer_budget", *BUDGET_OPTIONS)
)  # for make_caches


def check_value(key: str, value: Any) -> Any:
    """`value` if it is valid for `key`, else a ValueError naming the key and its valid values."""
    spec = CACHE_KEYS[key]
    if not isinstance(value, spec.types) or (isinstance(value, bool) and bool not in spec.types) or not spec.check(value):
        raise ValueError(f"{key} must be {spec.valid}, got {value!r}")
    return value


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
        for v in value if isinstance(value, list) and key in PER_LAYER_KEYS else [value]:
            try:
                check_value(key, v)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
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

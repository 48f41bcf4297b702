"""A batch's prefill recorded once and replayed into caches (`RecordedPrefill`): layer budget planners measure
the layers on it before the caches are sized, sweeps share it between cache configs, and model-scored
compressors (KVzip, the oracle) are scored on it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.budget import mean_over_prompt, residual_similarity
from kvlab.cache import KVCache
from kvlab.model import Transformer
from kvlab.prompt_compression import PromptCompressor
from kvlab.reconstruction import RepeatRequest, prompt_attention_from


class PrefillRecorder(nn.Module):
    """Stands in for every layer's cache during one prefill and keeps what each layer would have stored."""

    needs_attention, needs_tokens, needs_prompt_lse = False, False, True

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[tuple[Tensor, Tensor, Tensor]] = []
        self.lse: list[Tensor | None] = []  # None where the prefill does not return it (off the CPU)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> None:
        self.layers.append((k.contiguous(), v.contiguous(), q.contiguous()))  # not views keeping the layer's qkv alive
        self.lse.append(lse)


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

    def __init__(self) -> None:
        self.inputs: tuple[Tensor, Tensor] | None = None
        self.recorder = PrefillRecorder()
        self.scores: dict[tuple[int, str], Tensor] = {}
        self.references: dict[tuple[int, tuple[int, ...]], list[list[int]]] = {}  # a full cache run's continuations (the oracle's)
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

    def replay(self, model: Transformer, caches: Sequence[KVCache], compact: bool = False) -> None:
        """Fill the model's current caches (`caches`, or probes wrapping them) from the recording, as their own prefill
        would; with `compact` (the whole prompt is recorded: no chunk follows), each compacted once it is filled."""
        tokens, input_pos = self.inputs
        for layer, (block, cache, (k, v, q), lse) in enumerate(zip(model.layers, caches, self.recorder.layers, self.recorder.lse, strict=True)):
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
        for layer, (cache, (k, v, q), lse) in enumerate(zip(caches, self.recorder.layers, self.recorder.lse, strict=True)):
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
        self, model: Transformer, caches: Sequence[KVCache], prefilled: list[int], continuations: list[list[int]], request: RepeatRequest | None
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
                scores = torch.zeros(*input_pos.shape[:1], per_row[0][layer].shape[0], input_pos.shape[1], device=input_pos.device)
                for row, n in enumerate(prefilled):
                    scores[row, :, :n] = per_row[row][layer]
                self.scores[layer, key] = scores


def compressor_key(compressor: PromptCompressor) -> str:
    """A compressor's kind and settings: its scores of one prefill serve every cache using the same."""
    return f"{type(compressor).__name__}{sorted(vars(compressor).items())}"

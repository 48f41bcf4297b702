"""Prompt scores that need the model to run again. KVzip scores each prompt key by the attention it
receives while the model repeats the prompt; the oracle by the attention it receives from the tokens
a full cache run goes on to decode. Both feed chosen query tokens after the recorded prompt through
probes holding that prompt's keys and values (`prompt_attention_from`); the engine runs them before
the recorded prefill is replayed into the caches (`engine.generate`)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.model import Transformer
from kvlab.options import integer
from kvlab.prompt_compression import PromptCompressor
from kvlab.scores import chunk_attention

KVZIP_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


class ModelScored(PromptCompressor):
    """A compressor whose scores come from a further pass of the model: the engine computes them
    (`queries`), so calling it directly is an error."""

    needs_model = True
    needs_reference = False  # True: `queries` reads the continuation of a full cache run
    reduce = "max"  # how the attention of the queries to a key is combined: "max" or "sum"

    def queries(self, prompt: list[int], continuation: list[int], instruction: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """The query passes for one sequence: (token ids, leading ids whose attention is not counted)."""
        raise NotImplementedError

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        raise RuntimeError(f"{type(self).__name__} scores come from a pass of the model; run it through kvlab.engine.generate")


class KVzip(ModelScored):
    """KVzip (Kim et al., 2025, arXiv 2505.23416): query-agnostic. The model is asked to repeat the
    prompt ("Repeat the previous context exactly." + the prompt again); a key's score is the largest
    attention any of the repeating tokens pays it (over the query heads of its KV head). The repeat runs
    in chunks of `chunk` tokens, each after the instruction and attending to the prompt and itself, so
    memory stays linear in the prompt."""

    options = (
        integer("kvzip_chunk", 512, "kvzip: tokens of the repeated prompt scored per pass (with --prefill_chunk: each chunk, repeated whole)", param="chunk"),
    )

    def __init__(self, chunk: int = 512) -> None:
        self.options[0].validate(chunk)
        self.chunk = chunk

    def queries(self, prompt: list[int], continuation: list[int], instruction: tuple[int, ...]) -> list[tuple[list[int], int]]:
        return [([*instruction, *prompt[s : s + self.chunk]], len(instruction)) for s in range(0, len(prompt), self.chunk)]

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor) -> Tensor:
        """Between prefill chunks the chunk itself is repeated, after the instruction, in the same forward pass
        (`EvictionCache.prefill_chunk`'s probe): k [B, H_kv, S + P, D] are the held and chunk keys followed by the
        repeat's own, q [B, H, N, D] at query_pos [B, N] the repeating tokens. A key's score: the largest attention
        one of them pays it. The cache keeps each held token's largest over the chunks."""
        return chunk_attention(key_pos, k, query_pos, q, None).amax(dim=3).amax(dim=2)


class Oracle(ModelScored):
    """An upper bound for research, not a method: a key's score is the attention it receives, summed,
    from every token a full cache run decodes after the prefill (the rest of the prompt, then its greedy
    answer). It shows how far a method is from the best selection of that many tokens."""

    reduce = "sum"
    needs_reference = True  # the engine runs a full cache first, for the continuation

    def queries(self, prompt: list[int], continuation: list[int], instruction: tuple[int, ...]) -> list[tuple[list[int], int]]:
        return [(continuation, 0)] if continuation else []  # nothing decoded after the prompt: every score stays 0


class AttentionProbe(nn.Module):
    """Stands in for a layer's cache: holds one sequence's prompt keys/values [1, H_kv, T, D], appends
    each pass's own, and keeps the attention each prompt key receives (max or sum over the passes)."""

    needs_attention, needs_tokens, attends_itself = True, False, False

    def __init__(self, k: Tensor, v: Tensor, reduce: str) -> None:
        super().__init__()
        self.k, self.v, self.reduce = k, v, reduce
        self.skip = 0
        self.scores = torch.zeros(k.shape[:3], device=k.device)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        prompt_pos = torch.arange(self.k.shape[2], device=k.device)[None]
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), torch.cat([prompt_pos, input_pos], dim=1)

    def observe(self, probs: Tensor) -> None:
        received = probs[:, :, :, self.skip :, : self.k.shape[2]]  # [1, H_kv, group, counted queries, T]
        if self.reduce == "max":
            self.scores = torch.maximum(self.scores, received.amax(dim=3).amax(dim=2))  # in turn: 8x faster than dim=(2, 3) on CPU
        else:
            self.scores = self.scores + received.sum(dim=(2, 3))


@torch.no_grad()
def prompt_attention_from(model: Transformer, layers: list[tuple[Tensor, Tensor]], passes: list[tuple[list[int], int]], reduce: str) -> list[Tensor]:
    """Per layer, [H_kv, T]: the attention one sequence's prompt keys (`layers`: each layer's [1, H_kv,
    T, D] keys and values) receive from the query tokens of each pass (ids, uncounted leading ids), placed
    right after the prompt. The model's caches are put back afterwards."""
    saved = [layer.attention.kv_cache for layer in model.layers]
    probes = [AttentionProbe(k, v, reduce) for k, v in layers]
    model.setup_caches(probes)
    try:
        n = layers[0][0].shape[2]
        for ids, skip in passes:
            for probe in probes:
                probe.skip = skip
            device = layers[0][0].device
            model(torch.tensor([ids], device=device), n + torch.arange(len(ids), device=device)[None])
    finally:
        model.setup_caches(saved)
    return [p.scores[0] for p in probes]

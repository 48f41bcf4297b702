"""An evicting cache between prefill chunks and past the context: a chunk attends over the held tokens and itself,
then each head keeps its best of both (as at prefill) by the compressor's scores from the chunk's queries, a
model-scored compressor's (KVzip's repeat) kept as the best so far; head_budget global keeps every one until the
model-wide ranking. StreamingLLM moves the held tokens to positions within the cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.cache import unchanged_where_idle
from kvlab.prompt_compression import wrap_scores
from kvlab.scores import position_order, unrotate


class ChunkedEviction:
    """`EvictionCache`'s chunked prefill and repositioning (a mixin: it reads the cache's slots, storage and
    compressor, and stores through its `_store_prompt`)."""

    @property
    def prefills_in_chunks(self) -> bool:
        return self.prompt_compressor.scores_chunks

    def prefill_chunk(
        self,
        input_pos: Tensor,
        k: Tensor,
        v: Tensor,
        q: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
        probe: int = 0,
    ) -> Tensor:
        """The chunk attends over the held tokens and itself; then the prompt compressor scores both together
        from the chunk's queries (`score_chunk`), and each head keeps its best, as at prefill. The last `probe`
        columns, if any, are queries a model-scored compressor asked for (KVzip's "repeat the context" and the
        chunk again): they attend over everything and themselves, score the held and chunk tokens in the chunk's
        place, and are never stored. A sequence whose prompt has ended (a chunk of padding) keeps its state."""
        k, v = self._repeat(k), self._repeat(v)
        B, H, N = k.shape[0], k.shape[1], k.shape[2] - probe
        held_k, held_v = self.storage.read()
        held_pos, keep_all = self.pos, self.head_budget == "global"
        # every held and chunk token stays until the model-wide ranking (`keep_ranked`): read the filled slots
        if keep_all:
            filled = int(((self.pos >= 0) * torch.arange(1, self.pos.shape[-1] + 1, device=self.pos.device)).max())
            held_k, held_v, held_pos = held_k[:, :, :filled], held_v[:, :, :filled], self.pos[..., :filled]
        key_pos = torch.cat([held_pos, input_pos[:, None, :].expand(B, H, -1)], dim=2)
        keys, values = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)
        y = attend(keys, values, key_pos)
        S = key_pos.shape[2] - probe
        order = position_order(key_pos[..., :S])
        index = order[..., None].expand(B, H, S, keys.shape[-1])
        sorted_pos, sorted_k, sorted_v = (
            key_pos[..., :S].gather(2, order),
            keys[:, :, :S].gather(2, index),
            values[:, :, :S].gather(2, index),
        )
        # columns: held, chunk, probe; its queries its last N (the chunk again)
        if probe and self.prompt_compressor.needs_model:
            scores = self.prompt_compressor.score_chunk(
                key_pos, keys, values, input_pos[:, -N:], q[:, :, -N:], held_pos.shape[-1]
            )
            scores = scores[..., :S].gather(2, order)
        else:
            scores = self.prompt_compressor.score_chunk(sorted_pos, sorted_k, sorted_v, input_pos[:, :N], q[:, :, :N])
        scores = wrap_scores(scores, sorted_pos, self._one_stage_norms(sorted_v), self.value_epsilon, self.chunk_size)
        with unchanged_where_idle(self, input_pos):
            scores = self._with_running_scores(self._with_chunk_scores(scores, order), order)
            self._store_prompt(sorted_pos, sorted_k, sorted_v, scores, keep_all)
            self._after_chunk(input_pos[:, :N], q[:, :, :N])
        return y

    def reposition(self, rope_cos: Tensor, rope_sin: Tensor) -> int:
        """StreamingLLM's positions within the cache, for texts longer than the context: each head's held tokens move
        to positions 0, 1, ... in their order, each key re-rotated by its move (RoPE rotations compose, R(new) =
        R(new - old) R(old), with the model's cos/sin tables [P, D]). Returns the next free position: the count held."""
        held = self.pos >= 0
        order = position_order(self.pos)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        new = torch.where(held, rank, -1)
        shift = self.pos - new  # >= 0: tokens only move back; 0 for empty slots
        k, v = self.storage.read()
        k = unrotate(k, rope_cos[shift].to(k.dtype), rope_sin[shift].to(k.dtype))
        # v may be the buffer itself
        self.storage.write(
            torch.arange(self.pos.shape[-1], device=k.device).expand(self.pos.shape), k, v.clone(), prompt=True
        )
        self.pos.copy_(new)
        return int(held.sum(dim=-1).max())

    def _with_running_scores(self, scores: Tensor, order: Tensor) -> Tensor:
        """A chunk's scores of the held and chunk tokens (in `order` of [held slots, chunk]) combined with what the
        strategy has gathered on its slots so far (H2O adds its accumulated attention)."""
        return scores

    def _with_chunk_scores(self, scores: Tensor, order: Tensor) -> Tensor:
        """A model-scored compressor's chunk scores of the held and chunk tokens (in `order` of [held slots, chunk]),
        each held token's combined with what earlier chunks gave it (KVzip: the largest attention any repeat paid
        it)."""
        if not self.keeps_prompt_scores:
            return scores
        return torch.maximum(
            scores, F.pad(self.prompt_scores, (0, order.shape[-1] - self.prompt_scores.shape[-1])).gather(2, order)
        )

    def _after_chunk(self, input_pos: Tensor, q: Tensor) -> None:
        """Strategy state refreshed from a chunk's queries once its tokens are stored (Expected Attention refits its
        Gaussian)."""

    def held_ranking(self) -> Tensor:
        """[B, H_kv, C]: what the held slots rank by between prefill chunks (head_budget global ranks those of every
        layer together, `chunked.keep_best_over_model`): the scores they were kept by, protected +inf, empty -inf."""
        return self._protect(self.prompt_scores, self.pos, self.pos.flatten(1).max(dim=-1).values[:, None, None])

    def keep_ranked(self) -> None:
        """Each head keeps its best row_capacity - decode_room held tokens by `held_ranking`, in position order."""
        k, v = self.storage.read()
        self._store_prompt(self.pos.clone(), k, v, self.prompt_scores.clone())

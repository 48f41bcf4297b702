"""Evicting caches: a fixed number of slots per sequence and KV head, the least important token evicted.

An evicting strategy is only a score (higher = keep), written once in `scores.py`: `KeyScoredCache`
applies a key score to the prompt and to the cache, `AttentionScoredCache` an attention score to the
observed prompt queries and to every decode query (scored_caches.py). `EvictionCache` does the rest: slots,
sinks and the recent window, per-sequence limits, Ada-KV head budgets, storage sized by them (compact.py). A
new key-only strategy is a subclass naming its score plus one line in the registry (`strategies.py`), e.g.
`KeyDiffCache`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvlab import kernels, parallel
from kvlab.cache import KVCache
from kvlab.compact import KV_STORE_OPTION, CompactKVStorage
from kvlab.eviction_chunks import ChunkedEviction
from kvlab.head_budget import (
    ADAKV_BUDGETS,
    DEFAULT_ADAKV_FLOOR,
    HEAD_BUDGET_OPTIONS,
    HEAD_BUDGETS,
    adakv_capacities,
    safeguard,
)
from kvlab.options import integer
from kvlab.prompt_compression import SCORE_WRAPPER_OPTIONS, KeepAll, PromptCompressor, wrap_scores
from kvlab.scores import two_stage, value_norms, value_weighted
from kvlab.storage import KEY_PRUNING_OPTIONS, rows_and_heads

PROTECTED_OPTIONS = (
    integer(
        "global_tokens", None, "first tokens never evicted, attention sinks", minimum=0, default_help="4; 0 for window"
    ),
    integer(
        "recent_window",
        None,
        "newest tokens never evicted, the incoming one included; 0 leaves the prompt's last token to its score, "
        "as kvpress's scorer presses do (a decoded token is always written, so 0 and 1 decode alike)",
        minimum=0,
        default_help="10; 1 for hybrid",
    ),
)


class EvictionCache(ChunkedEviction, KVCache):
    """A fixed number of slots per (sequence, KV head). When the prompt is longer than the cache, the
    most important prompt tokens are kept (ranked by the `PromptCompressor`, by default the strategy's
    own score); during decoding each new token replaces the least important slot (`_token_importances`).
    The first `global_tokens` positions (attention sinks) and the newest `recent_window` positions, the
    incoming token included, are always protected. All choices are argmin/topk/scatter: static shapes,
    no data-dependent Python branching, so the decode step compiles with fullgraph=True. The prompt
    scores go through the wrappers `value_weight` (CriticalKV) and `chunk_size` (ChunkKV) first
    (`wrap_scores`); `rope`, the model's RoPE tables, reaches a compressor that needs it (`with_rope`).

    `head_budget="adakv"` (Ada-KV, Feng et al., 2024, as its official code) or "adakv_safeguard" (as kvpress's
    AdaKVPress) lets the KV heads of a layer share its budget
    unevenly, decided at prefill from the prompt scores (`head_budget.adakv_capacities`); each head then evicts
    inside its own share while decoding. The prompt is stored in a buffer wide enough for the largest share
    (`head_budget.adakv_slots`); `compact` then packs each head's share into rows of its own (kv_store compact,
    compact.py), so the bytes held after prefill are the budgets', and decode attention reads them in place."""

    positions_per_head = True
    takes_prompt_compressor = True
    default_global_tokens = 4
    default_recent_window = 10
    default_value_weight = "none"

    @classmethod
    def min_slots(cls, options: dict[str, Any]) -> int:
        return cls.protected_tokens(options) + 1

    options = (
        *KVCache.options,
        *KEY_PRUNING_OPTIONS,
        *PROTECTED_OPTIONS,
        *SCORE_WRAPPER_OPTIONS,
        *HEAD_BUDGET_OPTIONS,
        KV_STORE_OPTION,
    )

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        global_tokens: int | None = None,
        recent_window: int | None = None,
        prompt_compressor: PromptCompressor | None = None,
        kv_repeat: int = 1,
        head_budget: str = "uniform",
        adakv_floor: float = DEFAULT_ADAKV_FLOOR,
        rope: tuple[Tensor, Tensor] | None = None,
        value_weight: str | None = None,
        value_epsilon: float = 0.0,
        value_first_stage: float = 0.0,
        chunk_size: int | None = None,
        kv_store: str = "compact",
        **storage_options,
    ) -> None:
        H = n_kv_heads * kv_repeat
        super().__init__(batch_size, H, capacity, head_dim, dtype, device, kv_store=kv_store, **storage_options)
        if head_budget not in HEAD_BUDGETS or not 0 <= adakv_floor <= 1:
            raise ValueError(
                f"head_budget must be one of {', '.join(HEAD_BUDGETS)} and adakv_floor in [0, 1]; got "
                f"{head_budget!r} and {adakv_floor}"
            )
        self.head_budget, self.adakv_floor = head_budget, adakv_floor
        self.prompt_compressor = (prompt_compressor or self.own_prompt_compressor()).with_rope(rope)
        self._set_score_wrappers(value_weight, value_epsilon, value_first_stage, chunk_size)
        # the attention's W_o [dim, H x D] for value_weight wo_l1 (build.setup_caches sets it)
        self.output_weight: Tensor | None = None
        if head_budget != "uniform" and self.prompt_compressor.same_in_every_head and self.value_weight == "none":
            raise ValueError(
                f"{type(self).__name__}: --head_budget {head_budget} shares a layer's slots by how each head "
                "scores its prompt tokens; these scores (by position) are the same in every head, so it would "
                "change nothing: drop it, or give a --prompt_compression_strategy"
            )
        # > 1: each query head keeps its own tokens (SnapKV's reference selection), KVs repeated
        self.kv_repeat = kv_repeat
        self._protect_tokens(global_tokens, recent_window, capacity)
        # Slots per sequence and KV head: row_budget is the configured share, row_capacity each head's (Ada-KV
        # moves slots between heads).
        self.register_buffer("row_budget", torch.full((batch_size, 1, 1), capacity, device=device), persistent=False)
        self.register_buffer(
            "row_capacity", torch.full((batch_size, self.pos.shape[1], 1), capacity, device=device), persistent=False
        )
        self.register_buffer(
            "decode_room", torch.zeros((batch_size, 1, 1), dtype=torch.long, device=device), persistent=False
        )
        self.decode_evicts = True  # False once limit_rows keeps room for every decoded token (a compression ratio)
        # A model-scored compressor between prefill chunks (KVzip): each held token's best score so far, as only the
        # newest chunk is repeated.
        self.keeps_prompt_scores = self.prompt_compressor.needs_model and self.prompt_compressor.scores_chunks
        # head_budget global between prefill chunks ranks every layer's held tokens by the scores they were kept by.
        self.stores_prompt_scores = self.keeps_prompt_scores or head_budget == "global"
        if self.stores_prompt_scores:
            self.register_buffer("prompt_scores", torch.zeros(self.pos.shape, device=device), persistent=False)

    def _set_score_wrappers(
        self, value_weight: str | None, value_epsilon: float, value_first_stage: float, chunk_size: int | None
    ) -> None:
        """The prompt score wrappers (SCORE_WRAPPER_OPTIONS), checked: CriticalKV's value weight and two stages,
        ChunkKV's chunks."""
        for option, value in zip(
            SCORE_WRAPPER_OPTIONS, (value_weight, value_epsilon, value_first_stage, chunk_size), strict=True
        ):
            if value is not None:
                option.validate(value)
        self.value_weight = self.default_value_weight if value_weight is None else value_weight
        self.value_epsilon, self.value_first_stage, self.chunk_size = value_epsilon, value_first_stage, chunk_size
        if value_first_stage and self.value_weight == "none":
            raise ValueError(
                f"{type(self).__name__}: --value_first_stage {value_first_stage} selects in two stages by the "
                "value weight; give a --value_weight"
            )

    def _protect_tokens(self, global_tokens: int | None, recent_window: int | None, capacity: int) -> None:
        """The sinks and the recent window (the strategy's defaults where None), checked against the slots."""
        self.global_tokens = self.default_global_tokens if global_tokens is None else global_tokens
        self.recent_window = self.default_recent_window if recent_window is None else recent_window
        name, sinks, recent = type(self).__name__, self.global_tokens, self.recent_window
        if sinks < 0 or recent < 0:
            raise ValueError(f"{name}: need --global_tokens >= 0 and --recent_window >= 0; got {sinks} and {recent}")
        if sinks + recent >= capacity:
            raise ValueError(
                f"{name}: --max_cache_length gives {capacity} slots here; the cache needs more than --global_tokens "
                f"{sinks} + --recent_window {recent}: raise --max_cache_length or lower --recent_window/--global_tokens"
            )

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        """The strategy's own score applied to the prompt (the default `prompt_compression_strategy`)."""
        return KeepAll()

    @property
    def needs_prompt_lse(self) -> bool:
        return self.takes_prompt_compressor and self.prompt_compressor.uses_lse

    def limit_rows(self, capacities: Tensor, decode_room: Tensor | None = None) -> None:
        room = torch.zeros_like(capacities) if decode_room is None else decode_room
        smallest, largest = int((capacities - room).min()), int(capacities.max())
        if smallest <= self.global_tokens + self.recent_window or largest > self.capacity:
            raise ValueError(
                f"{type(self).__name__}: --max_cache_length gives {capacities.tolist()} slots per sequence here "
                f"(at most {self.capacity}); each needs more than --global_tokens {self.global_tokens} + "
                f"--recent_window {self.recent_window}: raise --max_cache_length or lower "
                "--recent_window/--global_tokens"
                if decode_room is None
                else f"{type(self).__name__}: --compression_ratio keeps {(capacities - room).tolist()} prompt "
                "tokens per sequence here; each "
                f"needs more than --global_tokens {self.global_tokens} + --recent_window {self.recent_window}: "
                "lower the ratio, or --recent_window/--global_tokens"
            )
        self.row_budget.copy_(capacities.view(-1, 1, 1))
        self.row_capacity.copy_(self.row_budget.expand_as(self.row_capacity))
        self.decode_room.copy_(room.view(-1, 1, 1))
        self.decode_evicts = decode_room is None

    def head_budgets(self) -> Tensor:
        return self.row_capacity[..., 0]

    def _token_importances(self) -> Tensor:
        """[B, H_kv, S] score of each filled slot; the lowest unprotected one is evicted."""
        raise NotImplementedError

    def _eviction_idx(self, input_pos: Tensor) -> Tensor:
        """[B, H_kv, 1] the slot each (sequence, KV head) gives to the incoming token: an empty one, else the least
        important. When the rows keep room for every decoded token, an empty slot always wins, so the strategy's score
        (LagKV and KeyDiff rescore every held key) is not computed: the same slot, the first empty one."""
        importances = (
            self._token_importances() if self.decode_evicts else torch.zeros(self.pos.shape, device=self.pos.device)
        )
        return self._slot_priorities(importances, input_pos).argmin(dim=-1, keepdim=True)

    def _slot_priorities(self, importances: Tensor, input_pos: Tensor) -> Tensor:
        """Importances of the slots made ready for argmin: empty slots first, protected ones and slots beyond a
        sequence's own limit never."""
        scores = self._protect(importances, self.pos, input_pos[:, :, None])
        beyond = torch.arange(scores.shape[-1], device=scores.device) >= self.row_capacity
        return scores.masked_fill(beyond, float("inf"))

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        """Strategy state for newly written slots [B, H_kv, N]; `scores` are their prompt importances (None in
        decode)."""

    def _protect(self, scores: Tensor, pos: Tensor, current: Tensor) -> Tensor:
        """Empty slots go first (-inf), sinks and the recent window never (+inf). current: [B, 1, 1] newest position."""
        protected = (pos < self.global_tokens) | (pos > current - self.recent_window)
        scores = scores.float().masked_fill(protected, float("inf"))
        return scores.masked_fill(pos < 0, float("-inf"))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> None:
        T = k.shape[2]
        if T > self.capacity and not self.prompt_compressor.compresses:
            raise ValueError(
                f"a prompt of {T} tokens does not fit a cache of {self.capacity} slots without a prompt compressor"
            )
        k, v = self._repeat(k), self._repeat(v)
        self.storage.observe_prompt(input_pos, k, q)
        self._store_prompt(
            input_pos[:, None, :].expand(k.shape[:3]), k, v, self._prompt_scores(input_pos, k, v, q, lse)
        )

    def _prompt_scores(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None) -> Tensor:
        """The compressor's scores [B, H_kv, T] of the prompt's keys and values (already repeated per head), wrapped."""
        scores = self.prompt_compressor(input_pos, k, v, q, **({} if lse is None else {"lse": lse}))
        return wrap_scores(scores, input_pos, self._one_stage_norms(v), self.value_epsilon, self.chunk_size)

    def value_norms(self, v: Tensor) -> Tensor | None:
        """[B, H_kv, T] what `value_weight` weighs the scores of values v [B, H_kv, T, D] by (None: nothing)."""
        if self.value_weight == "none":
            return None
        if self.value_weight == "wo_l1" and self.output_weight is None:
            raise ValueError(
                f"{type(self).__name__}: --value_weight wo_l1 needs the attention's output projection; build "
                "the caches with build_caches"
            )
        return value_norms(v, self.output_weight if self.value_weight == "wo_l1" else None)

    def _one_stage_norms(self, v: Tensor) -> Tensor | None:
        """The value norms that weigh the scores as they are computed; a two-stage selection weighs them when it stores
        the prompt."""
        return None if self.value_first_stage else self.value_norms(v)

    def prompt_ranking(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> Tensor:
        """[B, H_kv, T]: what prefill ranks the prompt by, protected tokens +inf, padding -inf (head_budget global
        ranks these of every layer together before the prompt is stored)."""
        k, v = self._repeat(k), self._repeat(v)
        pos = input_pos[:, None, :].expand(k.shape[:3])
        return self._protect(
            self._prompt_scores(input_pos, k, v, q, lse), pos, pos.flatten(1).max(dim=-1).values[:, None, None]
        )

    def _repeat(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(self.kv_repeat, dim=1) if self.kv_repeat > 1 else x

    def _store_prompt(self, pos: Tensor, k: Tensor, v: Tensor, scores: Tensor, keep_all: bool = False) -> None:
        """Keep each sequence's most important prompt tokens (at positions pos [B, H_kv, T], scores [B, H_kv, T]) with
        the protected ones; with `keep_all`, every one that fits the buffer."""
        B, H, T, D = k.shape
        n_keep = min(T, self.capacity)
        last = pos.flatten(1).max(dim=-1).values[:, None, None]
        protected = self._protect(scores, pos, last)
        if self.head_budget in ADAKV_BUDGETS:  # split over every head of the layer, on every rank alike
            split = adakv_capacities(
                parallel.gather_heads(protected),
                last + 1,
                self.row_budget,
                self.decode_room,
                self.capacity,
                self.head_budget,
                self.adakv_floor,
            )
            self.row_capacity.copy_(parallel.local_heads(split))
        if self.value_first_stage:  # CriticalKV: each head's best first, the rest by the value-weighted score
            protected = two_stage(
                protected, value_weighted(protected, self.value_norms(v), self.value_epsilon), self._first_stage(last)
            )
        ranked = protected.topk(n_keep, dim=-1).indices  # [B, H, n_keep], most important first
        # A sequence keeps its best row_capacity - decode_room tokens per head, in prompt order; the rest go past its
        # limit and stay empty.
        kept = (pos >= 0).sum(dim=-1, keepdim=True) if keep_all else self.row_capacity - self.decode_room
        fits = torch.arange(n_keep, device=k.device) < kept
        order = torch.where(fits, ranked, ranked + T).sort(dim=-1).values
        keep, fits = order % T, order < T
        index = keep[..., None].expand(B, H, n_keep, D)
        slots = torch.arange(n_keep, device=k.device).expand(B, H, n_keep)
        self.storage.write(slots, k.gather(2, index), v.gather(2, index), prompt=True)
        self.pos[:, :, :n_keep] = pos.gather(2, keep).masked_fill(~fits, -1)
        self.pos[:, :, n_keep:] = -1
        if self.stores_prompt_scores:
            self.prompt_scores.zero_()[:, :, :n_keep] = scores.gather(2, keep).masked_fill(~fits, 0)
        self._on_insert(slots, scores.gather(2, keep))

    def _first_stage(self, last: Tensor) -> Tensor:
        """[B, H, 1] how many prompt tokens each head keeps by the unweighted score (newest position `last` [B, 1, 1]):
        value_first_stage of its prompt budget, and with adakv_safeguard at least the safeguard (kvpress's
        CriticalAdaKVPress)."""
        first = (torch.minimum(self.row_capacity - self.decode_room, last + 1) * self.value_first_stage).floor()
        if self.head_budget == "adakv_safeguard":
            first = torch.maximum(
                first, safeguard(torch.minimum(self.row_budget - self.decode_room, last + 1), self.adakv_floor)
            )
        return first

    def compact(self) -> None:
        if isinstance(self.storage, CompactKVStorage):
            self.storage.compact(self.row_capacity[..., 0])

    def stats(self) -> dict[str, int]:
        """A compacted layer's count, bytes, and the bytes its dense form would hold (the report weighs the two)."""
        storage = self.storage
        if not isinstance(storage, CompactKVStorage) or not storage.compacted:
            return {}
        return {
            "compact: layers": 1,
            "compact: bytes": storage.nbytes(),
            "compact: dense bytes": storage.dense_nbytes(),
        }

    @property
    def attends_itself(self) -> bool:
        """Compacted storage that the native CPU kernel reads in place, and a step that needs no probabilities."""
        storage = self.storage
        compacted = isinstance(storage, CompactKVStorage) and storage.compacted
        return compacted and kernels.NATIVE and storage.k.device.type == "cpu" and not self.needs_attention

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self._insert(input_pos, k, v)
        return *self.storage.read_for_attention(), self.pos

    def attend(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        self._insert(input_pos, k, v)
        return self.storage.attend(q, self.pos, input_pos)

    def _insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """A decode step's keys and values into the slot each head gives up (`_eviction_idx`)."""
        slot = self._eviction_idx(input_pos)
        self.storage.write(slot, self._repeat(k), self._repeat(v))
        # index_put_, not scatter_: in place when compiled (KVStorage.write)
        self.pos.index_put_(rows_and_heads(slot) + (slot,), input_pos[:, None, :].expand(slot.shape))
        self._on_insert(slot, None)

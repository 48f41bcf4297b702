"""KV caches: the eviction strategies (and the registry of every strategy: recallable ones from recall.py,
the paged KV-Compress cache from paged.py).
The interface attention calls is in cache_base.py."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cache_base import KVCache
from paged import KVCompressCache
from prompt_compression import SNAPKV_OPTIONS, PromptCompressor, make_prompt_compressor, prompt_attention
from recall import ClusterKVCache, QuestCache

HEAD_BUDGETS = ("uniform", "adakv")
DEFAULT_ADAKV_FLOOR = 0.2


class FullCache(KVCache):
    """No compression: token at position p lives in slot p. The reference every strategy is measured against."""

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        T = k.shape[2]
        if T > self.capacity:
            raise ValueError(f"prompt of {T} tokens does not fit a full cache of {self.capacity} slots")
        B, H = k.shape[:2]
        self.storage.write(torch.arange(T, device=k.device).expand(B, H, T), k, v, prompt=True)
        self.pos[:, :T] = input_pos

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.storage.write(input_pos[:, None, :].expand(k.shape[:3]), k, v)
        self.pos.scatter_(1, input_pos, input_pos)
        return *self.storage.read(), self.pos


class EvictionCache(KVCache):
    """A fixed number of slots per (sequence, KV head). When the prompt is longer than the cache, the
    most important prompt tokens are kept; during decoding each new token replaces the least important
    slot. Subclasses only score slots (`_token_importances`, higher = keep; `_eviction_idx` to choose
    differently); prompt tokens are scored by a `PromptCompressor` (prompt_compression.py). The first
    `global_tokens` positions (attention sinks) and the newest `recent_window` positions, the incoming
    token included, are always protected. All choices are argmin/topk/scatter: static shapes, no data-
    dependent Python branching, so the decode step compiles with fullgraph=True.

    `head_budget="adakv"` (Ada-KV, Feng et al., 2024) lets the KV heads of a layer share its budget
    unevenly, decided at prefill from the prompt scores (`_adakv_capacities`); each head then evicts
    inside its own share while decoding. The buffer must be wide enough for the largest share
    (`adakv_slots`): a dense buffer cannot return the slots the small heads leave empty, so the
    memory saving needs a paged layout; here the attended tokens per layer are exactly the budget."""

    positions_per_head = True
    default_global_tokens = 4
    default_recent_window = 10
    default_prompt_compressor = "recent_global"
    options = (
        *KVCache.options,
        "global_tokens",
        "recent_window",
        "prompt_compression_strategy",
        *(f"snapkv_{o}" for o in SNAPKV_OPTIONS),
        "head_budget",
        "adakv_floor",
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
        **storage_options,
    ) -> None:
        super().__init__(batch_size, n_kv_heads * kv_repeat, capacity, head_dim, dtype, device, **storage_options)
        if head_budget not in HEAD_BUDGETS or not 0 <= adakv_floor <= 1:
            raise ValueError(f"head_budget must be one of {', '.join(HEAD_BUDGETS)} and adakv_floor in [0, 1]; got {head_budget!r} and {adakv_floor}")
        self.head_budget, self.adakv_floor = head_budget, adakv_floor
        self.prompt_compressor = prompt_compressor or make_prompt_compressor(self.default_prompt_compressor)
        self.global_tokens = self.default_global_tokens if global_tokens is None else global_tokens
        self.recent_window = self.default_recent_window if recent_window is None else recent_window
        self.kv_repeat = kv_repeat  # > 1: each query head keeps its own tokens (SnapKV's reference selection), KVs repeated
        if self.global_tokens < 0 or self.recent_window < 1 or self.global_tokens + self.recent_window >= capacity:
            raise ValueError(
                f"{type(self).__name__}: need global_tokens >= 0, recent_window >= 1 and global_tokens + recent_window < cache length; "
                f"got {self.global_tokens} + {self.recent_window} for a cache of {capacity} slots"
            )
        # Slots per sequence and KV head: row_budget is the configured share, row_capacity each head's (Ada-KV moves slots between heads).
        self.register_buffer("row_budget", torch.full((batch_size, 1, 1), capacity, device=device), persistent=False)
        self.register_buffer("row_capacity", torch.full((batch_size, self.pos.shape[1], 1), capacity, device=device), persistent=False)

    def limit_rows(self, capacities: Tensor) -> None:
        smallest, largest = int(capacities.min()), int(capacities.max())
        if smallest <= self.global_tokens + self.recent_window or largest > self.capacity:
            raise ValueError(
                f"{type(self).__name__}: per-sequence cache lengths must exceed global_tokens + recent_window "
                f"({self.global_tokens} + {self.recent_window}) and fit the {self.capacity} slots; got {capacities.tolist()} "
                "(raise --max_cache_length or lower --global_tokens/--recent_window)"
            )
        self.row_budget.copy_(capacities.view(-1, 1, 1))
        self.row_capacity.copy_(self.row_budget.expand_as(self.row_capacity))

    def head_budgets(self) -> Tensor:
        return self.row_capacity[..., 0]

    def _token_importances(self) -> Tensor:
        """[B, H_kv, S] score of each filled slot; the lowest unprotected one is evicted."""
        raise NotImplementedError

    def _eviction_idx(self, input_pos: Tensor) -> Tensor:
        """[B, H_kv, 1] the slot each (sequence, KV head) gives to the incoming token: an empty one, else the least important."""
        return self._slot_priorities(self._token_importances(), input_pos).argmin(dim=-1, keepdim=True)

    def _slot_priorities(self, importances: Tensor, input_pos: Tensor) -> Tensor:
        """Importances of the slots made ready for argmin: empty slots first, protected ones and slots beyond a
        sequence's own limit never."""
        scores = self._protect(importances, self.pos, input_pos[:, :, None])
        beyond = torch.arange(scores.shape[-1], device=scores.device) >= self.row_capacity
        return scores.masked_fill(beyond, float("inf"))

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        """Strategy state for newly written slots [B, H_kv, N]; `scores` are their prompt importances (None in decode)."""

    def _protect(self, scores: Tensor, pos: Tensor, current: Tensor) -> Tensor:
        """Empty slots go first (-inf), sinks and the recent window never (+inf). current: [B, 1, 1] newest position."""
        protected = (pos < self.global_tokens) | (pos > current - self.recent_window)
        scores = scores.float().masked_fill(protected, float("inf"))
        return scores.masked_fill(pos < 0, float("-inf"))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        T = k.shape[2]
        if T > self.capacity and not self.prompt_compressor.compresses:
            raise ValueError(f"a prompt of {T} tokens does not fit a cache of {self.capacity} slots without a prompt compressor")
        k, v = self._repeat(k), self._repeat(v)
        self._store_prompt(input_pos, k, v, self.prompt_compressor(input_pos, k, q))

    def _repeat(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(self.kv_repeat, dim=1) if self.kv_repeat > 1 else x

    def _store_prompt(self, input_pos: Tensor, k: Tensor, v: Tensor, scores: Tensor) -> None:
        """Keep each sequence's most important prompt tokens (scores [B, H_kv, T]) with the protected ones."""
        B, H, T, D = k.shape
        n_keep = min(T, self.capacity)
        pos = input_pos[:, None, :].expand(B, H, T)
        last = input_pos.max(dim=-1).values[:, None, None]
        protected = self._protect(scores, pos, last)
        if self.head_budget == "adakv":
            self.row_capacity.copy_(self._adakv_capacities(protected, last + 1))
        ranked = protected.topk(n_keep, dim=-1).indices  # [B, H, n_keep], most important first
        # A sequence keeps its best row_capacity tokens per head, in prompt order; the rest go past its limit and stay empty.
        fits = torch.arange(n_keep, device=k.device) < self.row_capacity
        order = torch.where(fits, ranked, ranked + T).sort(dim=-1).values
        keep, fits = order % T, order < T
        index = keep[..., None].expand(B, H, n_keep, D)
        slots = torch.arange(n_keep, device=k.device).expand(B, H, n_keep)
        self.storage.write(slots, k.gather(2, index), v.gather(2, index), prompt=True)
        self.pos[:, :, :n_keep] = pos.gather(2, keep).masked_fill(~fits, -1)
        self._on_insert(slots, scores.gather(2, keep))

    def _adakv_capacities(self, scores: Tensor, n_prompt: Tensor) -> Tensor:
        """Ada-KV's split of a layer's H x budget slots over its heads, [B, H, 1], from protected prompt
        scores [B, H, T] and prompt lengths [B, 1, 1]: the top H x b scores over all heads together are
        counted per head (b = the budget's prompt part, min(budget, prompt)), and head h gets
        (1 - floor) x (count_h + budget - b) + floor x budget, so every head keeps `floor` of a uniform
        share and the decode room is shared evenly. Whole slots by largest remainder (the sum stays
        exact); a share beyond the buffer goes to the other heads in proportion to their room."""
        B, H, T = scores.shape
        budget = self.row_budget.double()  # [B, 1, 1]
        prompt_part = torch.minimum(budget, n_prompt.double())
        rank = scores.flatten(1).argsort(dim=1, descending=True, stable=True).argsort(dim=1).view(B, H, T)
        count = (rank < H * prompt_part).sum(dim=-1, keepdim=True)
        share = (1 - self.adakv_floor) * (count + budget - prompt_part) + self.adakv_floor * budget
        room = (self.capacity - share).clamp(min=0)
        excess = (share - self.capacity).clamp(min=0).sum(dim=1, keepdim=True)
        share = share.clamp(max=self.capacity) + excess * room / room.sum(dim=1, keepdim=True).clamp(min=1e-9)
        whole = share.floor()
        left = (H * budget - whole.sum(dim=1, keepdim=True)).round()
        by_fraction = (whole - share).argsort(dim=1, stable=True).argsort(dim=1)  # largest fraction first
        return (whole + (by_fraction < left)).long()

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        slot = self._eviction_idx(input_pos)
        self.storage.write(slot, self._repeat(k), self._repeat(v))
        self.pos.scatter_(2, slot, input_pos[:, None, :].expand(slot.shape))
        self._on_insert(slot, None)
        return *self.storage.read(), self.pos


class WindowCache(EvictionCache):
    """Sliding window: keep the most recent tokens (Beltagy et al., Longformer, 2020)."""

    default_global_tokens = 0

    def _token_importances(self) -> Tensor:
        return self.pos


class RecentGlobalCache(WindowCache):
    """StreamingLLM: attention sinks (the first tokens) + the most recent tokens (Xiao et al., 2023)."""

    default_global_tokens = 4


class RandomCache(EvictionCache):
    """Evict a random unprotected token: the baseline every importance score must beat."""

    default_prompt_compressor = "random"

    def _token_importances(self) -> Tensor:
        return torch.rand(self.pos.shape, device=self.pos.device)


class L2Cache(EvictionCache):
    """Keep keys with a low L2 norm, which draw high attention (Devoto et al., 2024)."""

    default_prompt_compressor = "l2"

    def _token_importances(self) -> Tensor:
        return -self.storage.read()[0].float().norm(dim=-1)


class AttentionScoredCache(EvictionCache):
    """Base for strategies that score slots from attention probabilities, kept in `scores` [B, H_kv, S]."""

    needs_attention = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("scores", torch.zeros(self.pos.shape, device=self.pos.device), persistent=False)

    def reset(self) -> None:
        super().reset()
        self.scores.zero_()

    def _token_importances(self) -> Tensor:
        return self.scores

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        if scores is None:
            self.scores.scatter_(2, slots, 0.0)
            return
        # A compressor marks tokens it always keeps (SnapKV's window) with +inf: they start as their head's top token.
        finite = scores.isfinite()
        top = scores.masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True).clamp(min=0)
        self.scores.scatter_(2, slots, torch.where(finite, scores, top).float())


class HeavyHitterCache(AttentionScoredCache):
    """H2O: keep the tokens with the largest attention accumulated over all queries so far (Zhang et al., 2023).
    Scores are summed over the query heads sharing a KV head.

    Scissorhands options (Liu et al., 2023): `history_window` m counts only the last m decode steps (a ring
    of per-step contributions, so old attention is subtracted exactly; the prompt's scores stay as a
    prior), and `count_threshold` t counts the steps in which a token's attention reached t / (tokens
    held), i.e. t times uniform attention, instead of summing probabilities (t=1: "above average")."""

    default_prompt_compressor = "heavy_hitter"
    options = (*AttentionScoredCache.options, "history_window", "count_threshold")

    def __init__(self, *args, history_window: int | None = None, count_threshold: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if history_window is not None and history_window < 1 or count_threshold is not None and count_threshold <= 0:
            raise ValueError(f"heavy_hitter: history_window must be >= 1 and count_threshold > 0, got {history_window} and {count_threshold}")
        self.count_threshold = count_threshold
        self.history_window = history_window
        if history_window is not None:
            self.register_buffer("history", torch.zeros(*self.pos.shape, history_window, device=self.pos.device), persistent=False)
            self.register_buffer("step", torch.zeros(1, dtype=torch.long, device=self.pos.device), persistent=False)

    def reset(self) -> None:
        super().reset()
        if self.history_window is not None:
            self.history.zero_()
            self.step.zero_()

    def observe(self, probs: Tensor) -> None:
        if self.count_threshold is None:
            contribution = probs.sum(dim=(2, 3))
        else:
            held = (self.pos >= 0).sum(dim=-1)[:, :, None, None, None]
            contribution = (probs * held >= self.count_threshold).sum(dim=(2, 3)).float()
        if self.history_window is not None:  # the ring's oldest step leaves the window
            column = self.step % self.history_window
            expired = self.history.index_select(3, column).squeeze(3)
            self.history.index_copy_(3, column, contribution[..., None])
            self.step += 1
            contribution = contribution - expired
        self.scores += contribution

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        super()._on_insert(slots, scores)
        if self.history_window is not None:
            self.history.scatter_(2, slots[..., None].expand(*slots.shape, self.history_window), 0.0)


class TOVACache(AttentionScoredCache):
    """TOVA: evict the token the current query attends to least (Oren et al., 2024)."""

    default_prompt_compressor = "tova"

    def observe(self, probs: Tensor) -> None:
        self.scores.copy_(probs[:, :, :, -1].sum(dim=2))


class HybridCache(AttentionScoredCache):
    """FastGen (Ge et al., 2024, "Model Tells You What to Discard"): each KV head gets its own policy,
    chosen once per prompt: the cheapest of

        special  <  special+punct  <  special+punct+heavy  <  special+punct+heavy+window  <  full

    whose kept tokens receive at least `min_recovery_frac` of the attention of the prompt's last
    `profile_queries` queries. special = special tokens (and the sinks), punct = punctuation tokens,
    heavy = the `heavy_hitter_frac` of the sequence with the most accumulated attention, window = the
    newest `window_frac` of the sequence. During decoding every head drops what its policy no longer
    covers (the incoming token is always attended once), so heads differ in how many tokens they hold.
    Buffers keep static shapes: a head's unused slots are empty, not freed (held tokens are reported)."""

    needs_tokens = True
    default_recent_window = 1
    default_prompt_compressor = "full"
    policies = ("special", "special+punct", "special+punct+heavy", "special+punct+heavy+window", "full")
    profile_queries = 32
    options = (*KVCache.options, "global_tokens", "recent_window", "min_recovery_frac", "heavy_hitter_frac", "window_frac", "special_ids", "punctuation_ids")

    def __init__(
        self,
        *args,
        min_recovery_frac: float = 0.9,
        heavy_hitter_frac: float = 0.3,
        window_frac: float = 0.3,
        special_ids: tuple[int, ...] = (),
        punctuation_ids: tuple[int, ...] = (),
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not all(0 < f <= 1 for f in (min_recovery_frac, heavy_hitter_frac, window_frac)):
            raise ValueError(
                f"hybrid: min_recovery_frac, heavy_hitter_frac and window_frac must lie in (0, 1], got {min_recovery_frac}, {heavy_hitter_frac}, {window_frac}"
            )
        self.min_recovery_frac, self.heavy_hitter_frac, self.window_frac = min_recovery_frac, heavy_hitter_frac, window_frac
        device = self.pos.device
        self.register_buffer("special_ids", torch.tensor(special_ids or [-1], device=device), persistent=False)
        self.register_buffer("punctuation_ids", torch.tensor(punctuation_ids or [-1], device=device), persistent=False)
        self.register_buffer("policy", torch.zeros(self.pos.shape[:2], dtype=torch.long, device=device), persistent=False)
        self.register_buffer("token_class", torch.zeros(self.pos.shape, dtype=torch.uint8, device=device), persistent=False)

    def _classes(self, tokens: Tensor) -> Tensor:
        """1 for special tokens, 2 for punctuation, 0 otherwise; [B, T] -> [B, 1, T]."""
        special, punct = torch.isin(tokens, self.special_ids), torch.isin(tokens, self.punctuation_ids)
        return torch.where(special, 1, torch.where(punct, 2, 0)).to(torch.uint8)[:, None, :]

    def _covered(self, policy: Tensor, pos: Tensor, classes: Tensor, scores: Tensor, n: Tensor) -> Tensor:
        """Which tokens a policy [B, H, 1] keeps among tokens at `pos` [B, H, S] (-1 = none), given their
        classes and accumulated attention `scores`, once the sequence has n [B, 1, 1] tokens."""
        filled = pos >= 0
        special = (classes == 1) | (pos < self.global_tokens)
        punct = (classes == 2) & (policy >= 1)
        window = (policy >= 3) & (pos >= n - (self.window_frac * n).floor())
        fixed = filled & (special | punct | window | (policy == len(self.policies) - 1))
        candidates = filled & ~fixed & (policy >= 2)
        rank = scores.float().masked_fill(~candidates, float("-inf")).argsort(dim=-1, descending=True).argsort(dim=-1)
        return fixed | (candidates & (rank < (self.heavy_hitter_frac * n).floor()))

    def _expire(self, n: Tensor) -> None:
        """Empty the slots the policy no longer covers at sequence length n [B, 1, 1]."""
        self.pos.masked_fill_(~self._covered(self.policy[..., None], self.pos, self.token_class, self.scores, n), -1)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, tokens: Tensor) -> None:
        B, H, T, _ = k.shape
        last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
        w = min(self.profile_queries, T)
        query_pos = last - w + 1 + torch.arange(w, device=k.device)
        query_pos = torch.where(query_pos >= 0, query_pos, -1)  # rows shorter than w: fewer observed queries
        q_obs = q.gather(2, query_pos.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        probs = prompt_attention(q_obs, k, input_pos, query_pos)  # [B, H_kv, group, w, T]
        scores = probs.sum(dim=(2, 3))
        pos, classes, n = input_pos[:, None, :].expand(B, H, T), self._classes(tokens), (last + 1)[:, :, None]
        policy = torch.full((B, H, 1), len(self.policies) - 1, device=k.device)
        for p in reversed(range(len(self.policies) - 1)):  # the cheapest policy that recovers enough attention wins
            kept = self._covered(torch.full_like(policy, p), pos, classes.expand(B, H, T), scores, n)
            recovered = (probs * kept[:, :, None, None, :]).sum(dim=(2, 3, 4)) / (probs.shape[2] * (query_pos >= 0).sum(dim=-1, keepdim=True))
            policy = torch.where(recovered[..., None] >= self.min_recovery_frac, p, policy)
        self.policy.copy_(policy[..., 0])
        covered = self._covered(policy, pos, classes.expand(B, H, T), scores, n)
        self._store_prompt(input_pos, k, v, scores.masked_fill(~covered, -1.0))  # covered tokens first
        self.token_class.copy_(classes.expand(B, H, T).gather(2, self.pos.clamp(min=0)))
        self._expire(n)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self._expire(input_pos[:, :, None])
        keys, values, pos = super().update(input_pos, k, v, q)
        slot = (pos == input_pos[:, :, None]).to(torch.uint8).argmax(dim=-1, keepdim=True)
        self.token_class.scatter_(2, slot, self._classes(tokens).expand_as(slot))
        return keys, values, pos

    def stats(self) -> dict[str, int]:
        counts = torch.bincount(self.policy.flatten(), minlength=len(self.policies)).tolist()
        return {f"heads {name}": c for name, c in zip(self.policies, counts, strict=True)}


def adakv_slots(budget: int, n_heads: int, floor: float = DEFAULT_ADAKV_FLOOR) -> int:
    """The largest share Ada-KV can give one of `n_heads` heads with `budget` slots each: every prompt
    winner in that head (n_heads x budget) times (1 - floor), plus its floor share."""
    return math.ceil(round(budget * ((1 - floor) * n_heads + floor), 6))  # rounded first: 10 x 2.6 is 26.000000000000004 in floats


CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "window": WindowCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "heavy_hitter": HeavyHitterCache,
    "tova": TOVACache,
    "hybrid": HybridCache,
    "clusterkv": ClusterKVCache,
    "quest": QuestCache,
    "kvcompress": KVCompressCache,
}


def make_caches(
    strategy: str,
    n_layer: int,
    batch_size: int,
    n_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    n_heads: int | None = None,
    **options,
) -> list[KVCache]:
    """One cache per layer for a named strategy. `options` are the settings the strategy lists in its
    `options`: storage (cache_bits, key_quant_axis), eviction (global_tokens, recent_window), the
    prompt compressor (prompt_compression_strategy, snapkv_*) and the strategy's own. `n_heads` (query
    heads) is needed only for snapkv_gqa="query", where each query head keeps its own tokens."""
    if strategy not in CACHE_STRATEGIES:
        raise ValueError(f"unknown cache strategy {strategy!r}; choose from: {', '.join(CACHE_STRATEGIES)}")
    cls = CACHE_STRATEGIES[strategy]
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"cache strategy {strategy!r} does not take {', '.join(unknown)}; it takes: {', '.join(cls.options)}")
    if getattr(cls, "takes_history", False):
        options["n_heads"] = n_heads
    if getattr(cls, "shares_pool", False):  # one block pool for all the layers
        return cls.for_layers(n_layer, batch_size, n_kv_heads, capacity, head_dim, dtype, device, **options)
    snapkv = {k.removeprefix("snapkv_"): options.pop(k) for k in list(options) if k.startswith("snapkv_")}
    if issubclass(cls, EvictionCache) and "prompt_compression_strategy" in cls.options:
        name = options.pop("prompt_compression_strategy", None) or cls.default_prompt_compressor
        options["prompt_compressor"] = make_prompt_compressor(name, **snapkv)
        if snapkv.get("gqa") == "query":
            if n_heads is None:
                raise ValueError("snapkv_gqa='query' keeps tokens per query head: make_caches needs n_heads")
            options["kv_repeat"] = n_heads // n_kv_heads
    return [cls(batch_size, n_kv_heads, capacity, head_dim, dtype, device, **options) for _ in range(n_layer)]

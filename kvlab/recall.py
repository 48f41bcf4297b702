"""Recallable caches: nothing is evicted. Every token's keys and values stay in a slow tier (the full
history, position p in slot p); each decode step attends to a fixed budget of tokens chosen for its
query: the sinks, the newest tokens not yet indexed, and the best-scoring indexed tokens. A token
skipped now can be recalled later, which no evicting cache can do.

    clusterkv   ClusterKV (Liu et al., 2024): per KV head, k-means over post-RoPE keys (cosine
                distance); clusters are scored by the query's inner product with their centroids and
                taken best first until the budget is full (the last one trimmed). New tokens are
                clustered every `cluster_every` decode steps into `new_clusters` clusters.
    quest       Quest (Tang et al., 2024): pages of 16 consecutive tokens, scored by the largest q.k any
                key within each page's per-channel min/max box could give.

Selection is a top-k over per-token scores (a token scores as its cluster or page), so the attended set
has a static shape and the decode step compiles. `recall_select` picks per KV head (scores summed over
the query group, the attended KVs shared by the group) or per query head (each query head attends its
own tokens). The slow tier holds the whole history: by default a store on the compute device (compiles);
with `slow_tier="host"` it lives in host memory (pinned on CUDA) and the device keeps only the fast
tier, the KVs the last step attended: each step copies just the selected tokens it lacks (ClusterKV's
cache of the last step's selection; eager, since how many is data-dependent) and the stats count them.
They also count how many selected tokens were selected in the previous `reuse_steps` steps, the hit
rate a selection cache of R = reuse_steps steps would have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvlab.cache import KVCache
from kvlab.options import choice, integer

RECALL_SELECT = ("kv_head", "query_head")
SLOW_TIERS = ("device", "host")


class RecallableCache(KVCache):
    """Keeps every token (slow tier, `history` slots) and attends to `capacity` of them per step.
    Subclasses index the history (`_index_prompt`, `_index_token`) and score it for a query
    (`_scores`, [B, H_sel, history], higher = attend)."""

    positions_per_head = False  # the slow tier: position p in slot p for every head
    keeps_history = True  # the builder passes `history` (the longest sequence) and `n_heads`
    default_sink_tokens = 16

    @classmethod
    def min_slots(cls, options: dict[str, Any]) -> int:
        return options.get("sink_tokens", cls.default_sink_tokens) + 1

    options = (
        integer(
            "sink_tokens",
            None,
            "clusterkv/quest: first tokens always attended, attention sinks",
            minimum=0,
            default_help="16",
        ),
        choice(
            "recall_select",
            RECALL_SELECT,
            "kv_head",
            "clusterkv/quest: choose the attended tokens per KV head (query scores summed over its group) or "
            "per query head",
        ),
        integer(
            "reuse_steps", 1, "clusterkv/quest: count a selected token as a hit when selected in the last N steps too"
        ),
        choice(
            "slow_tier",
            SLOW_TIERS,
            "device",
            "clusterkv/quest: where the full history lives: a store on the compute device, or host memory "
            "(pinned on CUDA) with only the last step's attended KVs on the device, copying just the newly "
            "selected ones each step (eager only)",
        ),
    )

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        history: int | None = None,
        n_heads: int | None = None,
        sink_tokens: int | None = None,
        recall_select: str = "kv_head",
        reuse_steps: int = 1,
        slow_tier: str = "device",
    ) -> None:
        history = capacity if history is None else history
        super().__init__(batch_size, n_kv_heads, history, head_dim, dtype, device)
        self.sink_tokens = self.default_sink_tokens if sink_tokens is None else sink_tokens
        if (
            recall_select not in RECALL_SELECT
            or slow_tier not in SLOW_TIERS
            or reuse_steps < 1
            or not 0 <= self.sink_tokens < capacity <= history
        ):
            raise ValueError(
                f"{type(self).__name__}: need recall_select in {', '.join(RECALL_SELECT)}, slow_tier in "
                f"{', '.join(SLOW_TIERS)}, reuse_steps >= 1 and 0 <= sink_tokens < budget <= history; got "
                f"{recall_select!r}, {slow_tier!r}, {reuse_steps}, {self.sink_tokens} sinks, a budget of "
                f"{capacity} and {history} slots"
            )
        self.budget, self.recall_select, self.reuse_steps = capacity, recall_select, reuse_steps
        self.slow_tier = slow_tier
        heads = n_kv_heads if recall_select == "kv_head" else n_heads or n_kv_heads
        if slow_tier == "host":
            self._move_history_to_host(batch_size, heads, capacity, head_dim, dtype, device)
        self.register_buffer("row_budget", torch.full((batch_size, 1, 1), capacity, device=device), persistent=False)
        self.register_buffer(
            "indexed_upto", torch.zeros(batch_size, 1, 1, dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer(
            "last_selected",
            torch.full((batch_size, heads, history), -(2**30), dtype=torch.long, device=device),
            persistent=False,
        )
        # steps, reuse hits, selections
        self.register_buffer("counts", torch.zeros(3, dtype=torch.long, device=device), persistent=False)

    def _move_history_to_host(
        self, batch_size: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        """The history in host memory (pinned for fast copies to a GPU); the device keeps what one step attends, the
        fast tier."""
        self.pinned = self.pos.device.type == "cuda"
        for name in ("k", "v"):
            history = getattr(self.storage, name).cpu()
            setattr(self.storage, name, history.pin_memory() if self.pinned else history)
        self.register_buffer(
            "fast_k", torch.zeros(batch_size, heads, capacity, head_dim, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer("fast_v", torch.zeros_like(self.fast_k), persistent=False)
        self.register_buffer(
            "fast_slots",
            torch.full((batch_size, heads, capacity), -1, dtype=torch.long, device=device),
            persistent=False,
        )
        self.copied = 0

    def limit_rows(self, capacities: Tensor, decode_room: Tensor | None = None) -> None:
        """Each sequence attends its capacity every step; at a compression ratio that counts its decode room too
        (nothing is evicted anyway)."""
        if int(capacities.max()) > self.budget or int(capacities.min()) <= self.sink_tokens:
            raise ValueError(
                f"{type(self).__name__}: per-sequence budgets must exceed sink_tokens ({self.sink_tokens}) and "
                f"fit {self.budget}; got {capacities.tolist()}"
            )
        self.row_budget.copy_(capacities.view(-1, 1, 1))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        B, H, T, _ = k.shape
        if T > self.capacity:
            raise ValueError(f"a prompt of {T} tokens does not fit a history of {self.capacity} slots")
        self._store(torch.arange(T, device=k.device).expand(B, H, T), k, v, prompt=True)
        self.pos[:, :T] = input_pos
        self.indexed_upto.copy_((input_pos.max(dim=-1).values + 1)[:, None, None])
        self._index_prompt(input_pos, k)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self._store(input_pos[:, None, :].expand(k.shape[:3]), k, v)
        self.pos.scatter_(1, input_pos, input_pos)
        self._index_token(input_pos, k)
        slots = self._select(q, input_pos)  # [B, H_sel, budget]
        pos = self.pos[:, None, :].expand(slots.shape[0], slots.shape[1], -1).gather(2, slots)
        pos = pos.masked_fill(torch.arange(self.budget, device=pos.device) >= self.row_budget, -1)
        self._count_reuse(slots, pos)
        if self.slow_tier == "host":
            return *self._fetch(slots, pos >= 0), pos
        keys, values = self.storage.read()
        if slots.shape[1] != keys.shape[1]:  # per query head: each reads its KV head's history
            group = slots.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        index = slots[..., None].expand(*slots.shape, keys.shape[-1])
        return keys.gather(2, index), values.gather(2, index), pos

    def _store(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        """Write keys/values into the slow tier, wherever it lives."""
        where = self.storage.k.device
        self.storage.write(slots.to(where), k.to(where), v.to(where), prompt=prompt)

    def _history_keys(self, positions: Tensor) -> Tensor:
        """Keys [B, H_kv, N, D] of the tokens at positions [B, N], on the compute device."""
        keys = self.storage.read()[0]
        index = positions.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        return keys.gather(2, index).to(self.pos.device)

    def _fetch(self, slots: Tensor, attended: Tensor) -> tuple[Tensor, Tensor]:
        """The step's keys and values from the fast tier (last step's selection) where it has them, copying
        only the missing attended ones from the host tier (eager: how many is data-dependent)."""
        sorted_fast, order = self.fast_slots.sort(dim=-1)
        at = torch.searchsorted(sorted_fast, slots).clamp(max=self.budget - 1)
        hit = sorted_fast.gather(-1, at) == slots
        source = order.gather(-1, at)[..., None].expand(*slots.shape, self.fast_k.shape[-1])
        keys, values = self.fast_k.gather(2, source), self.fast_v.gather(2, source)
        b, h, j = (~hit & attended).nonzero(as_tuple=True)
        kv_head = h // (slots.shape[1] // self.storage.k.shape[1])
        index = (b.cpu(), kv_head.cpu(), slots[b, h, j].cpu())
        for buffer, host in ((keys, self.storage.k), (values, self.storage.v)):
            missing = host[index]
            buffer[b, h, j] = (missing.pin_memory() if self.pinned else missing).to(buffer.device, non_blocking=True)
        self.fast_k.copy_(keys)
        self.fast_v.copy_(values)
        self.fast_slots.copy_(slots.masked_fill(~attended, -1))  # unattended entries were not fetched: never a hit
        self.copied += b.numel()
        return keys, values

    def _select(self, q: Tensor, input_pos: Tensor) -> Tensor:
        """Slots to attend [B, H_sel, budget]: sinks first, then the unindexed newest tokens (newest
        first), then indexed tokens by score; never an empty or future slot."""
        scores = self._scores(q)  # [B, H_sel, history]
        current = input_pos[:, :, None]
        pos = self.pos[:, None, :]
        scores = scores.double()
        low, high = scores.amin(dim=-1, keepdim=True), scores.amax(dim=-1, keepdim=True)
        # ties (one cluster or page) go to the newest tokens
        unit = (scores - low) / (high - low).clamp(min=1e-9) + pos * 1e-12
        recent = (pos >= self.indexed_upto) & (pos <= current)
        rank = torch.where(recent, 2 + pos / self.capacity, unit)  # indexed tokens in [0, 1], recent ones above
        rank = rank.masked_fill((pos >= 0) & (pos < self.sink_tokens), 4.0)
        rank = rank.masked_fill((pos < 0) | (pos > current), -1.0)
        return rank.topk(self.budget, dim=-1).indices

    def _count_reuse(self, slots: Tensor, pos: Tensor) -> None:
        """Count the attended slots that were also attended in the previous `reuse_steps` steps."""
        step = self.counts[0]
        attended, last = pos >= 0, self.last_selected.gather(2, slots)
        reused = (last >= step - self.reuse_steps) & attended
        self.last_selected.scatter_(2, slots, torch.where(attended, step, last))
        self.counts += torch.stack([torch.ones_like(step), reused.sum(), attended.sum()])

    def _index_prompt(self, input_pos: Tensor, k: Tensor) -> None:
        raise NotImplementedError

    def _index_token(self, input_pos: Tensor, k: Tensor) -> None:
        """Index the step's new key k [B, H_kv, 1, D] at input_pos [B, 1] (inside the compiled step)."""

    def _scores(self, q: Tensor) -> Tensor:
        raise NotImplementedError

    def _per_selection_head(self, scores: Tensor) -> Tensor:
        """[B, H_kv, group, X] per query head -> [B, H_sel, X]: summed over the group, or kept per query head."""
        return scores.sum(dim=2) if self.recall_select == "kv_head" else scores.flatten(1, 2)

    def tokens_held(self) -> Tensor:
        """Tokens attended per step (the fast tier), per sequence."""
        return torch.minimum((self.pos >= 0).sum(dim=-1), self.row_budget.view(-1)).float()

    def device_nbytes(self) -> int:
        """Bytes of keys and values this cache keeps in device memory, measured from its buffers: the
        whole history with slow_tier="device"; with slow_tier="host" only the fast tier (fast_k, fast_v
        and their slot ids fast_slots), the history being in host memory. Selection indexes (centroids,
        page bounds) and positions are bookkeeping, left out as for every cache's nbytes()."""
        if self.slow_tier == "host":
            return self.fast_k.nbytes + self.fast_v.nbytes + self.fast_slots.nbytes
        return self.nbytes()

    def stats(self) -> dict[str, int]:
        _, hits, selected = self.counts.tolist()
        copies = {"recall: copied from the host tier": self.copied} if self.slow_tier == "host" else {}
        return {
            "recall: selected tokens": selected,
            "recall: also selected in the previous reuse_steps": hits,
            **copies,
        }

    def reset(self) -> None:
        super().reset()
        self.indexed_upto.zero_()
        self.last_selected.fill_(-(2**30))
        self.counts.zero_()
        if self.slow_tier == "host":
            self.fast_slots.fill_(-1)
            self.copied = 0

"""A paged KV cache with a length per (sequence, layer, KV head), and KV-Compress eviction (Rehg, 2024,
"KV-Compress: Paged KV-Cache Compression with Variable Compression Rates per Attention Head").

Memory is one pool of blocks shared by all layers, sequences and heads; a block holds `block_size`
KVs of one (sequence, layer, KV head), and block tables list each head's blocks in order. A head that
keeps fewer KVs holds fewer blocks, so with a pool sized to a memory budget the physical KV bytes
really fall with the compression rate (a dense [B, H, C, D] buffer cannot give back what one head
leaves unused). Attention reads each head's blocks in place through its block table: kvlab's native paged
attention on the CPU (which also returns the step's metric), or (kvc_attention flex) FlexAttention through a block
mask; elsewhere it gathers each head's blocks into a masked static-shape view.

KV-Compress scores every KV by the *squared* attention probabilities it received, summed over the
observed queries and over the query heads sharing its KV head (the cache is never repeated per query
head):
    KVC-w     the last `kvc_window` (8) prompt queries, max-pooled over keys (kernel 7); the newest
              `kvc_protect` (8) tokens are never evicted
    KVC-full  (kvc_full) every prompt query, skipping query-key pairs less than `kvc_skip` (10)
              positions apart; 32 protected tokens
Eviction meets a budget for the whole sequence: `max_cache_length` tokens x layers x KV heads (scope
`model`) or per layer (scope `layer`, Ada-KV's per-head budgets inside each layer). Each head's KVs are
sorted by metric and cut into block-sized chunks from the bottom (the first chunk is the partial one,
so evicting k chunks frees exactly k blocks); chunks are scored by their largest metric and the lowest
chunks over all heads (and layers) go, so heads and layers keep different amounts. Survivors are
compacted to the front of their heads' blocks (in their old order; RoPE is already applied, so order
does not matter to attention) and the emptied blocks return to the pool. With block size 1 this is
exactly a top-k over all heads' KVs. Continual compression keeps adding each decode step's squared
attention into the metrics and compresses again every `kvc_compress_every` steps (0: at prefill only),
and whenever the pool would otherwise run out.

Host-side work (block allocation, compression) runs outside the decode step in `maintain`, like a
paged server's scheduler; the decode step itself (append + attention) has static shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from kvlab import kernels, parallel
from kvlab.attention import decode_attention
from kvlab.block_tables import BlockTables, view_width
from kvlab.scores import chunk_attention, last_real_queries, pool_keys, received_attention, window_attention

KVC_METRICS = ("squared", "l1")
KVC_SCOPES = ("model", "layer")
KVC_ATTENTION = ("gather", "flex")
METRIC_CODES = {"l1": 1, "squared": 2}  # kvlab::attend_paged's metric argument


def check_settings(
    attention: str,
    compress_every: int,
    metric: str,
    scope: str,
    block_size: int,
    window: int,
    kernel: int,
    skip: int,
    head_floor: float,
) -> None:
    """A one-line error naming any kvcompress setting out of range, or a combination that cannot run."""
    if attention not in KVC_ATTENTION:
        raise ValueError(f"kvcompress: kvc_attention must be one of {', '.join(KVC_ATTENTION)}; got {attention!r}")
    if attention == "flex" and compress_every > 0:
        raise ValueError(
            f"kvcompress: kvc_attention flex needs kvc_compress_every 0 (got {compress_every}): FlexAttention "
            "returns no probabilities for the continual metric; use kvc_attention gather to compress during "
            "decoding"
        )
    if metric not in KVC_METRICS or scope not in KVC_SCOPES:
        raise ValueError(
            f"kvcompress: kvc_metric must be one of {', '.join(KVC_METRICS)} and kvc_scope one of "
            f"{', '.join(KVC_SCOPES)}; got {metric!r}, {scope!r}"
        )
    if (
        min(block_size, window, kernel) < 1
        or compress_every < 0
        or kernel % 2 == 0
        or skip < 0
        or not 0 <= head_floor <= 1
    ):
        raise ValueError(
            "kvcompress: need kvc_block_size, kvc_window >= 1, kvc_compress_every >= 0, an odd kvc_kernel, "
            f"kvc_skip >= 0 and kvc_head_floor in [0, 1]; got {block_size}, {window}, {compress_every}, "
            f"{kernel}, {skip}, {head_floor}"
        )


class PagedKV(BlockTables):
    """KV-Compress over `BlockTables` (block_tables.py): each sequence's budget per layer, every KV's
    metric (from the prompt's queries, then each decode step's attention), and eviction of the
    lowest-scoring block-sized chunks over all heads (and layers) down to the budget."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None,
        history: int,
        block_size: int = 16,
        pool_blocks: int | None = None,
        window: int = 8,
        kernel: int = 7,
        full: bool = False,
        skip: int = 10,
        protect: int | None = None,
        metric: str = "squared",
        scope: str = "model",
        head_floor: float = 0.0,
        compress_every: int = 1,
        attention: str = "gather",
    ) -> None:
        check_settings(attention, compress_every, metric, scope, block_size, window, kernel, skip, head_floor)
        super().__init__(
            n_layer, batch_size, n_kv_heads, head_dim, dtype, device, history, block_size, pool_blocks, attention
        )
        self.window, self.kernel, self.full, self.skip = window, kernel, full, skip
        self.protect = (32 if full else window) if protect is None else protect
        self.metric_kind, self.scope, self.head_floor, self.compress_every = metric, scope, head_floor, compress_every
        self.continual = compress_every > 0
        # tokens per head each sequence keeps, per layer; pool_blocks None: the pool is sized at each batch prefill
        # (`size_pool`)
        self.register_buffer(
            "budget", torch.full((batch_size, n_layer), history, dtype=torch.long, device=device), persistent=False
        )
        self.steps = 0
        self.counts = {"kvcompress: compressions": 0, "kvcompress: blocks freed": 0}

    # ---- the decode step (static shapes) -------------------------------------------------------

    def append(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one token per row (input_pos [R, 1], -1: none) after each head's last KV; return the
        gathered view (keys, values [R, H, W x block, D], positions [R, H, W x block]). A step may run the
        first R <= batch rows only (a server whose higher rows are idle)."""
        self._write(layer, input_pos, k, v)
        return self.view(layer, input_pos.shape[0])

    def attend(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """`append`, then attention over the pool in place, the step's metric added where the compression is
        continual: FlexAttention through a block mask (kvc_attention flex), or kvlab's native paged attention
        (`kvlab::attend_paged`, on the CPU), each head's blocks read through its block table; elsewhere over the
        gathered view. Returns y [R, H_q, 1, D]; a row without a token this step gets zeros."""
        if self.attention == "flex":
            return self._attend_flex(layer, input_pos, k, v, q)
        self._write(layer, input_pos, k, v)
        table = self.table[layer, : input_pos.shape[0], :, : self.view_blocks]
        if kernels.takes_attention(q, self.pool.k, self.pool.v):
            metric = METRIC_CODES[self.metric_kind] if self.continual else 0
            y, step_metric = torch.ops.kvlab.attend_paged(
                q.float(), self.pool.k, self.pool.v, self.pool.pos, table, input_pos, metric
            )
            y = y.to(q.dtype)
        else:
            keys, values, key_pos = self.view(layer, input_pos.shape[0])
            y, probs = decode_attention(q, keys, values, key_pos, input_pos, self.continual)
            step_metric = self._metric(probs) if self.continual else None
        if self.continual:
            self._add_metric(table, step_metric)
        return y

    def _attend_flex(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """`append`, then FlexAttention straight over the pool: each row's query heads visit their KV head's blocks
        as the block table lists them (kvc_compress_every 0: it returns no probabilities for the metric)."""
        self._write(layer, input_pos, k, v)
        D = self.pool.k.shape[-1]
        keys, values = self.pool.k.view(1, 1, -1, D), self.pool.v.view(1, 1, -1, D)
        return flex_attention(
            q, keys, values, block_mask=self.block_mask(layer, input_pos, q.shape[1]), enable_gqa=True
        )

    def observe(self, layer: int, probs: Tensor) -> None:
        """Add the step's attention (probs [R, H_kv, group, T, W x block]) into the metrics of the viewed slots."""
        self._add_metric(self.table[layer, : probs.shape[0], :, : self.view_blocks], self._metric(probs))

    def _add_metric(self, table: Tensor, metric: Tensor) -> None:
        """Add a step's metric of the viewed slots ([R, H_kv, W x block], the blocks `table` [R, H_kv, W] lists)
        into the pool's."""
        self.pool.metric.view(-1).index_add_(0, self._slot_ids(table).flatten(), metric.flatten())

    # ---- prefill -------------------------------------------------------------------------------

    def write_prompt(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        """Store every prompt KV of this layer (right-padded rows) in fresh blocks, with its metric.
        After the last layer, each sequence is compressed to its budget."""
        rows = torch.arange(k.shape[0], device=k.device) if self.prefill_rows is None else self.prefill_rows
        n = (input_pos >= 0).sum(dim=-1)  # [b]
        B, H, T, D = k.shape
        if layer == 0 and self.auto_pool and self.prefill_rows is None:  # a whole batch starts: size the pool for it
            self.release_all()
            self.pool.resize(self.size_pool(n.tolist()))
        self._release(self.table[layer, rows])
        needed = (
            torch.arange(self.max_blocks, device=k.device)
            < ((n + self.block_size - 1) // self.block_size)[:, None, None]
        )
        table = torch.full((B, H, self.max_blocks), -1, dtype=torch.long, device=k.device)
        table[needed.expand_as(table)] = self.pool.allocate(int(needed.sum()) * H)
        self.table[layer, rows] = table
        slots = self._slot_ids(table)[:, :, :T]  # [b, H, T]
        filled = (input_pos >= 0)[:, None, :].expand(B, H, T)
        self.pool.k.view(-1, D)[slots[filled]] = k[filled]
        self.pool.v.view(-1, D)[slots[filled]] = v[filled]
        self.pool.pos.view(-1)[slots[filled]] = input_pos[:, None, :].expand(B, H, T)[filled]
        self.pool.metric.view(-1)[slots[filled]] = self._prompt_metric(input_pos, k, q)[filled]
        self.length[layer, rows] = n[:, None].expand(B, H)
        self.last_pos[rows] = n - 1
        self.active[rows] = n > 0
        if layer == self.n_layer - 1:
            for row in rows.tolist():
                self.compress_row(row)
            self.make_room()

    def _prompt_metric(self, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
        """[b, H_kv, T]: KVC-w (the last `window` queries, max-pooled) or KVC-full (every query, pairs
        closer than `skip` positions left out)."""
        if not self.full:
            return pool_keys(self._metric(window_attention(input_pos, k, q, self.window)), self.kernel)

        def far(probs: Tensor, query_pos: Tensor) -> Tensor:
            near = query_pos[:, :, None] - input_pos[:, None, : probs.shape[-1]] < self.skip  # [b, t, e]
            return self._metric(probs.masked_fill(near[:, None, None], 0.0))

        return received_attention(q, k, input_pos, far)

    def write_chunk(
        self,
        layer: int,
        input_pos: Tensor,
        k: Tensor,
        v: Tensor,
        q: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        """A later chunk of a chunked prefill (input_pos [B, N], right-padded): its KVs go after each head's, in
        fresh blocks as needed, and it attends over the head's blocks. Its queries then score every KV the head
        holds, as at prefill (KVC-w or KVC-full), replacing the earlier chunks' scores (as SnapKV's chunk scores
        do). After the last layer each sequence is compressed back to its budget, which frees the blocks, so
        the pool holds at most the budgets + one chunk. A row whose prompt has ended keeps its scores."""
        if self.prefill_rows is not None:
            raise ValueError("kvcompress: a server admits whole prompts; it takes no chunked prefill")
        if layer == 0:
            self._room_for_chunk(input_pos)
        self._append_chunk(layer, input_pos, k, v)
        keys, values, key_pos = self.view(layer, k.shape[0])
        y = attend(keys, values, key_pos)
        live = (input_pos >= 0).any(dim=-1)
        scored = (key_pos >= 0) & live[:, None, None]
        slots = self._slot_ids(self.table[layer, :, :, : self.view_blocks])
        self.pool.metric.view(-1)[slots[scored]] = self._chunk_metric(key_pos, keys, input_pos, q)[scored]
        self.last_pos.copy_(torch.where(live, input_pos.max(dim=-1).values, self.last_pos))
        self.active |= live
        if layer == self.n_layer - 1:
            for row in live.nonzero().flatten().tolist():
                self.compress_row(row)
            self.make_room()
        return y

    def _room_for_chunk(self, input_pos: Tensor) -> None:
        """Before a chunk's first layer: a pool sized at prefill (no kvc_pool_blocks) grows by what the chunk's
        KVs need in every layer beyond its free blocks; later chunks reuse the blocks compression frees."""
        m = (input_pos >= 0).sum(dim=-1)[None, :, None]
        need = ((self.length + m + self.block_size - 1) // self.block_size - self._blocks_held()).clamp(min=0)
        short = int(need.sum()) - self.pool.free_blocks()
        if short > 0 and self.auto_pool:
            self.pool.grow(self.pool.n_blocks + short)
            self._track_owners()

    def _chunk_metric(self, key_pos: Tensor, keys: Tensor, input_pos: Tensor, q: Tensor) -> Tensor:
        """[B, H_kv, S]: the prompt metric of the viewed KVs (key_pos [B, H_kv, S]) from a chunk's queries q [B, H, N,
        D]."""
        if not self.full:
            return pool_keys(self._metric(chunk_attention(key_pos, keys, input_pos, q, self.window)), self.kernel)
        observed = last_real_queries(input_pos, input_pos.shape[1])[1]
        near = observed[:, None, None, :, None] - key_pos[:, :, None, None, :] < self.skip
        return self._metric(chunk_attention(key_pos, keys, input_pos, q, None).masked_fill(near, 0.0))

    def _metric(self, probs: Tensor) -> Tensor:
        """[B, H_kv, group, t, S] probabilities -> [B, H_kv, S]: summed (squared, for KV-Compress) over queries and the
        group."""
        probs = probs.float()
        return (probs.square() if self.metric_kind == "squared" else probs).sum(dim=(2, 3))

    # ---- host-side upkeep ----------------------------------------------------------------------

    def maintain(self) -> None:
        """After a decode step: compress on schedule, then give every head of an active row room for its next KV."""
        self.steps += 1
        self.last_pos += self.active.long()
        if self.continual and self.steps % self.compress_every == 0:
            for row in self.active.nonzero().flatten().tolist():
                self.compress_row(row)
        self.make_room()

    def make_room(self) -> None:
        """Allocate a block for every head of an active row whose blocks are full; compress every sequence
        to its budget first when the pool is short (PoolExhausted if even that is not enough)."""
        full = (self.length == self._blocks_held() * self.block_size) & self.active[None, :, None]
        if parallel.any_rank(int(full.sum()) > self.pool.free_blocks()):  # compression reaches every rank's heads
            for row in self.active.nonzero().flatten().tolist():
                self.compress_row(row)
            full = (self.length == self._blocks_held() * self.block_size) & self.active[None, :, None]
        if full.any():
            where = full.nonzero(as_tuple=True)
            self.table[(*where, self.length[where] // self.block_size)] = self.pool.allocate(int(full.sum()))
        self.view_blocks = view_width(int(self._blocks_held().max()), self.max_blocks)
        self._track_owners()

    def compress_row(self, row: int) -> int:
        """Evict the lowest-scoring chunks of sequence `row` until its blocks fit its budget; compact the
        survivors and free the emptied blocks. Returns the number of blocks freed."""
        bs, L = self.block_size, self.n_layer
        table = self.table[:, row]  # [L, H, M]
        n = self.length[:, row]  # [L, H]
        before = self._blocks_held()[:, row]
        held = (n + bs - 1) // bs  # blocks holding KVs (make_room's empty block for the next token does not count)
        # under tensor parallelism, every rank's heads compete as in one process
        every_held = parallel.gather_heads(held)
        H = every_held.shape[1]
        if self.scope == "layer":  # each layer's blocks within its own budget
            over = every_held.sum(dim=-1) - self.budget[row] * H // bs
        else:
            over = (every_held.sum() - self.budget[row].sum() * H // bs).view(1)
        if int(over.clamp(min=0).sum()) == 0:
            return 0
        slots = self._slot_ids(table)  # [L, H, S]
        pos = self.pool.pos.view(-1)[slots].masked_fill(
            torch.arange(slots.shape[-1], device=n.device) >= n[..., None], -1
        )
        metric = self.pool.metric.view(-1)[slots]
        key = metric.masked_fill(pos > self.last_pos[row] - self.protect, float("inf")).masked_fill(
            pos < 0, float("inf")
        )
        # Ada-KV's safeguard: every head keeps its best floor x (its layer's per-head budget) KVs
        if self.head_floor > 0:
            floor = (self.head_floor * self.budget[row]).ceil().long()[:, None, None]
            key = key.masked_fill(
                metric.masked_fill(pos < 0, float("-inf")).argsort(dim=-1, descending=True).argsort(dim=-1) < floor,
                float("inf"),
            )
        ascending, order = key.sort(dim=-1, stable=True)
        first = n - (held - 1) * bs  # the first chunk's size (1..bs): evicting it frees a whole block
        chunk = torch.arange(self.max_blocks, device=n.device)
        ends = first[..., None] + chunk * bs  # [L, H, M]
        score = ascending.gather(-1, (ends - 1).clamp(0, slots.shape[-1] - 1)).masked_fill(
            chunk >= held[..., None], float("inf")
        )
        every_score = parallel.gather_heads(score)
        # chunks competing for one budget
        groups = every_score.view(L, -1) if self.scope == "layer" else every_score.view(1, -1)
        rank = groups.argsort(dim=-1, stable=True).argsort(dim=-1)
        # chunks per head, lowest first
        evicted = parallel.local_heads(((rank < over[:, None]) & groups.isfinite()).view(L, H, -1).sum(dim=-1))
        dropped = torch.where(evicted > 0, first + (evicted - 1) * bs, 0)
        keep = torch.zeros_like(pos, dtype=torch.bool).scatter_(
            -1, order, torch.arange(slots.shape[-1], device=n.device) >= dropped[..., None]
        )
        changed = dropped > 0  # only these heads move anything
        self._compact(row, changed, slots[changed], keep[changed] & (pos[changed] >= 0))
        freed = int((before - self._blocks_held()[:, row]).sum())
        self.counts["kvcompress: compressions"] += 1
        self.counts["kvcompress: blocks freed"] += freed
        return freed

    def size_pool(self, prompt_lengths: list[int]) -> int:
        """Blocks a batch of prompts (one per row, prefilled together) needs with its current budgets: the
        larger of the prompts' transient need (every layer's prompt KVs are stored before the last layer
        compresses them) and, per sequence, what compression keeps (its budget in blocks, or the blocks of
        KVs it may not evict: the protected window and head floors) plus a growing block per head; never
        more than every sequence uncompressed."""
        L, H, bs = self.n_layer, self.length.shape[2], self.block_size
        every = parallel.all_heads(H)  # under tensor parallelism a rank's heads may win the whole budget
        transient = sum(L * H * -(-n // bs) for n in prompt_lengths)
        kept = 0
        for row in range(len(prompt_lengths)):
            budget = self.budget[row]
            floor = (self.head_floor * budget.float()).ceil().long()
            # per head: ceil((protected + bs - 1) / bs)
            unevictable = int((H * ((self.protect + floor + 2 * bs - 2) // bs)).sum())
            kept += min(L * H * self.max_blocks, max(int(budget.sum()) * every // bs, unevictable) + L * H)
        return min(self.full_pool, max(transient, kept))

    def reset(self) -> None:
        super().reset()
        self.steps = 0
        self.counts = dict.fromkeys(self.counts, 0)

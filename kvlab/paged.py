"""A paged KV cache with a length per (sequence, layer, KV head), and KV-Compress eviction (Rehg, 2024,
"KV-Compress: Paged KV-Cache Compression with Variable Compression Rates per Attention Head").

Memory is one pool of blocks shared by all layers, sequences and heads; a block holds `block_size`
KVs of one (sequence, layer, KV head), and block tables list each head's blocks in order. A head that
keeps fewer KVs holds fewer blocks, so with a pool sized to a memory budget the physical KV bytes
really fall with the compression rate (a dense [B, H, C, D] buffer cannot give back what one head
leaves unused). Attention gathers each head's blocks into a masked static-shape view, or (kvc_attention
flex) FlexAttention reads them in place through a block mask built from the block tables.

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
paged server's scheduler; the decode step itself (append + gather) has static shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvlab import parallel
from kvlab.pool import BlockPool
from kvlab.scores import chunk_attention, last_real_queries, pool_keys, received_attention, window_attention

KVC_METRICS = ("squared", "l1")
KVC_SCOPES = ("model", "layer")
KVC_ATTENTION = ("gather", "flex")
VIEW_ROUND = 8  # the attention view is VIEW_ROUND x a power of two blocks (capped): O(log) shapes for a compiled step


def view_width(most: int, max_blocks: int) -> int:
    """Blocks per head the attention view gathers when the largest head holds `most`: the smallest
    VIEW_ROUND x 2^k that fits, capped at `max_blocks`, so a compiled decode step sees at most
    1 + ceil(log2(max_blocks / VIEW_ROUND)) widths however the heads grow."""
    width = VIEW_ROUND
    while width < most:
        width *= 2
    return min(max_blocks, width)


def check_settings(
    attention: str, compress_every: int, metric: str, scope: str, block_size: int, window: int, kernel: int, skip: int, head_floor: float
) -> None:
    """A one-line error naming any kvcompress setting out of range, or a combination that cannot run."""
    if attention not in KVC_ATTENTION:
        raise ValueError(f"kvcompress: kvc_attention must be one of {', '.join(KVC_ATTENTION)}; got {attention!r}")
    if attention == "flex" and compress_every > 0:
        raise ValueError(
            f"kvcompress: kvc_attention flex needs kvc_compress_every 0 (got {compress_every}): FlexAttention returns no probabilities "
            "for the continual metric; use kvc_attention gather to compress during decoding"
        )
    if metric not in KVC_METRICS or scope not in KVC_SCOPES:
        raise ValueError(
            f"kvcompress: kvc_metric must be one of {', '.join(KVC_METRICS)} and kvc_scope one of {', '.join(KVC_SCOPES)}; got {metric!r}, {scope!r}"
        )
    if min(block_size, window, kernel) < 1 or compress_every < 0 or kernel % 2 == 0 or skip < 0 or not 0 <= head_floor <= 1:
        raise ValueError(
            "kvcompress: need kvc_block_size, kvc_window >= 1, kvc_compress_every >= 0, an odd kvc_kernel, kvc_skip >= 0 and kvc_head_floor in [0, 1]; "
            f"got {block_size}, {window}, {compress_every}, {kernel}, {skip}, {head_floor}"
        )


class PagedKV(nn.Module):
    """Block tables and per-head lengths of `n_layer` layers x `batch_size` sequences x `n_kv_heads`
    over one `BlockPool`, and KV-Compress's metrics, budgets and eviction. Tokens of a head fill its
    table's slots 0 .. length-1 (compaction keeps them a prefix). `prefill_rows` says which batch rows
    a prefill of fewer rows writes (a server admits one sequence at a time into a running batch)."""

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
        super().__init__()
        check_settings(attention, compress_every, metric, scope, block_size, window, kernel, skip, head_floor)
        self.block_size, self.window, self.kernel, self.full, self.skip = block_size, window, kernel, full, skip
        self.protect = (32 if full else window) if protect is None else protect
        self.metric_kind, self.scope, self.head_floor, self.compress_every = metric, scope, head_floor, compress_every
        self.continual, self.attention = compress_every > 0, attention
        self.n_layer = n_layer
        self.max_blocks = math.ceil(history / block_size)  # per head: a head never holds more than the sequence
        self.full_pool = n_layer * batch_size * n_kv_heads * self.max_blocks  # every sequence uncompressed
        # pool_blocks None: sized at each batch prefill from the budgets and the prompts (`size_pool`)
        self.auto_pool = pool_blocks is None
        self.pool = BlockPool(0 if pool_blocks is None else pool_blocks, block_size, head_dim, dtype, device)
        L, B, H = n_layer, batch_size, n_kv_heads
        self.register_buffer("table", torch.full((L, B, H, self.max_blocks), -1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("length", torch.zeros(L, B, H, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("budget", torch.full((B, L), history, dtype=torch.long, device=device), persistent=False)  # tokens per head
        self.register_buffer("last_pos", torch.full((B,), -1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("active", torch.zeros(B, dtype=torch.bool, device=device), persistent=False)
        # (layer, row, head) holding each slot's block, for FlexAttention's mask function; kept up to date host-side
        # (`_track_owners`): built inside a compiled step, or read per block (owner[kv // block]), it broke
        # Inductor's CPU flex kernel (torch 2.13: wrong values, then C++ that did not compile)
        self.register_buffer("owner", torch.full(((self.pool.n_blocks + 1) * block_size,), -1, dtype=torch.long, device=device), persistent=False)
        self.prefill_rows: Tensor | None = None
        self.view_blocks = view_width(0, self.max_blocks)  # blocks per head the attention view gathers (host-side: see view_width)
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
        """`append`, then attention straight over the pool with FlexAttention (kvc_attention flex): each
        row's query heads visit their KV head's blocks as the block table lists them, so no view is
        gathered. Returns y [R, H_q, 1, D]; a row without a token this step gets zeros."""
        self._write(layer, input_pos, k, v)
        D = self.pool.k.shape[-1]
        keys, values = self.pool.k.view(1, 1, -1, D), self.pool.v.view(1, 1, -1, D)
        return flex_attention(q, keys, values, block_mask=self.block_mask(layer, input_pos, q.shape[1]), enable_gqa=True)

    def block_mask(self, layer: int, input_pos: Tensor, n_query_heads: int) -> BlockMask:
        """FlexAttention's block mask over the whole pool for one decode step of a layer, from its block
        tables: every held block of a head but the last is full (compaction keeps its KVs a prefix), the
        last is masked by position. The mask function also checks which head owns a block (`owner`), so
        the unfused (eager) path, which applies it to every slot of the pool, gives the same answer."""
        R, bs = input_pos.shape[0], self.block_size
        n, table = self.length[layer, :R], self.table[layer, :R].clamp(min=0)  # [R, H], [R, H, M]
        H, M = n.shape[1], table.shape[-1]
        group, columns = n_query_heads // H, self.pool.n_blocks + 1  # flex wants block columns spanning the whole pool
        full = n // bs
        last = table.gather(-1, full.clamp(max=M - 1)[..., None])

        def per_query_head(x: Tensor, width: int) -> Tensor:
            return F.pad(x, (0, width)).repeat_interleave(group, dim=1)[:, :, None].to(torch.int32)

        pos, current, first = self.pool.pos.view(-1), input_pos[:, -1], layer * self.table.shape[1] * H

        def visible(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            key_pos = pos[kv_idx]
            return (key_pos >= 0) & (key_pos <= current[b]) & (self.owner[kv_idx] == first + b * H + h // group)

        return BlockMask.from_kv_blocks(
            per_query_head(n % bs > 0, 0)[..., 0],
            per_query_head(last, columns - 1),
            per_query_head(full[..., None], 0)[..., 0],
            per_query_head(table, columns - M),
            BLOCK_SIZE=(1, bs),
            mask_mod=visible,
            seq_lengths=(1, columns * bs),
            compute_q_blocks=False,
        )

    def _write(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        R = input_pos.shape[0]
        n = self.length[layer, :R]  # [R, H]
        writes = (input_pos >= 0).expand_as(n)
        block = self.table[layer, :R].gather(2, (n // self.block_size).clamp(max=self.max_blocks - 1)[..., None])[..., 0]
        block = torch.where(writes & (block >= 0), block, 0)
        offset = n % self.block_size
        self.pool.k[block, offset] = torch.where(writes[..., None], k[:, :, 0], 0.0)  # an idle row's k, v may be NaN (it attends
        self.pool.v[block, offset] = torch.where(writes[..., None], v[:, :, 0], 0.0)  # nothing); the null block must stay finite
        self.pool.pos[block, offset] = torch.where(writes, input_pos, -1)
        self.pool.metric[block, offset] = 0.0
        self.length[layer, :R] += writes.long()

    def view(self, layer: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
        blocks = self.table[layer, :rows, :, : self.view_blocks].clamp(min=0)  # [R, H, W]; -1 reads the null block
        B, H, W = blocks.shape
        ids = blocks.flatten()  # index_select: 5x faster than advanced indexing on CPU
        keys = self.pool.k.index_select(0, ids).view(B, H, W * self.block_size, -1)
        values = self.pool.v.index_select(0, ids).view(B, H, W * self.block_size, -1)
        return keys, values, self.pool.pos.index_select(0, ids).view(B, H, W * self.block_size)

    def observe(self, layer: int, probs: Tensor) -> None:
        """Add the step's attention (probs [R, H_kv, group, T, W x block]) into the metrics of the viewed slots."""
        slots = self._slot_ids(self.table[layer, : probs.shape[0], :, : self.view_blocks])
        self.pool.metric.view(-1).index_add_(0, slots.flatten(), self._metric(probs).flatten())

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
        needed = torch.arange(self.max_blocks, device=k.device) < ((n + self.block_size - 1) // self.block_size)[:, None, None]
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

    def write_chunk(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
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

    def _append_chunk(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write a chunk's real KVs (k, v [B, H, N, D]) after each head's, allocating the blocks they need."""
        B, H, N, D = k.shape
        n, m = self.length[layer], (input_pos >= 0).sum(dim=-1)[:, None]  # [B, H], [B, 1]
        table = self.table[layer]
        have, need = (table >= 0).sum(dim=-1), (n + m + self.block_size - 1) // self.block_size
        index = torch.arange(self.max_blocks, device=k.device)
        fresh = (index >= have[..., None]) & (index < need[..., None])
        table[fresh] = self.pool.allocate(int(fresh.sum()))
        slots = self._slot_ids(table).gather(2, (n[..., None] + torch.arange(N, device=k.device)).clamp(max=self.max_blocks * self.block_size - 1))
        filled = (input_pos >= 0)[:, None, :].expand(B, H, N)
        self.pool.k.view(-1, D)[slots[filled]] = k[filled]
        self.pool.v.view(-1, D)[slots[filled]] = v[filled]
        self.pool.pos.view(-1)[slots[filled]] = input_pos[:, None, :].expand(B, H, N)[filled]
        self.length[layer] += m
        self.view_blocks = view_width(int(self._blocks_held().max()), self.max_blocks)

    def _chunk_metric(self, key_pos: Tensor, keys: Tensor, input_pos: Tensor, q: Tensor) -> Tensor:
        """[B, H_kv, S]: the prompt metric of the viewed KVs (key_pos [B, H_kv, S]) from a chunk's queries q [B, H, N, D]."""
        if not self.full:
            return pool_keys(self._metric(chunk_attention(key_pos, keys, input_pos, q, self.window)), self.kernel)
        observed = last_real_queries(input_pos, input_pos.shape[1])[1]
        near = observed[:, None, None, :, None] - key_pos[:, :, None, None, :] < self.skip
        return self._metric(chunk_attention(key_pos, keys, input_pos, q, None).masked_fill(near, 0.0))

    def _metric(self, probs: Tensor) -> Tensor:
        """[B, H_kv, group, t, S] probabilities -> [B, H_kv, S]: summed (squared, for KV-Compress) over queries and the group."""
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

    def _track_owners(self) -> None:
        """After the host changed block tables: each slot's (layer, row, head), for FlexAttention's mask (`block_mask`)."""
        if self.attention != "flex":
            return
        held = self.table >= 0
        owner = torch.full((self.pool.n_blocks + 1,), -1, dtype=torch.long, device=self.table.device)
        owner[self.table[held]] = torch.arange(held.numel() // held.shape[-1], device=held.device).repeat_interleave(held.shape[-1])[held.flatten()]
        owner = owner.repeat_interleave(self.block_size)
        if owner.shape == self.owner.shape:  # in place: a CUDA graph keeps reading the same buffer
            self.owner.copy_(owner)
            return
        self.owner = owner
        for pooled in (self.pool.k, self.pool.v, self.pool.pos, self.owner):  # a resized pool recompiles the step at its new size: with
            torch._dynamo.mark_static(pooled)  # the KV length symbolic, Inductor's CPU flex kernel emits C++ that does not compile (torch 2.13)

    def compress_row(self, row: int) -> int:
        """Evict the lowest-scoring chunks of sequence `row` until its blocks fit its budget; compact the
        survivors and free the emptied blocks. Returns the number of blocks freed."""
        bs, L = self.block_size, self.n_layer
        table = self.table[:, row]  # [L, H, M]
        n = self.length[:, row]  # [L, H]
        before = self._blocks_held()[:, row]
        held = (n + bs - 1) // bs  # blocks holding KVs (make_room's empty block for the next token does not count)
        every_held = parallel.gather_heads(held)  # under tensor parallelism, every rank's heads compete as in one process
        H = every_held.shape[1]
        if self.scope == "layer":  # each layer's blocks within its own budget
            over = every_held.sum(dim=-1) - self.budget[row] * H // bs
        else:
            over = (every_held.sum() - self.budget[row].sum() * H // bs).view(1)
        if int(over.clamp(min=0).sum()) == 0:
            return 0
        slots = self._slot_ids(table)  # [L, H, S]
        pos = self.pool.pos.view(-1)[slots].masked_fill(torch.arange(slots.shape[-1], device=n.device) >= n[..., None], -1)
        metric = self.pool.metric.view(-1)[slots]
        key = metric.masked_fill(pos > self.last_pos[row] - self.protect, float("inf")).masked_fill(pos < 0, float("inf"))
        if self.head_floor > 0:  # Ada-KV's safeguard: every head keeps its best floor x (its layer's per-head budget) KVs
            floor = (self.head_floor * self.budget[row]).ceil().long()[:, None, None]
            key = key.masked_fill(metric.masked_fill(pos < 0, float("-inf")).argsort(dim=-1, descending=True).argsort(dim=-1) < floor, float("inf"))
        ascending, order = key.sort(dim=-1, stable=True)
        first = n - (held - 1) * bs  # the first chunk's size (1..bs): evicting it frees a whole block
        chunk = torch.arange(self.max_blocks, device=n.device)
        ends = first[..., None] + chunk * bs  # [L, H, M]
        score = ascending.gather(-1, (ends - 1).clamp(0, slots.shape[-1] - 1)).masked_fill(chunk >= held[..., None], float("inf"))
        every_score = parallel.gather_heads(score)
        groups = every_score.view(L, -1) if self.scope == "layer" else every_score.view(1, -1)  # chunks competing for one budget
        rank = groups.argsort(dim=-1, stable=True).argsort(dim=-1)
        evicted = parallel.local_heads(((rank < over[:, None]) & groups.isfinite()).view(L, H, -1).sum(dim=-1))  # chunks per head, lowest first
        dropped = torch.where(evicted > 0, first + (evicted - 1) * bs, 0)
        keep = torch.zeros_like(pos, dtype=torch.bool).scatter_(-1, order, torch.arange(slots.shape[-1], device=n.device) >= dropped[..., None])
        changed = dropped > 0  # only these heads move anything
        self._compact(row, changed, slots[changed], keep[changed] & (pos[changed] >= 0))
        freed = int((before - self._blocks_held()[:, row]).sum())
        self.counts["kvcompress: compressions"] += 1
        self.counts["kvcompress: blocks freed"] += freed
        return freed

    def _compact(self, row: int, heads: Tensor, slots: Tensor, keep: Tensor) -> None:
        """Move the kept KVs (keep [N, S]) of a sequence's chosen heads (heads [L, H] mask, their slots
        [N, S]) to the front of their slots, in their old order, and free the blocks left empty."""
        D = self.pool.k.shape[-1]
        survivors_first = slots.gather(-1, (~keep).to(torch.int8).argsort(dim=-1, stable=True))
        kept = keep.sum(dim=-1)  # [N]
        beyond = torch.arange(slots.shape[-1], device=slots.device) >= kept[..., None]
        k, v = self.pool.k.view(-1, D)[survivors_first], self.pool.v.view(-1, D)[survivors_first]
        pos = self.pool.pos.view(-1)[survivors_first].masked_fill(beyond, -1)
        metric = self.pool.metric.view(-1)[survivors_first].masked_fill(beyond, 0.0)
        table = self.table[:, row][heads]  # [N, M]
        real = table.repeat_interleave(self.block_size, dim=-1) >= 0  # slots of the null block are not written
        self.pool.k.view(-1, D)[slots[real]] = k[real]
        self.pool.v.view(-1, D)[slots[real]] = v[real]
        self.pool.pos.view(-1)[slots[real]] = pos[real]
        self.pool.metric.view(-1)[slots[real]] = metric[real]
        self.length[:, row][heads] = kept
        emptied = (torch.arange(self.max_blocks, device=slots.device) >= ((kept + self.block_size - 1) // self.block_size)[..., None]) & (table >= 0)
        self.pool.release(table[emptied])
        self.table[:, row][heads] = table.masked_fill(emptied, -1)

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
            unevictable = int((H * ((self.protect + floor + 2 * bs - 2) // bs)).sum())  # per head: ceil((protected + bs - 1) / bs)
            kept += min(L * H * self.max_blocks, max(int(budget.sum()) * every // bs, unevictable) + L * H)
        return min(self.full_pool, max(transient, kept))

    def release_all(self) -> None:
        """Free every row's blocks."""
        for row in range(self.table.shape[1]):
            self.release_row(row)

    def release_row(self, row: int) -> None:
        """A finished sequence: free all its blocks."""
        self._release(self.table[:, row])
        self.table[:, row] = -1
        self.length[:, row] = 0
        self.active[row] = False
        self.last_pos[row] = -1
        self._track_owners()

    def _release(self, table: Tensor) -> None:
        self.pool.release(table[table >= 0])

    def _blocks_held(self) -> Tensor:
        return (self.table >= 0).sum(dim=-1)

    def _slot_ids(self, table: Tensor) -> Tensor:
        """[..., M] block ids -> [..., M x block] flat slot ids (unused entries point into the null block)."""
        return (table.clamp(min=0)[..., None] * self.block_size + torch.arange(self.block_size, device=table.device)).flatten(-2)

    def blocks_in_use(self) -> int:
        return int(self._blocks_held().sum())

    def reset(self) -> None:
        self.pool.reset()
        self.table.fill_(-1)
        self.length.zero_()
        self.last_pos.fill_(-1)
        self.active.zero_()
        self.prefill_rows = None
        self.view_blocks, self.steps = view_width(0, self.max_blocks), 0
        self.counts = dict.fromkeys(self.counts, 0)

"""Block tables over one `BlockPool`: where each (layer, sequence, KV head)'s KVs live in a paged cache.

A head's tokens fill its table's slots 0 .. length-1 (compaction keeps them a prefix); -1 in a table
is an unused entry, read as the pool's null block. This is storage only: writing a step's or a chunk's
KVs, gathering a static-shape view for attention (or FlexAttention's block mask over the pool),
compacting the survivors of an eviction and freeing blocks. What to evict is `PagedKV`'s (paged.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from kvlab.memory import check_fits
from kvlab.pool import BlockPool

VIEW_ROUND = 8  # the attention view is VIEW_ROUND x a power of two blocks (capped): O(log) shapes for a compiled step


def view_width(most: int, max_blocks: int) -> int:
    """Blocks per head the attention view gathers when the largest head holds `most`: the smallest
    VIEW_ROUND x 2^k that fits, capped at `max_blocks`, so a compiled decode step sees at most
    1 + ceil(log2(max_blocks / VIEW_ROUND)) widths however the heads grow."""
    width = VIEW_ROUND
    while width < most:
        width *= 2
    return min(max_blocks, width)


class BlockTables(nn.Module):
    """Block tables and per-head lengths of `n_layer` layers x `batch_size` sequences x `n_kv_heads`
    over one `BlockPool` of `pool_blocks` blocks (None: sized later, `auto_pool`), with each sequence's
    last position and whether it is decoding. `prefill_rows` says which batch rows a prefill of fewer
    rows writes (a server admits one sequence at a time into a running batch)."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None,
        history: int,
        block_size: int,
        pool_blocks: int | None,
        attention: str,
    ) -> None:
        super().__init__()
        self.n_layer, self.block_size, self.attention = n_layer, block_size, attention
        self.max_blocks = math.ceil(history / block_size)  # per head: a head never holds more than the sequence
        self.full_pool = n_layer * batch_size * n_kv_heads * self.max_blocks  # every sequence uncompressed
        self.auto_pool = pool_blocks is None
        if pool_blocks is not None:
            check_fits(
                "kvc_pool_blocks",
                pool_blocks,
                BlockPool.block_footprint(block_size, head_dim, dtype),
                torch.device(device or "cpu"),
            )
        self.pool = BlockPool(0 if pool_blocks is None else pool_blocks, block_size, head_dim, dtype, device)
        L, B, H = n_layer, batch_size, n_kv_heads
        self.register_buffer(
            "table", torch.full((L, B, H, self.max_blocks), -1, dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer("length", torch.zeros(L, B, H, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("last_pos", torch.full((B,), -1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("active", torch.zeros(B, dtype=torch.bool, device=device), persistent=False)
        # (layer, row, head) holding each slot's block, for FlexAttention's mask function; kept up to date host-side
        # (`_track_owners`): built inside a compiled step, or read per block (owner[kv // block]), it broke
        # Inductor's CPU flex kernel (torch 2.13: wrong values, then C++ that did not compile)
        self.register_buffer(
            "owner",
            torch.full(((self.pool.n_blocks + 1) * block_size,), -1, dtype=torch.long, device=device),
            persistent=False,
        )
        self.prefill_rows: Tensor | None = None
        # blocks per head the attention view gathers (host-side: see view_width)
        self.view_blocks = view_width(0, self.max_blocks)

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
        block = self.table[layer, :R].gather(2, (n // self.block_size).clamp(max=self.max_blocks - 1)[..., None])[
            ..., 0
        ]
        block = torch.where(writes & (block >= 0), block, 0)
        offset = n % self.block_size
        # an idle row's k, v may be NaN (it attends nothing); the null block must stay finite
        self.pool.k[block, offset] = torch.where(writes[..., None], k[:, :, 0], 0.0)
        self.pool.v[block, offset] = torch.where(writes[..., None], v[:, :, 0], 0.0)
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

    def _append_chunk(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write a chunk's real KVs (k, v [B, H, N, D]) after each head's, allocating the blocks they need."""
        B, H, N, D = k.shape
        n, m = self.length[layer], (input_pos >= 0).sum(dim=-1)[:, None]  # [B, H], [B, 1]
        table = self.table[layer]
        have, need = (table >= 0).sum(dim=-1), (n + m + self.block_size - 1) // self.block_size
        index = torch.arange(self.max_blocks, device=k.device)
        fresh = (index >= have[..., None]) & (index < need[..., None])
        table[fresh] = self.pool.allocate(int(fresh.sum()))
        slots = self._slot_ids(table).gather(
            2, (n[..., None] + torch.arange(N, device=k.device)).clamp(max=self.max_blocks * self.block_size - 1)
        )
        filled = (input_pos >= 0)[:, None, :].expand(B, H, N)
        self.pool.k.view(-1, D)[slots[filled]] = k[filled]
        self.pool.v.view(-1, D)[slots[filled]] = v[filled]
        self.pool.pos.view(-1)[slots[filled]] = input_pos[:, None, :].expand(B, H, N)[filled]
        self.length[layer] += m
        self.view_blocks = view_width(int(self._blocks_held().max()), self.max_blocks)

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
        emptied = (
            torch.arange(self.max_blocks, device=slots.device)
            >= ((kept + self.block_size - 1) // self.block_size)[..., None]
        ) & (table >= 0)
        self.pool.release(table[emptied])
        self.table[:, row][heads] = table.masked_fill(emptied, -1)

    def _track_owners(self) -> None:
        """After the host changed block tables: each slot's (layer, row, head), for FlexAttention's mask
        (`block_mask`)."""
        if self.attention != "flex":
            return
        held = self.table >= 0
        owner = torch.full((self.pool.n_blocks + 1,), -1, dtype=torch.long, device=self.table.device)
        owner[self.table[held]] = torch.arange(held.numel() // held.shape[-1], device=held.device).repeat_interleave(
            held.shape[-1]
        )[held.flatten()]
        owner = owner.repeat_interleave(self.block_size)
        if owner.shape == self.owner.shape:  # in place: a CUDA graph keeps reading the same buffer
            self.owner.copy_(owner)
            return
        self.owner = owner
        # a resized pool recompiles the step at its new size: with the KV length symbolic, Inductor's CPU flex kernel
        # emits C++ that does not compile (torch 2.13)
        for pooled in (self.pool.k, self.pool.v, self.pool.pos, self.owner):
            torch._dynamo.mark_static(pooled)

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
        return (
            table.clamp(min=0)[..., None] * self.block_size + torch.arange(self.block_size, device=table.device)
        ).flatten(-2)

    def blocks_in_use(self) -> int:
        return int(self._blocks_held().sum())

    def reset(self) -> None:
        self.pool.reset()
        self.table.fill_(-1)
        self.length.zero_()
        self.last_pos.fill_(-1)
        self.active.zero_()
        self.prefill_rows = None
        self.view_blocks = view_width(0, self.max_blocks)

"""The block pool of the paged cache: fixed-size blocks of keys, values, positions and metrics, handed
out and taken back by id. A block belongs to one (sequence, layer, KV head) at a time (paged.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.memory import free_memory


class PoolExhausted(ValueError):
    """The block pool cannot hold the next step's KVs even after compressing every sequence to its budget
    (a ValueError: a pool too small for the run is a setting to change; the CLIs report it in one line)."""


class BlockPool(nn.Module):
    """`n_blocks` blocks of `block_size` slots (keys, values, positions, metrics). Block 0 is the null
    block: never handed out, it is what an unused table entry (-1) reads (its positions stay -1, so it
    is masked) and where rows without a token this step write."""

    def __init__(
        self, n_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self._allocate(n_blocks, block_size, head_dim, dtype, device)

    @staticmethod
    def block_footprint(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes in memory: its keys and values, and its slots' positions (int64) and metrics
        (float32)."""
        return block_size * (2 * head_dim * dtype.itemsize + 8 + 4) + 1  # + its in-use flag

    def _allocate(
        self, n_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        shape = (n_blocks + 1, block_size)
        self.register_buffer("k", torch.zeros(*shape, head_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(*shape, head_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("pos", torch.full(shape, -1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("metric", torch.zeros(shape, device=device), persistent=False)
        self.register_buffer("in_use", torch.zeros(n_blocks + 1, dtype=torch.bool, device=device), persistent=False)
        self.in_use[0] = True

    @property
    def n_blocks(self) -> int:
        return self.in_use.numel() - 1

    def resize(self, n_blocks: int) -> None:
        """Reallocate the (empty) pool with `n_blocks` blocks; nothing is kept. A no-op (but a reset) at the same
        size."""
        if n_blocks == self.n_blocks:
            self.reset()
            return
        self._check_fits(n_blocks)
        k = self.k
        self._allocate(n_blocks, k.shape[1], k.shape[2], k.dtype, k.device)

    def grow(self, n_blocks: int) -> None:
        """Add free blocks up to `n_blocks`, keeping every block's contents and id (a chunked prefill's pool grows
        to the budgets + one chunk)."""
        self._check_fits(n_blocks)
        extra = n_blocks - self.n_blocks
        for name, fill in (("k", 0), ("v", 0), ("pos", -1), ("metric", 0), ("in_use", False)):
            held = getattr(self, name)
            setattr(self, name, torch.cat([held, held.new_full((extra, *held.shape[1:]), fill)]))

    def _check_fits(self, n_blocks: int) -> None:
        """Refuse, before allocating, to grow to `n_blocks` where the new blocks need more memory than the device
        has free (a pool sized for a batch: huge blocks, or many rows, would meet the allocator's own error or
        the kernel's OOM killer)."""
        k = self.k
        footprint = self.block_footprint(k.shape[1], k.shape[2], k.dtype)
        extra, free = (n_blocks - self.n_blocks) * footprint, free_memory(k.device)
        if extra > free:
            fits = self.n_blocks + free // footprint
            raise ValueError(
                f"kvcompress: the pool needs {n_blocks} blocks of {k.shape[1]} slots (--kvc_block_size), about "
                f"{extra / 2**30:.1f} GiB more than it holds, and {free / 2**30:.1f} GiB are free here; lower "
                f"--kvc_block_size or --batch_size, or set --kvc_pool_blocks (at most {fits} blocks of this "
                "size fit)"
            )

    def allocated_bytes(self) -> int:
        """Keys and values of every block the pool holds (the null block aside): the KV memory it allocated."""
        return self.n_blocks * self.block_bytes()

    def free_blocks(self) -> int:
        return int((~self.in_use).sum())

    def allocate(self, n: int) -> Tensor:
        """Ids of n free blocks, now in use."""
        ids = (~self.in_use).nonzero().flatten()[:n]
        if ids.numel() < n:
            at_least = self.n_blocks - ids.numel() + n
            raise PoolExhausted(
                f"kvcompress: the pool has {ids.numel()} free blocks of {self.n_blocks}, {n} needed; raise "
                f"--kvc_pool_blocks to at least {at_least} (more for the tokens still to come), compress more, "
                "or leave it unset to size the pool from the budgets"
            )
        self.in_use[ids] = True
        return ids

    def release(self, ids: Tensor) -> None:
        self.in_use[ids] = False
        self.pos[ids] = -1
        self.metric[ids] = 0.0

    def reset(self) -> None:
        self.in_use.zero_()
        self.in_use[0] = True
        self.pos.fill_(-1)
        self.metric.zero_()

    def block_bytes(self) -> int:
        """Keys and values of one block (positions and metrics are bookkeeping, as in any paged server)."""
        return 2 * self.k[0].nbytes

"""KV-Compress as a cache strategy (`kvcompress`): each layer's view of the shared paged pool (`PagedKV`, paged.py),
with the kvc_* settings."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.cache import KVCache, refuse_decode_room
from kvlab.options import by_name, choice, fraction, integer, switch
from kvlab.paged import KVC_ATTENTION, KVC_METRICS, KVC_SCOPES, PagedKV


class KVCompressCache(KVCache):
    """One layer's view of a shared `PagedKV` (built for all layers together by `make_caches`)."""

    positions_per_head = True
    needs_attention = True  # continual compression learns from decode attention (off with kvc_compress_every=0)
    shares_pool = True
    default_recent_window = 8  # the protected window, for layer budget planners' floors
    options = (
        integer(
            "kvc_block_size",
            16,
            "kvcompress: KVs per block of one (layer, KV head); eviction frees whole blocks",
            param="block_size",
        ),
        integer(
            "kvc_pool_blocks",
            None,
            "kvcompress: blocks in the pool shared by all layers, heads and sequences, i.e. the KV memory",
            default_help="sized at each prefill for the batch's budgets and prompts (serving: every sequence "
            "uncompressed)",
            # the memory, not this bound, limits it: a pool over the free memory is refused before allocating
            maximum=2**31 - 1,
            param="pool_blocks",
        ),
        integer(
            "kvc_window",
            8,
            "kvcompress (KVC-w): last prompt queries whose squared attention scores the prompt",
            param="window",
        ),
        integer(
            "kvc_kernel", 7, "kvcompress (KVC-w): max-pooling kernel over the prompt metric", odd=True, param="kernel"
        ),
        switch(
            "kvc_full",
            "kvcompress (KVC-full): score the prompt with every prompt query instead of the last kvc_window",
            param="full",
        ),
        integer(
            "kvc_skip",
            10,
            "kvcompress (KVC-full): leave out query-key pairs closer than this many positions",
            minimum=0,
            param="skip",
        ),
        integer(
            "kvc_protect",
            None,
            "kvcompress: newest tokens never evicted",
            minimum=0,
            default_help="kvc_window; 32 with kvc_full",
            param="protect",
        ),
        choice(
            "kvc_metric",
            KVC_METRICS,
            "squared",
            "kvcompress: sum squared attention probabilities (KV-Compress) or the probabilities (l1)",
            param="metric",
        ),
        choice(
            "kvc_scope",
            KVC_SCOPES,
            "model",
            "kvcompress: one budget over all layers and heads of a sequence (model: KV-Compress) or one per "
            "layer shared by its heads (layer: Ada-KV)",
            param="scope",
        ),
        fraction(
            "kvc_head_floor",
            0.0,
            "kvcompress: every head keeps its best KVs up to this share of its layer's per-head budget "
            "(Ada-KV's floor)",
            closed=True,
            param="head_floor",
        ),
        integer(
            "kvc_compress_every",
            1,
            "kvcompress: compress again every N decode steps with the accumulated decode attention; 0: at prefill only",
            minimum=0,
            param="compress_every",
        ),
        choice(
            "kvc_attention",
            KVC_ATTENTION,
            "gather",
            "kvcompress: decode attention over each head's blocks read in place by kvlab's native paged kernel on "
            "the CPU (elsewhere over a gathered view), or FlexAttention straight over the pool from the block "
            "tables (flex: needs kvc_compress_every 0; bench/results/paged_attention_cpu.md)",
            param="attention",
        ),
    )

    def __init__(self, paged: PagedKV, layer: int) -> None:
        nn.Module.__init__(self)  # no dense storage: the pool holds the KVs
        self.paged, self.layer = paged, layer
        self.capacity = paged.max_blocks * paged.block_size
        self.needs_attention = paged.continual
        # the pool attends itself (adding its metric) where it reads the blocks in place: flex, or the native kernel
        self.attends_itself = paged.attention == "flex" or paged.pool.k.device.type == "cpu"

    @classmethod
    def for_layers(
        cls,
        n_layer: int,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        history: int | None = None,
        **options,
    ) -> list[KVCompressCache]:
        """Caches for `n_layer` layers sharing one pool; options are the kvc_* settings by flag name,
        `history` the longest sequence (default `capacity`)."""
        declared = by_name(cls.options)
        paged = PagedKV(
            n_layer,
            batch_size,
            n_kv_heads,
            head_dim,
            dtype,
            device,
            history or capacity,
            **{declared[k].keyword: v for k, v in options.items()},
        )
        return [cls(paged, layer) for layer in range(n_layer)]

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        self.paged.write_prompt(self.layer, input_pos, k, v, q)

    def prefill_chunk(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
    ) -> Tensor:
        return self.paged.write_chunk(self.layer, input_pos, k, v, q, attend)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.paged.append(self.layer, input_pos, k, v)

    def attend(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        return self.paged.attend(self.layer, input_pos, k, v, q)

    def observe(self, probs: Tensor) -> None:
        self.paged.observe(self.layer, probs)

    def maintain(self) -> None:
        if self.layer == 0:  # once per step for the whole pool
            self.paged.maintain()

    def limit_rows(self, capacities: Tensor, decode_room: Tensor | None = None) -> None:
        refuse_decode_room(self, decode_room)
        if int(capacities.min()) < 1:
            raise ValueError(f"kvcompress: per-sequence budgets must be >= 1 token per head; got {capacities.tolist()}")
        self.paged.budget[:, self.layer] = capacities

    def tokens_held(self) -> Tensor:
        return self.paged.length[self.layer].float().mean(dim=-1)

    def head_budgets(self) -> Tensor:
        return self.paged.length[self.layer]

    def stats(self) -> dict[str, int]:
        if self.layer != 0:
            return {}
        paged = self.paged
        return {
            **paged.counts,
            "kvcompress: blocks in use": paged.blocks_in_use(),
            "kvcompress: pool blocks": paged.pool.n_blocks,
            "kvcompress: bytes in use": paged.blocks_in_use() * paged.pool.block_bytes(),
        }

    def reset(self) -> None:
        self.paged.reset()

    def nbytes(self) -> int:
        """The KV bytes the shared pool allocated, counted once (on layer 0); the bytes of the blocks in
        use are `stats()["kvcompress: bytes in use"]`."""
        return self.paged.pool.allocated_bytes() if self.layer == 0 else 0

"""Storage sized by what each head keeps: an evicting cache's keys and values in a dense [B, H_kv, C, D] buffer while
the prompt is stored, then, once prefill has chosen each (sequence, KV head)'s budget, each head's slots packed one
after another into [N + 1, D] rows (`compact`), N the sum of the budgets. Head (b, h) holds `lengths[b, h]` slots
from row `offsets[b, h]`; its slot s < lengths[b, h] is row offsets[b, h] + s, and a slot past its budget (which
the cache never fills: its position stays -1, so attention masks it) reads and writes the last row, a scratch row.

Uneven budgets (Ada-KV's split of a layer, KVzip's model-wide ranking, a layer budget under a compression ratio,
a batch of sequences of different lengths) then hold the bytes they keep, not the widest head's. Decode attention
reads the rows in place (`kvlab::attend_ragged`, the native CPU kernel, per head over its own length); without
it, and for strategies that score their slots while decoding, `read` gathers the dense view for the step.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from kvlab.options import choice
from kvlab.storage import KVStorage, make_storage

KV_STORES = ("compact", "dense")
KV_STORE_OPTION = choice(
    "kv_store",
    KV_STORES,
    "compact",
    "where budgets differ across heads or sequences (head_budget, layer budgets under a compression ratio, "
    "prompts of different lengths): after prefill each head's kept tokens move into rows sized by its budget, "
    "read in place by the native decode attention (compact; float caches: 8, 4 and 2-bit ones stay dense), or "
    "stay in buffers as wide as the widest head (dense, for comparison)",
)


class CompactKVStorage(KVStorage):
    """Keys and values stored in `store_dtype` (the model's, or float16), read in the model's `dtype`: nothing until the
    first write, dense until `compact`, packed per head after it, nothing again after a compacted store's `reset` (so
    layers replayed one after another from a recorded prefill, each compacted in turn, never hold every dense buffer
    at once)."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        store_dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__((*shape[:2], 0, shape[3]), store_dtype, device)
        self.shape, self.dtype, self.store_dtype = torch.Size(shape), dtype, store_dtype
        self.allocated = self.compacted = False  # Python state: a compiled step guards on it, never on a shape
        self.register_buffer("offsets", torch.zeros(shape[:2], dtype=torch.long, device=device), persistent=False)
        self.register_buffer(
            "lengths", torch.full(shape[:2], shape[2], dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer(
            "slots", torch.arange(shape[2], device=device), persistent=False
        )  # a size kept symbolic when compiled

    def dense(self) -> None:
        """The dense buffers, zeros, where nothing is allocated yet."""
        if self.allocated:
            return
        for name in ("k", "v"):
            buffer = torch.zeros(self.shape, dtype=self.store_dtype, device=self.k.device)
            setattr(self, name, buffer)
            mark_dynamic(buffer, 2)
        self.allocated = True

    def compact(self, lengths: Tensor) -> None:
        """Keep each head's first lengths[b, h] slots ([B, H_kv], the budgets prefill gave) in rows of their own and
        free the dense buffers; nothing changes where every head keeps all C slots (the dense form is as small)."""
        C = self.shape[2]
        if self.compacted or not self.allocated or bool((lengths >= C).all()):
            return
        lengths = lengths.clamp(0, C)
        offsets = lengths.flatten().cumsum(0).view_as(lengths) - lengths
        N = int(lengths.sum())
        slot = torch.arange(C, device=lengths.device)
        held = slot < lengths[..., None]  # [B, H, C]
        rows = (offsets[..., None] + slot)[held]
        for name in ("k", "v"):
            dense = getattr(self, name)
            packed = dense.new_zeros(N + 1, dense.shape[-1])
            packed[rows] = dense[held]
            setattr(self, name, packed)
            mark_dynamic(packed, 0)
        self.offsets.copy_(offsets)
        self.lengths.copy_(lengths)
        mark_dynamic(self.slots, 0)
        self.compacted = True

    def rows(self, slots: Tensor) -> Tensor:
        """Rows of slots [B, H_kv, N]: a slot past its head's budget reads and writes the scratch row."""
        inside = slots < self.lengths[..., None]
        return torch.where(inside, self.offsets[..., None] + slots, self.k.shape[0] - 1)

    def write(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        if not self.compacted:
            self.dense()
            KVStorage.write(
                self, slots, k.to(self.store_dtype), v.to(self.store_dtype), prompt
            )  # by name, not super(): see KVCache
            return
        rows = self.rows(slots).flatten()
        self.k.index_put_((rows,), k.flatten(0, 2).to(self.store_dtype))
        self.v.index_put_((rows,), v.flatten(0, 2).to(self.store_dtype))

    def read_for_attention(self) -> tuple[Tensor, Tensor]:
        if not self.compacted:
            self.dense()
            return self.k, self.v
        B, H = self.lengths.shape
        rows = self.rows(self.slots.expand(B, H, -1))
        k, v = self.k.index_select(0, rows.flatten()), self.v.index_select(0, rows.flatten())
        return k.view(*rows.shape, -1), v.view(*rows.shape, -1)

    def read(self) -> tuple[Tensor, Tensor]:
        k, v = self.read_for_attention()
        return k.to(self.dtype), v.to(self.dtype)

    def attend(self, q: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """A decode step's attention y [B, H, T, D] of q at query_pos [B, T] over every head's own slots (positions
        key_pos [B, H_kv, C]), read in place by the native kernel (compacted storage only)."""
        y = torch.ops.kvlab.attend_ragged(q.float(), self.k, self.v, key_pos, self.offsets, self.lengths, query_pos)
        return y.to(q.dtype)

    def nbytes(self) -> int:
        """Keys and values (a compacted store's scratch row included; before the first write, the dense form it will
        allocate); the offsets and lengths are bookkeeping."""
        return self.k.nbytes + self.v.nbytes if self.allocated else self.dense_nbytes()

    def dense_nbytes(self) -> int:
        """The keys and values of the dense form: every head as wide as the widest."""
        return 2 * self.shape[:3].numel() * self.shape[3] * self.store_dtype.itemsize

    def reset(self) -> None:
        """Compacted: back to nothing allocated (the next prompt's first write allocates the dense buffers again); else
        zeros in place, so a cache reused for another prompt keeps its buffers (a CUDA graph keeps their addresses)."""
        if not self.compacted:
            KVStorage.reset(self)
            return
        empty = (*self.shape[:2], 0, self.shape[3])
        for name in ("k", "v"):
            setattr(self, name, torch.zeros(empty, dtype=self.store_dtype, device=self.k.device))
        self.lengths.fill_(self.shape[2])
        self.offsets.zero_()
        self.allocated = self.compacted = False


def mark_dynamic(buffer: Tensor, dim: int) -> None:
    """A buffer allocated per prompt has its size on `dim` follow the prompt or the budgets, so one compiled decode
    step serves every prompt (as `build.mark_slots_dynamic` does for the dense slot axis); only once the compiler is
    loaded."""
    if "torch._dynamo" in sys.modules and buffer.shape[dim] >= 2:
        torch._dynamo.maybe_mark_dynamic(buffer, dim)


def make_kv_store(
    kv_store: str,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | None,
    bits: int | None,
    key_axis: str | None = None,
    key_pruning: float | None = None,
    think_window: int | None = None,
) -> KVStorage:
    """`make_storage`'s storage, compactable (`CompactKVStorage`) where `kv_store` is "compact" and the keys and values
    are stored as floats of every channel (the model's dtype, float32 or float16); packed integers and pruned keys
    stay dense."""
    if kv_store not in KV_STORES:
        raise ValueError(f"kv_store must be one of {', '.join(KV_STORES)}, got {kv_store!r}")
    floats = bits in (None, 16) or (bits == 32 and dtype == torch.float32)
    if kv_store == "dense" or not floats or key_axis is not None or key_pruning is not None or think_window is not None:
        return make_storage(shape, dtype, device, bits, key_axis, key_pruning, think_window)
    return CompactKVStorage(shape, dtype, torch.float16 if bits == 16 else dtype, device)

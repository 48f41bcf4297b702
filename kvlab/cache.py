"""What a cache strategy is. A cache is an `nn.Module` holding static-shape buffers for one layer;
the attention layer calls:

    prefill(input_pos, k, v, q)      once per prompt, after exact attention over the prompt: store
                                     (or compress) the prompt's keys/values.
    update(input_pos, k, v, q)       each decode step: insert the step's keys/values, return
                                     (keys, values, key_pos) to attend over. key_pos holds each
                                     slot's token position, -1 for an empty slot; it is [B, S] when
                                     shared by all KV heads or [B, H_kv, S] when heads keep
                                     different tokens ([B, H, S] with keys per query head). The
                                     causal mask is derived from it.
    prefill_chunk(input_pos, k, v, q, attend)
                                     a later chunk of a chunked prefill (the first goes through
                                     `prefill`): attend(keys, values, key_pos) over the held tokens and
                                     the chunk's own, then compress back to the budget; returns the
                                     attention output. Caches without it (`prefills_in_chunks` False)
                                     are prefilled whole after the last chunk (engine.py, chunked.py).
    observe(probs)                   only if `needs_attention`: the step's attention probabilities
                                     [B, H_kv, group, T, S], for strategies that learn from them.
    maintain()                       on the host after every decode step, outside the compiled step: upkeep
                                     on a schedule (ClusterKV clusters the newest tokens every m steps).
    compact()                        once the prompt is stored, before decoding: storage sized by what each
                                     head keeps (the evicting caches whose budgets differ across heads).
    limit_rows(capacities)           per-sequence slot limits [B] (a fraction of each sequence's own
                                     length, per KV head); caches that keep every token ignore them.

Shapes: input_pos [B, T] (position in its own sequence, -1 = padding); k, v [B, H_kv, T, D];
q [B, H, T, D]. Everything stays static-shape so the decode step compiles with `fullgraph=True`.
The evicting strategies build on `EvictionCache` (eviction.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.compact import make_kv_store
from kvlab.options import Option
from kvlab.storage import KEY_PRUNING_OPTIONS, STORAGE_OPTIONS


class KVCache(nn.Module):
    """The interface, and the capabilities the engine branches on (declared here, never duck-typed).

    Methods a compiled decode step runs (update, observe, a storage's write and read) call a base class's
    method by name, not through super(): for super() Dynamo guards the type's __mro__, and that guard keeps
    the step's whole guard tree from being skipped by dict tags (after a step, 0.9-1.1 -> 0.5 ms of checks)."""

    # observe() gets each step's attention probabilities (the slower explicit-softmax path)
    needs_attention: bool = False
    # prefill/update get the token ids as `tokens=`, and the cache the tokenizer's `token_classes`
    needs_tokens: bool = False
    # prefill gets each prompt query's attention log-sum-exp [B, H, T] as `lse=` (on CPU, where it is free)
    needs_prompt_lse: bool = False
    positions_per_head: bool = False  # True when KV heads keep different tokens: pos is [B, H_kv, S]
    takes_prompt_compressor: bool = False  # keeps the prompt tokens a `PromptCompressor` ranks highest
    keeps_history: bool = False  # recallable: holds every token (`history` slots) and attends `capacity` of them
    shares_pool: bool = False  # one object serves every layer (`for_layers`): a paged pool
    # decode attention comes from attend() (a kernel over its own storage), not update() + the model's
    attends_itself: bool = False
    per_layer: bool = False  # built with its model layer (`layer=`): heads calibrated per layer (DuoAttention)
    options: tuple[Option, ...] = STORAGE_OPTIONS
    default_global_tokens, default_recent_window = 0, 0  # protected tokens: a layer budget planner's floor
    default_cache_length = 0.5  # max_cache_length when none is given (a fraction of each sequence)

    @classmethod
    def protected_tokens(cls, options: dict[str, Any]) -> int:
        """Tokens this strategy never evicts, with these options (sinks + recent window)."""
        return options.get("global_tokens", cls.default_global_tokens) + options.get(
            "recent_window", cls.default_recent_window
        )

    @classmethod
    def min_slots(cls, options: dict[str, Any]) -> int:
        """The fewest slots per sequence that the cache accepts, with these options."""
        return 1

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        cache_bits: int | None = None,
        key_quant_axis: str | None = None,
        key_channel_pruning: float | None = None,
        think_window: int | None = None,
        kv_store: str = "dense",
    ) -> None:
        super().__init__()
        self.capacity = capacity
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        storage = (cache_bits, key_quant_axis, key_channel_pruning, think_window)
        self.storage = make_kv_store(kv_store, shape, dtype, device, *storage)
        pos_shape = (batch_size, n_kv_heads, capacity) if self.positions_per_head else (batch_size, capacity)
        self.register_buffer("pos", torch.full(pos_shape, -1, dtype=torch.long, device=device), persistent=False)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        raise NotImplementedError

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    @property
    def prefills_in_chunks(self) -> bool:
        """Whether it takes a chunked prefill's later chunks itself (`prefill_chunk`), holding at most its slots + the
        chunk."""
        return type(self).prefill_chunk is not KVCache.prefill_chunk

    def prefill_chunk(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
    ) -> Tensor:
        """A later chunk of a chunked prefill: its output [B, H, N, D] from `attend(keys, values, key_pos)` over the
        held tokens and its own, after which only the cache's own slots are held. Padding: position -1."""
        raise NotImplementedError

    def attend(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """Insert the step's keys/values and return its attention output [B, H, T, D]; only called when `attends_itself`
        is True."""
        raise NotImplementedError

    def observe(self, probs: Tensor) -> None:
        """Receive attention probabilities; only called when `needs_attention` is True."""

    def maintain(self) -> None:
        """Host-side upkeep after each decode step (most caches need none)."""

    def compact(self) -> None:
        """Once the prompt is stored, before decoding: move what each head keeps into storage sized by it (the
        evicting caches with uneven budgets: eviction.py); most caches hold what they keep already."""

    @property
    def upkept_between_steps(self) -> bool:
        """Whether `maintain` works between decode steps: it may change the tensors or Python state a compiled
        step reads, so the engine does not replay the step's graph (`CompiledStep.replaying`)."""
        return type(self).maintain is not KVCache.maintain

    def limit_rows(self, capacities: Tensor, decode_room: Tensor | None = None) -> None:
        """Slots each sequence may fill, [B] (<= capacity); only caches that evict use it. `decode_room`
        [B]: of those, the slots left empty at prefill for the tokens decoded after it (kvpress's
        compression ratio keeps every later token); by default the prompt may fill them all."""

    def stats(self) -> dict[str, int]:
        """Counts worth reporting at the end of a run (e.g. hybrid's heads per policy)."""
        return {}

    def head_budgets(self) -> Tensor | None:
        """[B, H_kv] slots each sequence's KV heads may fill, or None where every token is kept."""
        return None

    def tokens_held(self) -> Tensor:
        """[B] tokens each sequence holds now, per KV head (mean over heads)."""
        filled = (self.pos >= 0).flatten(1).sum(dim=1)
        return filled / (self.pos.shape[1] if self.positions_per_head else 1)

    def reset(self) -> None:
        self.storage.reset()
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values (the number a compression strategy shrinks)."""
        return self.storage.nbytes()


def refuse_decode_room(cache: KVCache, decode_room: Tensor | None) -> None:
    """Caches that do not keep the prompt by a compressor's ranking cannot hold back decode room."""
    if decode_room is not None:
        raise ValueError(
            f"{type(cache).__name__} cannot keep room for decoded tokens: compression_ratio applies to the "
            "evicting strategies only"
        )


class FullCache(KVCache):
    """No compression: token at position p lives in slot p. The reference every strategy is measured against."""

    options = (*KVCache.options, *KEY_PRUNING_OPTIONS)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        T = k.shape[2]
        if T > self.capacity:
            raise ValueError(f"prompt of {T} tokens does not fit a full cache of {self.capacity} slots")
        B, H = k.shape[:2]
        self.storage.observe_prompt(input_pos, k, q)
        self.storage.write(torch.arange(T, device=k.device).expand(B, H, T), k, v, prompt=True)
        self.pos[:, :T] = input_pos

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.storage.write(input_pos[:, None, :].expand(k.shape[:3]), k, v)
        self.pos.scatter_(1, input_pos, input_pos)
        return *self.storage.read_for_attention(), self.pos

    def prefill_chunk(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
    ) -> Tensor:
        """Stored at their positions, as decoded tokens are; padding goes to the last slot, which no prompt token
        reaches (the context keeps room for a generated token), and stays marked empty. Eager, the chunk attends over
        the slots filled so far only (every later slot is empty): a long prompt's chunks then cost what its causal
        attention does, not chunks x capacity; compiled, over every slot, in one static shape."""
        slots = torch.where(input_pos >= 0, input_pos, self.capacity - 1)
        self.storage.write(slots[:, None, :].expand(k.shape[:3]), k, v)
        self.pos.scatter_(1, slots, input_pos)
        keys, values = self.storage.read()
        if torch.compiler.is_compiling():
            return attend(keys, values, self.pos)
        filled, start = int(input_pos.max()) + 1, int(input_pos.masked_fill(input_pos < 0, self.capacity).min())
        # every row's chunk starts at `start`
        aligned = start < self.capacity and bool((input_pos[:, 0] == start).all())
        held = {"own_from": start} if aligned else {}
        return attend(keys[:, :, :filled], values[:, :, :filled], self.pos[:, :filled], **held)


@contextmanager
def unchanged_where_idle(cache: KVCache, input_pos: Tensor) -> Iterator[None]:
    """Every per-sequence buffer of `cache` (its batch on dim 0) is put back, after the block, in the sequences
    with no real token in input_pos [B, N]: their prompt has ended, and a chunk of padding changes nothing."""
    idle = (input_pos < 0).all(dim=1)
    batch = input_pos.shape[0]
    saved = {name: b.clone() for name, b in cache.named_buffers() if b.dim() and b.shape[0] == batch}
    yield
    for name, b in cache.named_buffers():
        if name in saved and b.shape == saved[name].shape:
            b.copy_(torch.where(idle.view(-1, *[1] * (b.dim() - 1)), saved[name], b))

"""DuoAttention (Xiao et al., 2024, arXiv 2410.10819): a few KV heads retrieve (they keep every token),
the rest stream (attention sinks + a recent window). Which heads retrieve is calibrated once per
checkpoint: a gate per KV head mixes full and streaming attention, and is optimised on synthetic
passkey retrieval so that the mixed model's hidden states match the full model's, with an L1 push
towards streaming (`calibrate`, run by scripts/calibrate_duo.py, which writes the gates file)."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from kvlab import parallel
from kvlab.cache import KVCache
from kvlab.eviction import PROTECTED_OPTIONS
from kvlab.model import Transformer
from kvlab.options import Option, fraction, switch
from kvlab.storage import make_storage

GATES_FILE = "duo_attention.json"  # beside the checkpoint it was calibrated for
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def read_gates(path: str | Path) -> Tensor:
    """[n_layer, H_kv] gates from a file `calibrate` wrote; a clear error for anything else. A relative path
    not found from the working directory is looked up from the project root (the shipped configs/duo/)."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (PROJECT_ROOT / path).is_file():
        path = PROJECT_ROOT / path
    if not path.is_file():
        raise ValueError(
            f"--duo_gates {path}: no such file; calibrate the checkpoint once with: python "
            "scripts/calibrate_duo.py --checkpoint_path DIR"
        )
    try:
        gates = torch.tensor(json.loads(path.read_text())["gates"], dtype=torch.float32)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--duo_gates {path} is not a gates file written by scripts/calibrate_duo.py ({e})") from None
    if gates.dim() != 2:
        raise ValueError(f"--duo_gates {path}: gates must be [layers][KV heads], got shape {list(gates.shape)}")
    return gates


def with_default_gates(settings: dict[str, Any], checkpoint_dir: Path, model_name: str) -> dict[str, Any]:
    """Settings whose duo_attention layers have no --duo_gates get the gates calibrated for this checkpoint:
    beside it (scripts/calibrate_duo.py's default) or shipped in configs/duo/, with one line saying which."""
    strategies = settings.get("cache_strategy")
    if (
        "duo_attention" not in (strategies if isinstance(strategies, list) else [strategies])
        or settings.get("duo_gates") is not None
    ):
        return settings
    for path in (Path(checkpoint_dir) / GATES_FILE, PROJECT_ROOT / "configs" / "duo" / f"{model_name}.json"):
        if path.is_file():
            print(f"duo_attention: the gates calibrated for {model_name} ({path.name})", file=sys.stderr)
            return {**settings, "duo_gates": str(path)}
    return settings


def retrieval_heads(gates: Tensor, share: float) -> Tensor:
    """[n_layer, H_kv] True for the `share` of all KV heads with the highest gates (the retrieval heads)."""
    order = gates.flatten().argsort(descending=True, stable=True)
    chosen = torch.zeros(gates.numel(), dtype=torch.bool)
    chosen[order[: round(share * gates.numel())]] = True
    return chosen.view_as(gates)


class DuoAttentionCache(KVCache):
    """Retrieval heads hold the whole sequence. Streaming heads hold the first `global_tokens` (sinks), the
    prompt's newest `recent_window` tokens and every token after the prompt, as kvpress's DuoAttentionPress
    masks them; with `duo_ring`, the sinks and the newest `recent_window` tokens in a ring, the oldest evicted
    for each decoded one, in a buffer of that size (the paper's constant-size streaming heads: real bytes
    saved). Each decode step lays both out as one [B, H_kv, S, D] view for attention (a transient, one layer at
    a time)."""

    positions_per_head = True
    per_layer = True
    default_global_tokens, default_recent_window = 64, 256  # the paper's
    default_cache_length = 1.0  # retrieval heads keep every token
    options = (
        *KVCache.options,
        *PROTECTED_OPTIONS,
        Option(
            "duo_gates",
            (str,),
            "a path",
            "duo_attention: the gates file scripts/calibrate_duo.py wrote for this checkpoint (required)",
        ),
        fraction(
            "duo_retrieval",
            0.5,
            "duo_attention: share of the model's KV heads, highest gates first, that keep every token",
        ),
        switch(
            "duo_ring",
            "duo_attention: streaming heads evict their oldest window token for each decoded one, so they hold "
            "sinks + window in a buffer of that size (the paper's); off, they also keep every token after the "
            "prompt, as kvpress does",
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
        layer: int = 0,
        duo_gates: str | None = None,
        duo_retrieval: float = 0.5,
        global_tokens: int | None = None,
        recent_window: int | None = None,
        cache_bits: int | None = None,
        key_quant_axis: str | None = None,
        duo_ring: bool = False,
    ) -> None:
        if duo_gates is None:
            raise ValueError(
                "duo_attention needs --duo_gates FILE: calibrate the checkpoint once with: python "
                "scripts/calibrate_duo.py --checkpoint_path DIR"
            )
        gates = read_gates(duo_gates)
        heads = parallel.all_heads(n_kv_heads)
        if gates.shape[1] != heads or layer >= gates.shape[0]:
            raise ValueError(
                f"--duo_gates {duo_gates} holds gates for {list(gates.shape)} layers x KV heads; this model has "
                f"{heads} KV heads per layer"
            )
        retrieval = retrieval_heads(gates, duo_retrieval)[
            layer, parallel.first_head() : parallel.first_head() + n_kv_heads
        ]
        if recent_window == 0:
            raise ValueError(
                "duo_attention: --recent_window 0 leaves its streaming heads no window; give 1 or more (default: 256)"
            )
        sinks = self.default_global_tokens if global_tokens is None else global_tokens
        window = min(sinks + (self.default_recent_window if recent_window is None else recent_window), capacity)
        self.sinks = min(sinks, window - 1)
        self.recent = window - self.sinks  # the prompt's newest tokens a streaming head keeps
        slots = window if duo_ring else capacity  # without the ring every position has its own slot
        self.ring = slots - self.sinks
        super().__init__(
            batch_size, int(retrieval.sum()), capacity, head_dim, dtype, device, cache_bits, key_quant_axis
        )
        self.window = make_storage(
            (batch_size, n_kv_heads - int(retrieval.sum()), slots, head_dim), dtype, device, cache_bits, key_quant_axis
        )
        self.register_buffer(
            "pos", torch.full((batch_size, n_kv_heads, capacity), -1, dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer("retrieving", retrieval.nonzero()[:, 0].to(device), persistent=False)
        self.register_buffer("streaming", (~retrieval).nonzero()[:, 0].to(device), persistent=False)
        self.register_buffer("is_retrieval", retrieval[None, :, None].to(device), persistent=False)

    def ring_slot(self, pos: Tensor) -> Tensor:
        """A streaming head's slot for a token: sinks keep theirs, later tokens cycle through the slots past them
        (with `duo_ring` the window's; else as many as the cache has, so no token is overwritten)."""
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.ring)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        B, H, T, D = k.shape
        if T > self.capacity:
            raise ValueError(f"a prompt of {T} tokens does not fit duo_attention's {self.capacity} slots")
        keep = self.retrieving
        self.storage.write(
            torch.arange(T, device=k.device).expand(B, len(keep), T), k[:, keep], v[:, keep], prompt=True
        )
        held = torch.full((B, H, self.capacity), -1, dtype=torch.long, device=k.device)
        held[:, :, :T] = input_pos[:, None, :]
        # Streaming heads: the sinks and the newest `recent` tokens of each row. Candidates past a short row's
        # ends are clamped onto a token already written, so duplicate writes carry the same key and value.
        last = input_pos.max(dim=-1, keepdim=True).values
        sinks, recent = torch.arange(self.sinks, device=k.device), torch.arange(self.recent, device=k.device)
        # [B, W]
        kept = torch.cat([sinks.expand(B, -1), last - self.recent + 1 + recent], dim=1).clamp(min=0).minimum(last)
        slots = self.ring_slot(kept)[:, None, :].expand(B, len(self.streaming), -1)
        index = kept[:, None, :, None].expand(B, len(self.streaming), -1, D)
        self.window.write(
            slots, k[:, self.streaming].gather(2, index), v[:, self.streaming].gather(2, index), prompt=True
        )
        ring = torch.full((B, len(self.streaming), self.capacity), -1, dtype=torch.long, device=k.device)
        held[:, self.streaming] = ring.scatter(2, slots, kept[:, None, :].expand_as(slots))
        self.pos.copy_(held)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, _, D = k.shape
        self.storage.write(
            input_pos[:, None, :].expand(B, len(self.retrieving), 1), k[:, self.retrieving], v[:, self.retrieving]
        )
        ring = self.ring_slot(input_pos)[:, None, :]
        self.window.write(ring.expand(B, len(self.streaming), 1), k[:, self.streaming], v[:, self.streaming])
        slot = torch.where(self.is_retrieval, input_pos[:, None, :], ring)  # [B, H, 1]
        self.pos.scatter_(2, slot, input_pos[:, None, :].expand(B, H, 1))
        (kr, vr), (ks, vs) = self.storage.read(), self.window.read()
        pad = (0, 0, 0, self.capacity - ks.shape[2])
        keys = (
            kr.new_zeros(B, H, self.capacity, D)
            .index_copy(1, self.retrieving, kr)
            .index_copy(1, self.streaming, F.pad(ks, pad))
        )
        values = (
            vr.new_zeros(B, H, self.capacity, D)
            .index_copy(1, self.retrieving, vr)
            .index_copy(1, self.streaming, F.pad(vs, pad))
        )
        return keys, values, self.pos

    def reset(self) -> None:
        super().reset()
        self.window.reset()

    def nbytes(self) -> int:
        return self.storage.nbytes() + self.window.nbytes()

    def stats(self) -> dict[str, int]:
        return {"heads retrieval": len(self.retrieving), "heads streaming": len(self.streaming)}


def streaming_mask(T: int, sinks: int, recent: int, device: torch.device) -> Tensor:
    """[T, T] what a streaming head's query sees: itself and earlier tokens among the sinks and the newest `recent`."""
    i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None]
    return (j <= i) & ((j < sinks) | (i - j < recent))


def mixed_attention(gate: Tensor, sinks: int, recent: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """gate x full + (1 - gate) x streaming attention, a gate per KV head (shared by its query heads)."""
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    stream = F.scaled_dot_product_attention(
        q, k, v, attn_mask=streaming_mask(q.shape[2], sinks, recent, q.device), enable_gqa=True
    )
    g = gate.repeat_interleave(q.shape[1] // gate.shape[0])[None, :, None, None]
    return g * full + (1 - g) * stream


@contextlib.contextmanager
def gated(model: Transformer, gates: Tensor, sinks: int, recent: int) -> Iterator[None]:
    """Every layer's prompt attention mixed by its row of `gates` [n_layer, H_kv], for the duration."""
    for layer, block in enumerate(model.layers):
        block.attention.exact_attention = functools.partial(mixed_attention, gates[layer], sinks, recent)
    try:
        yield
    finally:
        for block in model.layers:
            del block.attention.exact_attention


class Discard(nn.Module):
    """Stands in for every layer's cache while calibrating: nothing is stored."""

    needs_attention, needs_tokens, needs_prompt_lse = False, False, False

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        pass


def final_hidden(model: Transformer, ids: list[int], supervised: int) -> Tensor:
    """The last layer's normed hidden states [K, dim] at the last `supervised` positions of `ids`."""
    captured = []
    hook = model.norm.register_forward_hook(lambda module, args, out: captured.append(out))
    device = model.tok_embeddings.weight.device
    try:
        positions = torch.arange(len(ids), device=device)[None]
        model(
            torch.tensor([ids], device=device), positions, prefill=True, logits_at=positions[:, len(ids) - supervised :]
        )
    finally:
        hook.remove()
    return captured[0][0]


def calibrate(
    model: Transformer,
    sequences: list[tuple[list[int], int]],
    steps: int,
    sinks: int = 64,
    recent: int = 256,
    lr: float = 0.02,
    l1: float = 0.05,
) -> tuple[Tensor, list[float]]:
    """DuoAttention's optimisation: gates [n_layer, H_kv] in [0, 1], starting at 1 (every head retrieves),
    minimising the squared distance between the gated and the full model's final hidden states over each
    sequence's supervised tail (ids, tail length: the question and the answer after a passkey haystack)
    plus `l1` x the sum of the gates (the paper's L1 term); clamped to [0, 1] after each Adam step. Returns the gates
    and the losses."""
    saved = [block.attention.kv_cache for block in model.layers]
    model.setup_caches([Discard()] * len(model.layers))
    trainable = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    gates = torch.ones(
        model.config.n_layer, model.config.n_local_heads, device=model.tok_embeddings.weight.device, requires_grad=True
    )
    optimizer = torch.optim.Adam([gates], lr=lr)
    losses = []
    try:
        with torch.no_grad():
            targets = [final_hidden(model, ids, tail) for ids, tail in sequences]
        for step in tqdm(range(steps), desc="calibrating", unit="step"):
            (ids, tail), target = sequences[step % len(sequences)], targets[step % len(sequences)]
            with gated(model, gates, sinks, recent):
                distance = (final_hidden(model, ids, tail) - target).pow(2).sum(dim=-1).mean()
            loss = distance + l1 * gates.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                gates.clamp_(0, 1)
            losses.append(loss.item())
    finally:
        model.setup_caches(saved)
        for p, flag in zip(model.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
    return gates.detach(), losses


def write_gates(path: Path, gates: Tensor, **facts: object) -> None:
    path.write_text(json.dumps({"gates": [[round(g, 6) for g in row] for row in gates.tolist()], **facts}, indent=1))

"""How a cache stores its keys and values: plain tensors, or packed low-bit integers; either with keys
pruned to their most important channels (ThinK).

A cache writes keys/values into slots and reads every slot back for attention; it never sees how they
are stored, so quantization combines with every strategy. Quantized storage keeps only the packed
codes and their scales: attention runs on keys/values dequantized for the current step and layer,
a temporary that is freed right after, so the memory a cache holds between steps is the packed size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from kvlab.options import Option, choice, integer
from kvlab.scores import key_channels

QUANT_BITS = (8, 4, 2)
CACHE_BITS = (32, 16, *QUANT_BITS)  # 32: float32, as a float32 model computes them; 16: float16
KEY_QUANT_AXES = ("token", "channel")
STORAGE_OPTIONS = (
    choice(
        "cache_bits",
        CACHE_BITS,
        None,
        "store keys and values as a float32 model computes them (32), as float16 (16: half float32's bytes, "
        "read by the native CPU attention as they are) or as packed 8, 4 or 2-bit integers, with any strategy",
        default_help="the model's dtype; generate.py: 16 for a float32 model",
    ),
    choice(
        "key_quant_axis",
        KEY_QUANT_AXES,
        None,
        "with --cache_bits 8, 4 or 2: key scales per token or per channel (KIVI)",
        default_help="token at 8 bits, channel below",
    ),
)
DEFAULT_THINK_WINDOW = 32
# taken by the caches whose prefill shows the storage its queries (full and the evicting strategies)
KEY_PRUNING_OPTIONS = (
    Option(
        "key_channel_pruning",
        (int, float),
        "a fraction in [0, 1)",
        "ThinK: store keys without this share of each KV head's channels, the least important to the prompt's "
        "last queries (values untouched); full and the evicting strategies but hybrid",
        check=lambda v: 0 <= v < 1,
        default_help="off",
    ),
    integer(
        "think_window",
        None,
        "with --key_channel_pruning: the last N prompt queries that rank the key channels",
        default_help=str(DEFAULT_THINK_WINDOW),
    ),
)


def rows_and_heads(slots: Tensor) -> tuple[Tensor, Tensor]:
    """The batch and head indices [B, 1, 1] and [1, H, 1] that go with slots [B, H, N] in an index_put_."""
    batch, heads = slots.shape[:2]
    return torch.arange(batch, device=slots.device)[:, None, None], torch.arange(heads, device=slots.device)[
        None, :, None
    ]


class KVStorage(nn.Module):
    """Keys and values in the model's dtype, [B, H_kv, C, D] each (keys [B, H_kv, C, key_dim] when given)."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | None = None,
        key_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer(
            "k", torch.zeros(*shape[:3], key_dim or shape[3], dtype=dtype, device=device), persistent=False
        )
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def observe_prompt(self, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        """The prompt's positions [B, T], keys [B, H_kv, T, D] and queries [B, H, T, D], shown before its write by
        the caches that take KEY_PRUNING_OPTIONS: storage that decides from them (ThinK's channels) does it here."""

    def write(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        """Store k, v [B, H_kv, N, D] into slots [B, H_kv, N]; `prompt` marks the prefill's write. Written as
        an index_put_ (not scatter_), which torch.compile writes in place: a scatter_ on a buffer is compiled
        as a copy of the whole buffer, twice, every step. Keys and values in another dtype (a float16 recording's,
        replayed into a float32 cache) are converted."""
        index = rows_and_heads(slots) + (slots,)
        self.k.index_put_(index, k.to(self.k.dtype))
        self.v.index_put_(index, v.to(self.v.dtype))

    def read(self) -> tuple[Tensor, Tensor]:
        """Every slot's keys and values, [B, H_kv, C, D] in the model's dtype."""
        return self.k, self.v

    def read_for_attention(self) -> tuple[Tensor, Tensor]:
        """Every slot's keys and values for a decode step's attention (attention.decode_attention), which takes them
        in the model's dtype or, where that is cheaper, in the dtype they are stored in."""
        return self.read()

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())


class HalfKVStorage(KVStorage):
    """Keys and values stored as float16, half the bytes of float32 (llama.cpp's default cache), rounded to
    nearest as they are written. A decode step's attention reads them as they are: the native CPU kernel widens
    each row to float32 as it loads it, so a step reads half the bytes; everything else reads them widened to
    the model's dtype (a temporary). Values beyond float16's range (65504) would become infinite: keys and
    values of the supported models stay far below it."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | None = None,
        key_dim: int | None = None,
    ) -> None:
        super().__init__(shape, torch.float16, device, key_dim)
        self.dtype = dtype

    def write(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        KVStorage.write(self, slots, k.half(), v.half(), prompt)  # by name, not super(): see KVCache

    def read(self) -> tuple[Tensor, Tensor]:
        return self.k.to(self.dtype), self.v.to(self.dtype)

    def read_for_attention(self) -> tuple[Tensor, Tensor]:
        return self.k, self.v


class QuantizedKVStorage(KVStorage):
    """Asymmetric round-to-nearest quantization to `bits` (8, 4 or 2) bits, 8 // bits codes packed per
    byte. Values get a float16 scale and zero point per token (per slot and head, over the head
    dimension). Keys get them per token too, or with `key_axis="channel"` per channel (KIVI, Liu et al.,
    2024: a few key channels carry outliers, which per-token ranges spread over every channel). Unlike
    KIVI, which quantizes keys in groups of tokens behind a full-precision residual, the channel ranges
    here are measured once on the prompt's keys and reused for decoded keys (clamped to that range), so
    eviction can still replace any single slot. Measured on SmolLM2 (README): channel is better at 4
    and 2 bits, token at 8 bits; `make_storage` picks that by default."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | None = None,
        bits: int = 8,
        key_axis: str = "token",
        key_dim: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        B, H, C, D = shape
        key_dim = key_dim or D
        if bits not in QUANT_BITS or D % (8 // bits):
            raise ValueError(
                f"cache_bits must be one of {', '.join(map(str, QUANT_BITS))} (dividing head_dim {D} into whole "
                f"bytes), got {bits}"
            )
        if key_axis not in KEY_QUANT_AXES:
            raise ValueError(f"key quantization axis must be one of {', '.join(KEY_QUANT_AXES)}, got {key_axis!r}")
        self.bits, self.key_axis, self.dtype = bits, key_axis, dtype
        key_scale = (B, H, C, 1) if key_axis == "token" else (B, H, 1, key_dim)
        for name, shape_ in [("k_codes", (B, H, C, key_dim * bits // 8)), ("v_codes", (B, H, C, D * bits // 8))]:
            self.register_buffer(name, torch.zeros(shape_, dtype=torch.uint8, device=device), persistent=False)
        for name, shape_ in [
            ("k_scale", key_scale),
            ("k_zero", key_scale),
            ("v_scale", (B, H, C, 1)),
            ("v_zero", (B, H, C, 1)),
        ]:
            self.register_buffer(name, torch.zeros(shape_, dtype=torch.float16, device=device), persistent=False)
        self.register_buffer("shifts", torch.arange(0, 8, bits, dtype=torch.uint8, device=device), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        index = rows_and_heads(slots) + (slots,)  # index_put_, written in place when compiled (KVStorage.write)
        if self.key_axis == "channel" and prompt:
            self.k_zero.copy_(k.amin(dim=2, keepdim=True))
            self.k_scale.copy_(self._step(k.amax(dim=2, keepdim=True) - self.k_zero.to(k.dtype)))
        if self.key_axis == "token":
            k_zero, k_scale = (
                k.amin(dim=-1, keepdim=True).half(),
                self._step(k.amax(dim=-1, keepdim=True) - k.amin(dim=-1, keepdim=True)),
            )
            self.k_zero.index_put_(index, k_zero)
            self.k_scale.index_put_(index, k_scale)
            k_codes = self._encode(k, k_zero, k_scale)
        else:
            k_codes = self._encode(k, self.k_zero, self.k_scale)
        v_zero, v_scale = (
            v.amin(dim=-1, keepdim=True).half(),
            self._step(v.amax(dim=-1, keepdim=True) - v.amin(dim=-1, keepdim=True)),
        )
        self.v_zero.index_put_(index, v_zero)
        self.v_scale.index_put_(index, v_scale)
        self.k_codes.index_put_(index, k_codes)
        self.v_codes.index_put_(index, self._encode(v, v_zero, v_scale))

    def read(self) -> tuple[Tensor, Tensor]:
        return self._decode(self.k_codes, self.k_zero, self.k_scale), self._decode(
            self.v_codes, self.v_zero, self.v_scale
        )

    def reset(self) -> None:
        for buffer in (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero):
            buffer.zero_()

    def nbytes(self) -> int:
        return sum(b.nbytes for name, b in self.named_buffers() if name != "shifts")

    def _step(self, value_range: Tensor) -> Tensor:
        """The float16 quantization step for a range; never 0, so constant vectors decode exactly to their zero
        point."""
        return (value_range.float() / (2**self.bits - 1)).clamp(min=1e-4).half()

    def _encode(self, x: Tensor, zero: Tensor, scale: Tensor) -> Tensor:
        """[..., D] -> packed uint8 [..., D * bits / 8]: code i of a byte sits at bits i*bits.."""
        codes = ((x.float() - zero.float()) / scale.float()).round().clamp(0, 2**self.bits - 1).to(torch.uint8)
        # sizes spelt out: a layer may have 0 heads
        codes = codes.view(*codes.shape[:-1], codes.shape[-1] * self.bits // 8, 8 // self.bits) << self.shifts
        return codes.sum(dim=-1, dtype=torch.uint8)

    def _decode(self, packed: Tensor, zero: Tensor, scale: Tensor) -> Tensor:
        codes = (packed[..., None] >> self.shifts) & (2**self.bits - 1)
        codes = codes.view(*packed.shape[:-1], packed.shape[-1] * 8 // self.bits)
        return (codes.float() * scale.float() + zero.float()).to(self.dtype)


class PrunedKeyStorage(KVStorage):
    """ThinK (Xu et al., 2024, arXiv 2407.21018): each (sequence, KV head) stores only the `kept` key channels that
    `key_channels` ranks highest on the prompt (its last `window` queries and every prompt key), chosen at prefill
    (`observe_prompt`) and used for every key written after, decoded ones included; values are untouched. `inner`
    (plain or quantized) holds the narrow keys, so the bytes shrink; `read` puts them back in place with zeros
    in the pruned channels, a temporary per step and layer, so q.k runs through the kept channels only. The
    reference (SalesforceAIResearch/ThinK) keeps the last 32 prompt keys and the decoded ones whole."""

    def __init__(
        self,
        inner: KVStorage,
        shape: tuple[int, int, int, int],
        kept: int,
        window: int,
        device: torch.device | None = None,
    ) -> None:
        nn.Module.__init__(self)
        B, H, _, D = shape
        self.inner, self.head_dim, self.window = inner, D, window
        # [B, H, 1, kept]: the 1 at dim 2 is never mistaken for a slot axis (build.mark_slots_dynamic).
        self.register_buffer(
            "channels", torch.arange(kept, device=device).expand(B, H, 1, kept).clone(), persistent=False
        )

    def observe_prompt(self, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        best = key_channels(input_pos, k, q, self.window).topk(self.channels.shape[-1], dim=-1).indices
        self.channels.copy_(best.sort(dim=-1).values[:, :, None])

    def write(self, slots: Tensor, k: Tensor, v: Tensor, prompt: bool = False) -> None:
        self.inner.write(slots, k.gather(-1, self.channels.expand(*k.shape[:3], -1)), v, prompt)

    def read(self) -> tuple[Tensor, Tensor]:
        keys, values = self.inner.read()
        return keys.new_zeros(*keys.shape[:3], self.head_dim).scatter_(-1, self.channels.expand_as(keys), keys), values

    def reset(self) -> None:
        self.inner.reset()

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.channels.nbytes


def make_storage(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | None,
    bits: int | None,
    key_axis: str | None = None,
    key_pruning: float | None = None,
    think_window: int | None = None,
) -> KVStorage:
    """Plain storage for bits=None (and 32, which needs a float32 model), float16 for 16, else packed `bits`-bit
    codes with keys quantized per `key_axis` (default: per token at 8 bits, per channel below). With `key_pruning`
    (ThinK), keys keep D - int(D x key_pruning) of their D channels (rounded up to whole bytes when packed), chosen
    from the prompt's last `think_window` queries."""
    if bits not in QUANT_BITS and key_axis is not None:
        raise ValueError(f"key_quant_axis={key_axis!r} needs cache_bits {', '.join(map(str, QUANT_BITS))}, got {bits}")
    if key_pruning is None and think_window is not None:
        raise ValueError(f"think_window={think_window} needs key_channel_pruning")
    if bits == 32 and dtype != torch.float32:
        raise ValueError(
            f"cache_bits 32 keeps a float32 model's keys and values as computed; this model runs in {dtype}: "
            "drop it, or give 16"
        )
    D, per_byte = shape[3], 8 // bits if bits in QUANT_BITS else 1
    key_dim = D if key_pruning is None else -(-(D - int(D * key_pruning)) // per_byte) * per_byte
    if bits in (None, 32):
        storage = KVStorage(shape, dtype, device, key_dim)
    elif bits == 16:
        storage = HalfKVStorage(shape, dtype, device, key_dim)
    else:
        storage = QuantizedKVStorage(
            shape, dtype, device, bits, key_axis or ("token" if bits == 8 else "channel"), key_dim
        )
    return (
        storage
        if key_pruning is None
        else PrunedKeyStorage(storage, shape, key_dim, think_window or DEFAULT_THINK_WINDOW, device)
    )

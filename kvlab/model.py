"""A single-file Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

GPT-Fast in spirit: static shapes, one small compiled decode step, no framework. The model talks
to its KV cache only through the `KVCache` interface of `cache.py`:

    prefill:  exact causal attention over the prompt's own keys, then `cache.prefill(...)` stores
              (or compresses) them;
    decode:   `cache.update(...)` inserts the step's keys/values and returns what to attend over
              plus each slot's token position (-1 = empty); the mask is derived from positions.
              Caches with `needs_attention` get the attention probabilities via `cache.observe`.
              A cache that `attends_itself` (the paged pool's FlexAttention path) returns the
              step's attention from `cache.attend(...)` instead.

q/k layout: rotate-half (the Hugging Face convention). HF checkpoints load unchanged; GGUF files,
whose q/k rows are permuted for interleaved RoPE, are un-permuted at conversion (checkpoint.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.attention import causal_attention_lse, chunk_attention, decode_attention
from kvlab.cache import KVCache


class ConfigError(ValueError):
    """A checkpoint or model configuration that kvlab cannot use."""


@dataclass
class ModelArgs:
    vocab_size: int
    n_layer: int
    n_head: int
    dim: int
    intermediate_size: int
    n_local_heads: int = -1  # KV heads (GQA); -1 means n_head
    head_dim: int = 0  # 0 means dim // n_head
    rope_base: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3.1 style: factor, low/high_freq_factor, original_max_position_embeddings
    norm_eps: float = 1e-5
    block_size: int = 2048  # maximum context length
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE

    def __post_init__(self) -> None:
        self.check_values()
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_local_heads:
            raise ConfigError(f"n_head={self.n_head} is not a multiple of n_local_heads={self.n_local_heads}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "llama3") != "llama3":
            raise ConfigError(f"unsupported rope scaling {self.rope_scaling!r}; supported: llama3")

    def check_values(self) -> None:
        """Each field of the right type and in range (ConfigError naming the field and its value)."""
        kinds = {"int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "true or false")}
        for f in fields(self):
            value, (kind, words) = getattr(self, f.name), kinds.get(str(f.type), (object, ""))
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"model config {f.name} must be {words}, got {value!r}")
        positive = (
            "vocab_size",
            "n_layer",
            "n_head",
            "dim",
            "intermediate_size",
            "block_size",
            "rope_base",
            "norm_eps",
        )
        for name in positive:
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"model config {name} must be > 0 (and finite), got {getattr(self, name)!r}")
        if not (self.n_local_heads == -1 or self.n_local_heads > 0) or self.head_dim < 0:
            raise ConfigError(
                f"model config n_local_heads must be > 0 and head_dim >= 0, got {self.n_local_heads} and "
                f"{self.head_dim}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.tie_weights()
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """The LM head shares the embedding's tensors: its weight, and a quantized one's scales too."""
        for name, tensor in [
            *self.tok_embeddings.named_parameters(recurse=False),
            *self.tok_embeddings.named_buffers(recurse=False),
        ]:
            setattr(self.output, name, tensor)

    def setup_caches(self, caches: list[KVCache]) -> None:
        """Attach one cache per layer (see `cache.make_caches`)."""
        for layer, kv_cache in zip(self.layers, caches, strict=True):
            layer.attention.kv_cache = kv_cache

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        prefill: bool = False,
        logits_at: Tensor | None = None,
        chunk: bool = False,
        probe: int = 0,
    ) -> Tensor:
        """tokens, input_pos: [B, T]. input_pos is each token's position in its own sequence, -1 for
        padding. `prefill=True` means a fresh prompt starting at position 0 (right-padded): attention is
        exact causal attention over the prompt itself. `chunk=True` means a later chunk of a chunked
        prefill (right-padded): it attends over what each cache holds and itself (`KVCache.prefill_chunk`); its
        last `probe` columns are then queries that score the chunk and are never stored (KVzip's repeat).
        `logits_at` [B, K] picks which columns get logits (e.g. each row's last prompt token), so a long
        prefill need not build [B, T, vocab] logits."""
        positions = input_pos.clamp(min=0)
        x = self.tok_embeddings(tokens)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        for layer in self.layers:
            x = layer(x, tokens, input_pos, cos, sin, prefill, chunk, probe)
        if logits_at is not None:
            x = x.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return self.output(self.norm(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self,
        x: Tensor,
        tokens: Tensor,
        input_pos: Tensor,
        cos: Tensor,
        sin: Tensor,
        prefill: bool,
        chunk: bool = False,
        probe: int = 0,
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), tokens, input_pos, cos, sin, prefill, chunk, probe)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = Linear(config.dim, qkv_dim, bias=config.qkv_bias)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=False)
        # One weight over head_dim, shared by every head (so tensor parallelism keeps it whole).
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: Tensor,
        tokens: Tensor,
        input_pos: Tensor,
        cos: Tensor,
        sin: Tensor,
        prefill: bool,
        chunk: bool = False,
        probe: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv_size, kv_size], dim=-1)
        q, k = q.view(B, T, self.n_head, self.head_dim), k.view(B, T, self.n_local_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is None:
            raise RuntimeError("call model.setup_caches(...) before running the model")
        extra = {"tokens": tokens} if self.kv_cache.needs_tokens else {}
        if prefill:
            if self.kv_cache.needs_prompt_lse and q.device.type == "cpu":
                y, extra["lse"] = causal_attention_lse(q, k, v)
            else:
                y = self.exact_attention(q, k, v)
            self.kv_cache.prefill(input_pos, k, v, q, **extra)
        elif chunk:
            if probe:
                extra["probe"] = probe
            y = self.kv_cache.prefill_chunk(
                input_pos, k, v, q, functools.partial(chunk_attention, q, input_pos), **extra
            )
        elif self.kv_cache.attends_itself:
            y = self.kv_cache.attend(input_pos, k, v, q)
        else:
            keys, values, key_pos = self.kv_cache.update(input_pos, k, v, q, **extra)
            y, probs = decode_attention(q, keys, values, key_pos, input_pos, self.kv_cache.needs_attention)
            if probs is not None:
                self.kv_cache.observe(probs)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def exact_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The prompt's causal attention over itself (DuoAttention's calibration mixes another pattern in: duo.py):
        kvlab's native prefill attention where it runs, else torch's."""
        if kernels.takes_prefill_attention(q, k, v):
            return causal_attention_lse(q, k, v)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:  # none on the meta device: see Linear.reset_parameters
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """nn.Linear whose product runs where kernels.linear picks: kvlab's native matrix-vector kernel in a CPU
    float32 decode step, torch's everywhere else."""

    def reset_parameters(self) -> None:
        """torch's initialization, but on the meta device (a skeleton a checkpoint fills): there it does nothing,
        and its kernels (Python, on meta) would import torch's compiler stack, 70 MB of a process that never
        compiles."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.weight, self.bias)

    def dequantize(self) -> Tensor:
        """The weight [out, in] in floats, as the quantized Linears give theirs."""
        return self.weight

    def gated(self, up: Linear, x: Tensor) -> Tensor:
        """silu(self(x)) * up(x): SwiGLU's gate (self) and up projections, in one native call where it runs."""
        if self.bias is None and up.bias is None:
            return kernels.gated(x, self.weight, up.weight)
        return F.silu(self(x)) * up(x)


def lay_out_for_matvec(model: nn.Module) -> None:
    """Store float Linear weights as the CPU decode step's matrix-vector kernel reads them fastest. kvlab's
    native kernel (kernels.load()) streams row-major [out, in] rows: every weight stays or becomes
    contiguous. Without it, MKL reads a row-major matrix-vector product at ~14 GB/s and a column-major one
    at ~21 GB/s (decode +19%: bench/results/decode_profile_cpu.md), so every weight with more outputs than
    inputs (q/k/v, gate/up, the LM head and so the tied embedding) is stored column-major: the transpose
    of a contiguous [in, out] matrix. Shapes and values are unchanged. For CPU: GPU kernels were not
    measured with it."""
    native = kernels.load()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        if native and not module.weight.is_contiguous():
            module.weight.data = module.weight.data.contiguous()
        elif not native and module.out_features > module.in_features and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()


FFN_ROWS = 1024  # rows (tokens) a feed-forward pass takes at a time: its hidden activations are that many rows long


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        """SwiGLU, FFN_ROWS rows at a time: each row's result is its own, and a long prompt's prefill holds the
        hidden activations (gate, up, their product: 3 x intermediate_size wide) for FFN_ROWS rows, not the prompt's."""
        if x.shape[:-1].numel() <= FFN_ROWS:
            return self.w2(self.w1.gated(self.w3, x))
        rows = x.reshape(-1, x.shape[-1]).split(FFN_ROWS)
        return torch.cat([self.w2(self.w1.gated(self.w3, part)) for part in rows]).view(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_frequencies(config: ModelArgs) -> Tensor:
    """Inverse frequencies, with Llama-3.1 "llama3" scaling of the low-frequency bands when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / s["low_freq_factor"], old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos/sin for every position up to the context length, [block_size, head_dim], float32, on the default device:
    computed on the CPU, so a skeleton built on the meta device gets them without running meta kernels (Python,
    that would import torch's compiler stack: Linear.reset_parameters)."""
    with torch.device("cpu"):
        inv_freq = rope_frequencies(config).float()
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
    return cos.to(torch.get_default_device()), sin.to(torch.get_default_device())


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x [B, H, T, D]; cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin

"""What `engine.generate` returns: the tokens of a batch, with its timings, the caches' bytes and counts, and what
planned the caches (layer and head budgets, SqueezeAttention's similarity)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from kvlab.cache import KVCache
from kvlab.config import CacheSpec
from kvlab.diagnostics import AttentionLossProbe, attention_loss_summary
from kvlab.model import Transformer


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per prompt, up to (not including) a stop token
    finished: list[bool]  # True where a stop token ended the sequence
    prompt_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float  # all decode steps but the first
    first_step_seconds: float  # the first decode step, which includes compilation under --compile
    kv_cache_bytes: int  # allocated by the caches (packed bytes for a quantized cache)
    full_cache_bytes: int  # what a full cache in the model's dtype would allocate for the same batch
    tokens_held: list[float]  # per layer, at the end: tokens held per sequence and KV head (mean)
    sequence_length: float  # prompt + generated tokens per sequence (mean): what a full cache would hold
    cache_stats: dict[str, int]  # the caches' own counts, summed over layers (e.g. hybrid's heads per policy)
    attention_loss: dict[str, list[float]] | None = None  # with attention_loss=True: "per_layer" and "per_step" means
    # with a layer budget planner: slots per sequence and layer (0: a full layer)
    layer_budgets: list[list[int]] | None = None
    # per sequence and layer: SqueezeAttention's measure (recorded prefills)
    layer_similarity: list[list[float]] | None = None
    # with head_budget adakv*: slots per sequence, layer and KV head ([] for a full layer)
    head_budgets: list[list[list[int]]] | None = None


def summarize(
    model: Transformer,
    rows: list[tuple[list[int], bool]],
    lens: Tensor,
    steps: int,
    seconds: tuple[float, float, float],
    caches: Sequence[KVCache],
    probes: Sequence[AttentionLossProbe] | None,
    budgets: Tensor | None,
    similarity: Tensor | None,
    spec: CacheSpec,
) -> Generation:
    """A Generation from each row's (tokens, stopped), the prompt lengths [B], the decode steps after the first token,
    the (prefill, first step, later steps) seconds and the caches with what planned them."""
    cfg = model.config
    kv_heads = model.layers[0].attention.n_local_heads  # this rank's, under tensor parallelism
    full_bytes = (
        2
        * cfg.n_layer
        * len(rows)
        * kv_heads
        * (int(lens.max()) + steps)
        * cfg.head_dim
        * model.norm.weight.element_size()
    )
    prefill_seconds, first_step_seconds, decode_seconds = seconds
    return Generation(
        [r[0] for r in rows],
        [r[1] for r in rows],
        int(lens.sum()),
        prefill_seconds,
        steps,
        decode_seconds,
        first_step_seconds,
        sum(c.nbytes() for c in caches),
        full_bytes,
        [c.tokens_held().float().mean().item() for c in caches],
        float(lens.float().mean()) + steps,
        sum_stats(caches),
        attention_loss_summary(probes) if probes else None,
        None if budgets is None else budgets.tolist(),
        None if similarity is None else similarity.tolist(),
        head_budget_lists(caches) if spec.options.get("head_budget", "uniform") != "uniform" else None,
    )


def head_budget_lists(caches: Sequence[KVCache]) -> list[list[list[int]]]:
    """Per sequence, layer and KV head: the slots each head may fill ([] for a layer that keeps every token)."""
    per_layer = [c.head_budgets() for c in caches]
    batch = next(b.shape[0] for b in per_layer if b is not None)
    return [[[] if b is None else b[row].tolist() for b in per_layer] for row in range(batch)]


def sum_stats(caches: Sequence[KVCache]) -> dict[str, int]:
    """The caches' stats summed over layers, zero counts kept."""
    total: Counter[str] = Counter()
    for cache in caches:
        total.update(cache.stats())
    return dict(total)

"""Layer budget planners: split each sequence's total KV budget over the layers, at prefill, per prompt.

Every compressing layer is configured with the same cache length (say 25% of the sequence); the total
over the layers is the sequence's budget. A planner moves slots between layers without changing that
total, then any sequence-wise strategy (window, heavy_hitter, snapkv, ...) evicts inside its layer's
share. A planner returns relative weights per layer; `split_budget` turns them into whole slot counts
that add up to the total exactly, within each layer's floor (its protected sinks + recent window + 1)
and ceiling (the sequence's own length: more slots than tokens would be wasted).

    uniform   every layer the same (the configured lengths, unchanged)
    pyramid   PyramidKV (Cai et al., 2024): linearly fewer slots from the first layer to the last
    funnel    the reverse schedule: more slots in upper layers (a control for pyramid)
    squeeze   SqueezeAttention (Wang et al., 2024): layers whose attention changes the hidden state
              least (cosine similarity of the state before the layer and after its attention residual,
              averaged over the prompt) are grouped by KMeans(3); the least important group gets
              p x the uniform share, the others share the rest equally
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.model import Transformer
from kvlab.options import choice, fraction, integer

LAYER_BUDGETS = ("uniform", "pyramid", "funnel", "squeeze")
DEFAULT_SQUEEZE_P = 0.35
DEFAULT_PYRAMID_BETA = 20
LAYER_BUDGET_OPTION = choice(
    "layer_budget",
    LAYER_BUDGETS,
    "uniform",
    "split each sequence's total budget (max_cache_length x compressing layers) over the layers at prefill, per "
    "prompt: uniform (as configured), pyramid (PyramidKV), funnel (pyramid reversed) or squeeze "
    "(SqueezeAttention)",
)
SQUEEZE_P = fraction(
    "squeeze_p", DEFAULT_SQUEEZE_P, "layer_budget squeeze: the least important layers' share of the uniform budget"
)
PYRAMID_BETA = integer(
    "pyramid_beta",
    DEFAULT_PYRAMID_BETA,
    "layer_budget pyramid/funnel: the smallest layer keeps 1/beta of the average's unprotected slots",
)
# the settings each planner takes
PLANNER_OPTIONS = {"squeeze": (SQUEEZE_P,), "pyramid": (PYRAMID_BETA,), "funnel": (PYRAMID_BETA,)}


def split_budget(weights: Sequence[float], total: int, floor: Sequence[int], ceiling: Sequence[int]) -> list[int]:
    """Whole slot counts proportional to `weights`, each within [floor, ceiling], summing to exactly
    `total` (clipped to [sum(floor), sum(ceiling)] when it lies outside). Water-filling: layers that hit
    a bound are fixed there and the rest is shared again; then largest-remainder rounding."""
    n = len(weights)
    total = min(max(total, sum(floor)), sum(ceiling))
    share = [0.0] * n
    free = set(range(n))
    while free:
        left = total - sum(share[i] for i in range(n) if i not in free)
        weight = sum(weights[i] for i in free)
        ideal = {i: left * weights[i] / weight if weight > 0 else left / len(free) for i in free}
        clipped = {i: min(max(ideal[i], floor[i]), ceiling[i]) for i in free}
        over = [i for i in free if clipped[i] != ideal[i]]
        if not over:
            share = [ideal.get(i, share[i]) for i in range(n)]
            break
        # Fix the layers furthest outside their bounds first: fixing every clipped layer at once could overshoot.
        sign = 1 if sum(clipped[i] - ideal[i] for i in over) > 0 else -1
        for i in over:
            if (clipped[i] - ideal[i]) * sign > 0:
                share[i] = clipped[i]
                free.discard(i)
    counts = [int(s) for s in share]
    by_remainder = sorted(range(n), key=lambda i: (counts[i] - share[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def pyramid_schedule(
    budget: int, window: int, n_layer: int, length: int, beta: int = DEFAULT_PYRAMID_BETA
) -> list[int]:
    """PyramidKV's per-layer slots for an average of `budget` per layer (`window` of them protected):
    from max down to min = (budget - window) // beta in equal integer steps, with max = 2(budget - window)
    - min, capped at the sequence length; uniform when the sequence is shorter than 2(budget - window)."""
    if n_layer == 1 or length < 2 * (budget - window):
        return [budget] * n_layer
    low = (budget - window) // beta
    high = 2 * (budget - window) - low
    if high >= length - window:
        high = length - window
        low = 2 * (budget - window) - high
    step = (high - low) // (n_layer - 1)
    return [high - layer * step + window for layer in range(n_layer)]


def pyramid_ratio_schedule(
    length: int, ratio: float, n_layer: int, window: int, beta: int = DEFAULT_PYRAMID_BETA
) -> list[int]:
    """kvpress's PyramidKVPress: prompt tokens each of `n_layer` layers keeps from a `length`-token prompt
    at compression `ratio`, falling linearly with depth from max to min = length(1 - ratio) / beta, with
    max + min = 2 length(1 - ratio) (so the layers keep the uniform total), max capped at length - window.
    Where that does not give length >= max >= min >= window (short prompts, high ratios), every layer
    keeps round(length(1 - ratio)), SnapKV's count. `window` is SnapKV's observation window."""
    kept = length * (1 - ratio)
    low = kept / beta
    high = 2 * kept - low
    if high >= length - window:
        high = length - window
        low = 2 * kept - high
    if not length >= high >= low >= window:
        return [max(1, round(kept))] * n_layer
    step = (high - low) / (n_layer - 1) if n_layer > 1 else 0.0
    return [round(high - layer * step) for layer in range(n_layer)]


def kmeans_1d(values: Tensor, k: int = 3, iterations: int = 50) -> Tensor:
    """Deterministic KMeans on scalars: centroids start at evenly spaced quantiles; an empty cluster
    keeps its centroid. Returns each value's cluster label, clusters numbered by ascending centroid."""
    values = values.double()
    centroids = torch.quantile(values, torch.linspace(0, 1, k, dtype=torch.double))
    for _ in range(iterations):
        labels = (values[:, None] - centroids[None, :]).abs().argmin(dim=1)
        members = F.one_hot(labels, k).double()
        counts = members.sum(dim=0)
        centroids = torch.where(counts > 0, (members * values[:, None]).sum(dim=0) / counts.clamp(min=1), centroids)
    order = centroids.argsort()
    return order.argsort()[(values[:, None] - centroids[None, :]).abs().argmin(dim=1)]


def squeeze_weights(similarity: Tensor, p: float = DEFAULT_SQUEEZE_P) -> list[float]:
    """SqueezeAttention's layer weights from cosine similarities [L]: the KMeans group with the highest
    similarity (least changed by attention, least important) gets p, the others share the rest equally
    (mean weight 1). Uniform when every layer lands in that group."""
    labels = kmeans_1d(similarity)
    low = labels == labels.max()
    n_low, n = int(low.sum()), len(similarity)
    if n_low == n:
        return [1.0] * n
    other = (n - n_low * p) / (n - n_low)
    return [p if is_low else other for is_low in low.tolist()]


def plan_budgets(
    planner: str,
    total: int,
    length: int,
    floor: Sequence[int],
    similarity: Tensor | None = None,
    squeeze_p: float = DEFAULT_SQUEEZE_P,
    pyramid_beta: int = DEFAULT_PYRAMID_BETA,
) -> list[int]:
    """One sequence's slots per compressing layer: `total` split by `planner` (see the module docstring).
    `length` is the sequence's prompt + max_new_tokens (each layer's ceiling), `floor` each layer's
    minimum, `similarity` [L] the squeeze measure of each layer."""
    n = len(floor)
    if planner == "uniform":
        weights = [1.0] * n
    elif planner in ("pyramid", "funnel"):
        weights = [float(w) for w in pyramid_schedule(total // n, max(floor) - 1, n, length, pyramid_beta)]
        weights = weights[::-1] if planner == "funnel" else weights
    elif planner == "squeeze":
        if similarity is None:
            raise ValueError("the squeeze planner needs each layer's measured similarity")
        weights = squeeze_weights(similarity, squeeze_p)
    else:
        raise ValueError(f"unknown layer budget planner {planner!r}; choose from: {', '.join(LAYER_BUDGETS)}")
    # a floor above the sequence keeps all of it
    return split_budget(weights, total, floor, [max(length, f) for f in floor])


@contextmanager
def residual_similarity(model: Transformer) -> Iterator[list[Tensor]]:
    """Record, per layer, SqueezeAttention's importance measure during a forward pass: the cosine
    similarity between the hidden state entering the layer and the state after its attention residual,
    per token [B, T]. Yields the list the layers append to (in order). Uses hooks, so model.py stays as it is."""
    similarities: list[Tensor] = []
    # the running layer's input only (every layer's would stay alive for the whole pass)
    entering: dict[str, Tensor] = {}
    handles = []
    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(lambda module, args: entering.update(x=args[0])))
        handles.append(
            layer.attention.register_forward_hook(
                lambda module, args, out: similarities.append(_cosine(entering["x"], out))
            )
        )
    try:
        yield similarities
    finally:
        for handle in handles:
            handle.remove()


def _cosine(x: Tensor, attention_out: Tensor) -> Tensor:
    return F.cosine_similarity(x.float(), (x + attention_out).float(), dim=-1)


def mean_over_prompt(per_token: Tensor, input_pos: Tensor) -> Tensor:
    """[B, T] per-token values -> [B] means over each row's real (non-padding) tokens."""
    real = (input_pos >= 0).float()
    return (per_token * real).sum(dim=-1) / real.sum(dim=-1)

"""Ada-KV per-head budgets (head_budget=adakv): the split matches the published rule, each head keeps
exactly its share of the prompt's top tokens, the layer total is exact through decoding, and generate()
sizes, compiles and reports it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import spec_for
from kvlab.build import make_caches
from kvlab.engine import compile_decode_step, generate
from kvlab.head_budget import adakv_capacities, adakv_slots
from kvlab.prompt_compression import PromptCompressor
from kvlab.strategies import HeavyHitterCache


class FixedScores(PromptCompressor):
    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores

    def __call__(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.scores


def reference_adakv(scores: torch.Tensor, budget: int, floor: float) -> list[float]:
    """The rule as published: top H x budget scores over all heads, counted per head; cap = count x (1 - floor) + budget
    x floor."""
    H, T = scores.shape
    winners = scores.flatten().topk(H * budget).indices // T
    counts = torch.bincount(winners, minlength=H)
    return [c * (1 - floor) + budget * floor for c in counts.tolist()]


def split_of(cache: HeavyHitterCache, scores: torch.Tensor, T: int) -> torch.Tensor:
    """The cache's per-head split of a T-token prompt's scores, as its prefill computes it."""
    return adakv_capacities(
        scores,
        torch.tensor([[[T]]]),
        cache.row_budget,
        cache.decode_room,
        cache.capacity,
        cache.head_budget,
        cache.adakv_floor,
    )


def adakv_cache(H: int, budget: int, T: int, floor: float = 0.2, **options) -> HeavyHitterCache:
    cache = HeavyHitterCache(
        1, H, adakv_slots(budget, H, floor), 4, torch.float32, head_budget="adakv", adakv_floor=floor, **options
    )
    cache.limit_rows(torch.tensor([budget]))
    return cache


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(1, 6),
    budget=st.integers(4, 20),
    extra=st.integers(0, 40),
    floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    seed=st.integers(0, 99),
)
def test_adakv_split_matches_the_reference_and_sums_exactly(H, budget, extra, floor, seed):
    T = budget + extra
    scores = torch.rand(1, H, T, generator=torch.Generator().manual_seed(seed))
    cache = adakv_cache(H, budget, T, floor, global_tokens=0, recent_window=1)
    caps = split_of(cache, scores, T)[0, :, 0]
    assert int(caps.sum()) == H * budget
    for cap, ideal in zip(caps.tolist(), reference_adakv(scores[0], budget, floor), strict=True):
        assert abs(cap - ideal) < 1  # largest-remainder rounding of the reference's real-valued shares


def reference_kvpress_adakv(scores: torch.Tensor, n_kept: int, alpha: float) -> list[int]:
    """kvpress's AdaKVPress.compress: each head's top max(1, int(alpha x n_kept)) scores set to the largest float,
    then the H x (T - n_kept) lowest over all heads pruned; the tokens each head keeps."""
    H, T = scores.shape
    scores = scores.clone()
    n_safe = max(1, int(n_kept * alpha))
    scores.scatter_(-1, scores.topk(n_safe, dim=-1).indices, torch.finfo(scores.dtype).max)
    pruned = (-scores.flatten()).topk(H * (T - n_kept)).indices // T
    return [T - c for c in torch.bincount(pruned, minlength=H).tolist()]


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(1, 6),
    budget=st.integers(4, 20),
    extra=st.integers(0, 40),
    floor=st.sampled_from([0.2, 0.5, 1.0]),
    seed=st.integers(0, 99),
)
def test_adakv_safeguard_split_is_kvpress_adakv(H, budget, extra, floor, seed):
    """Exactly the tokens per head that kvpress's AdaKVPress keeps, within the widened buffer."""
    T = budget + extra
    scores = torch.rand(1, H, T, generator=torch.Generator().manual_seed(seed))
    cache = HeavyHitterCache(
        1,
        H,
        adakv_slots(budget, H, floor, safeguard=True),
        4,
        torch.float32,
        head_budget="adakv_safeguard",
        adakv_floor=floor,
        global_tokens=0,
        recent_window=1,
    )
    cache.limit_rows(torch.tensor([budget]))
    caps = split_of(cache, scores, T)[0, :, 0].tolist()
    assert caps == reference_kvpress_adakv(scores[0], budget, floor) and max(caps) <= cache.capacity


def test_adakv_heads_keep_their_share_of_the_prompt_top_tokens_and_decode_inside_it():
    torch.manual_seed(0)
    H, budget, T, D = 3, 12, 40, 4
    cache = adakv_cache(H, budget, T, global_tokens=2, recent_window=3)
    scores = torch.rand(1, H, T)
    scores[0, 0, 5:30] += 1.0  # head 0 holds most of the layer's best tokens
    cache.prompt_compressor = FixedScores(scores)
    k = torch.randn(1, H, T, D)
    cache.prefill(torch.arange(T)[None], k, k, torch.zeros(1, H, T, D))
    caps = cache.head_budgets()[0].tolist()
    assert sum(caps) == H * budget and caps[0] > budget > max(caps[1:]) >= round(0.2 * budget)
    for head, cap in enumerate(caps):
        held = sorted(p for p in cache.pos[0, head].tolist() if p >= 0)
        protected = {0, 1, T - 3, T - 2, T - 1}
        ranked = [p for p in scores[0, head].argsort(descending=True).tolist() if p not in protected]
        assert held == sorted(protected | set(ranked[: cap - len(protected)]))
    for step in range(10):
        kv = torch.randn(1, H, 1, D)
        pos = cache.update(torch.tensor([[T + step]]), kv, kv, kv)[2]
        assert (pos[0] >= 0).sum(dim=-1).tolist() == caps and (pos[0] == T + step).any(dim=-1).all()


def test_adakv_share_beyond_the_buffer_goes_to_the_other_heads():
    H, budget, T = 3, 10, 60
    cache = HeavyHitterCache(1, H, 14, 4, torch.float32, head_budget="adakv", global_tokens=0, recent_window=1)
    cache.limit_rows(torch.tensor([budget]))
    scores = torch.zeros(1, H, T)
    scores[0, 0] = 1.0  # every winner in head 0: its share (0.8 x 30 + 2 = 26) exceeds the 14 slots
    caps = split_of(cache, scores, T)[0, :, 0].tolist()
    assert caps == [14, 8, 8] and adakv_slots(budget, H) == 26


def test_make_caches_rejects_a_bad_head_budget():
    with pytest.raises(
        ValueError,
        match="head_budget must be one of uniform, adakv, adakv_safeguard, global and adakv_floor in \\[0, "
        "1\\]; got 'ada'",
    ):
        make_caches("heavy_hitter", 1, 1, 2, 16, 4, torch.float32, head_budget="ada")
    with pytest.raises(ValueError, match="cache strategy 'hybrid' does not take head_budget"):
        make_caches("hybrid", 1, 1, 2, 16, 4, torch.float32, head_budget="adakv")


def test_generate_with_adakv_keeps_each_layer_total_batches_and_compiles(tiny_model):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    spec = spec_for(
        tiny_model,
        "heavy_hitter",
        0.5,
        global_tokens=1,
        recent_window=2,
        prompt_compression_strategy="snapkv",
        snapkv_window=4,
        head_budget="adakv",
    )
    eager = generate(tiny_model, prompts, 16, spec)
    cfg = tiny_model.config
    caches = [layer.attention.kv_cache for layer in tiny_model.layers]
    # widened for the largest share
    assert {c.capacity for c in caches} == {adakv_slots(round(0.5 * 36), cfg.n_local_heads)}
    for row, prompt in enumerate(prompts):
        budget = round(0.5 * (len(prompt) + 16))
        assert [sum(heads) for heads in eager.head_budgets[row]] == [cfg.n_local_heads * budget] * cfg.n_layer
        assert generate(tiny_model, [prompt], 16, spec).tokens[0] == eager.tokens[row]
    assert any(len(set(heads)) > 1 for heads in eager.head_budgets[0])
    torch._dynamo.reset()
    compiled = generate(tiny_model, prompts, 16, spec, decode_step=compile_decode_step(torch.device("cpu")))
    assert compiled.tokens == eager.tokens and compiled.head_budgets == eager.head_budgets


def test_ada_pyramidkv_combines_layer_and_head_budgets(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode("The history of the printing press begins in the fifteenth century, in Mainz. " * 12)
    spec = spec_for(
        model, "heavy_hitter", 0.25, layer_budget="pyramid", prompt_compression_strategy="snapkv", head_budget="adakv"
    )
    result = generate(model, [prompt], 6, spec)
    assert [sum(heads) for heads in result.head_budgets[0]] == [
        model.config.n_local_heads * b for b in result.layer_budgets[0]
    ]
    assert len(set(result.layer_budgets[0])) > 1

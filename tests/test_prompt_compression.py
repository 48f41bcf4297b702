"""Prompt compressors against plain reference computations, and --compress_first_token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import paul_graham_text, spec_for
from kvlab import prompt_compression
from kvlab.build import make_caches
from kvlab.engine import generate
from kvlab.prompt_compression import AttentionScores, SnapKV
from kvlab.strategies import PROMPT_COMPRESSORS, L2Cache, make_prompt_compressor


def causal_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Textbook causal attention of one sequence: q [H, T, D], k [H, T, D] -> [H, T, T]."""
    T, D = q.shape[1], q.shape[2]
    scores = q @ k.transpose(-1, -2) / D**0.5
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


@pytest.fixture
def qk():
    torch.manual_seed(0)
    T, D = 40, 8
    q, k = torch.randn(1, 6, T, D), torch.randn(1, 2, T, D)  # 6 query heads share 2 KV heads
    return torch.arange(T)[None], q, k


def test_heavy_hitter_scores_are_column_sums_of_causal_attention(qk):
    input_pos, q, k = qk
    probs = causal_probs(q[0], k[0].repeat_interleave(3, dim=0))  # [6, T, T]
    expected = probs.sum(dim=1).view(2, 3, -1).sum(dim=1)
    torch.testing.assert_close(AttentionScores()(input_pos, k, None, q)[0], expected)


def test_mean_heavy_hitter_divides_by_the_queries_that_saw_each_token(qk):
    input_pos, q, k = qk
    probs = causal_probs(q[0], k[0].repeat_interleave(3, dim=0))  # [6, T, T]; key j is seen by queries j..T-1
    seen = torch.ones(40, 40).tril().sum(dim=0)
    expected = (probs.sum(dim=1) / seen).view(2, 3, -1).sum(dim=1)
    torch.testing.assert_close(AttentionScores(per_query=True)(input_pos, k, None, q)[0], expected)
    padded = torch.where(input_pos < 30, input_pos, -1)  # a row padded after 30 tokens: counts end at its last token
    torch.testing.assert_close(
        AttentionScores(per_query=True)(padded, k, None, q)[0, :, :30],
        AttentionScores(per_query=True)(input_pos[:, :30], k[:, :, :30], None, q[:, :, :30])[0],
    )


def test_tova_scores_are_the_last_query_attention(qk):
    """tova_per_head: summed over each KV head's query group; tova: averaged over all 6 query heads, the same in
    both KV heads (TOVA's paper and kvpress's TOVAPress)."""
    input_pos, q, k = qk
    probs = causal_probs(q[0], k[0].repeat_interleave(3, dim=0))
    torch.testing.assert_close(AttentionScores(1)(input_pos, k, None, q)[0], probs[:, -1].view(2, 3, -1).sum(dim=1))
    torch.testing.assert_close(
        PROMPT_COMPRESSORS["tova_per_head"](input_pos, k, None, q)[0], probs[:, -1].view(2, 3, -1).sum(dim=1)
    )
    torch.testing.assert_close(
        PROMPT_COMPRESSORS["tova"](input_pos, k, None, q)[0], probs[:, -1].mean(dim=0).expand(2, -1)
    )


def test_tova_keeps_the_same_tokens_in_every_head_at_prefill_and_while_decoding():
    """Scored over the layer, every KV head holds the same positions in the same slots after the prompt is
    compressed and after each decode step's eviction; per KV head, the heads part."""
    torch.manual_seed(0)
    T, steps = 24, 6
    q, k, v = torch.randn(1, 6, T + steps, 8), torch.randn(1, 2, T + steps, 8), torch.randn(1, 2, T + steps, 8)
    held = {}
    for name in ("tova", "tova_per_head"):
        cache = make_caches(name, 1, 1, 2, 10, 8, torch.float32, global_tokens=0, recent_window=1)[0]
        cache.prefill(torch.arange(T)[None], k[:, :, :T], v[:, :, :T], q[:, :, :T])
        for t in range(T, T + steps):
            cache.update(torch.tensor([[t]]), k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
            probs = torch.softmax(torch.randn(1, 2, 3, 1, 10), dim=-1)  # a decode step's attention over the slots
            cache.observe(probs)
        held[name] = cache.pos[0]
    assert torch.equal(held["tova"][0], held["tova"][1])
    assert not torch.equal(held["tova_per_head"][0], held["tova_per_head"][1])


@pytest.mark.parametrize(
    "gqa,pooling,reduce",
    [("mean", "max", "sum"), ("max", "avg", "sum"), ("sum", "max", "sum"), ("mean", "avg", "mean")],
)
def test_snapkv_matches_reference(qk, gqa, pooling, reduce):
    """The window's attention summed (the paper's code) or averaged over its queries (kvpress's SnapKVPress: mean over
    the window, average pool, mean over the group, the scale CriticalKV's epsilon is added at). Both pool the keys
    before the window alone, zero-padded at its edge."""
    input_pos, q, k = qk
    window, kernel = 8, 5
    attention = causal_probs(q[0], k[0].repeat_interleave(3, dim=0))[:, -window:]
    probs = (attention.sum(dim=1) if reduce == "sum" else attention.mean(dim=1)).view(2, 3, -1)  # [2, 3, T]
    agg = {"mean": probs.mean(1), "max": probs.max(1).values, "sum": probs.sum(1)}[gqa]
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    expected = pool(agg[:, None, :-window], kernel, stride=1, padding=kernel // 2)[:, 0]
    scores = SnapKV(window=window, kernel=kernel, pooling=pooling, gqa=gqa, window_reduce=reduce)(
        input_pos, k, None, q
    )[0]
    torch.testing.assert_close(scores[:, :-window], expected)
    assert torch.isinf(scores[:, -window:]).all()  # the observation window is always kept


def test_snapkv_handles_padded_rows_shorter_than_the_window(qk):
    input_pos, q, k = qk
    short = torch.where(input_pos < 5, input_pos, -1)  # a 5-token row padded to 40, window 8
    scores = SnapKV(window=8)(short, k, None, q)[0]
    assert torch.isinf(scores[:, :5]).all() and torch.isfinite(scores[:, 5:]).all()


def test_compressor_picks_which_prompt_tokens_a_cache_keeps():
    keys = torch.tensor([5.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 6.0]).view(1, 1, 8, 1)
    recent = L2Cache(
        1,
        1,
        5,
        1,
        torch.float32,
        global_tokens=1,
        recent_window=2,
        prompt_compressor=make_prompt_compressor("recent_global"),
    )
    recent.prefill(torch.arange(8)[None], keys, keys, keys)
    assert recent.pos[0, 0].tolist() == [0, 4, 5, 6, 7]


def test_bad_pairs_and_options_are_rejected():
    with pytest.raises(
        ValueError,
        match="cache strategy 'full' does not take prompt_compression_strategy; it takes: cache_bits, key_quant_axis",
    ):
        make_caches("full", 1, 1, 1, 8, 4, torch.float32, prompt_compression_strategy="snapkv")
    with pytest.raises(
        ValueError, match="unknown prompt compression strategy 'bogus'; choose from: full, recent_global"
    ):
        make_caches("heavy_hitter", 1, 1, 1, 32, 4, torch.float32, prompt_compression_strategy="bogus")
    with pytest.raises(ValueError, match="cache strategy 'hybrid' does not take prompt_compression_strategy"):
        make_caches("hybrid", 1, 1, 1, 32, 4, torch.float32, prompt_compression_strategy="snapkv")
    with pytest.raises(ValueError, match="takes no options"):
        make_caches("l2", 1, 1, 1, 32, 4, torch.float32, prompt_compression_strategy="l2", snapkv_window=4)
    with pytest.raises(ValueError, match="pooling max|avg"):
        make_prompt_compressor("snapkv", snapkv_pooling="median")
    cache = make_caches("window", 1, 1, 1, 16, 1, torch.float32, prompt_compression_strategy="full")[0]
    with pytest.raises(ValueError, match="a prompt of 20 tokens does not fit a cache of 16 slots"):
        cache.prefill(
            torch.arange(20)[None], torch.zeros(1, 1, 20, 1), torch.zeros(1, 1, 20, 1), torch.zeros(1, 1, 20, 1)
        )


def test_compress_first_token_decodes_the_last_prompt_token_through_the_cache(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then the dog chases the fox into the")
    exact = generate(model, [prompt], 6, spec_for(model, "recent_global", 12, recent_window=4)).tokens[0]
    assert exact[0] == generate(model, [prompt], 1).tokens[0][0]  # without it, the first token comes from exact prefill
    compressed = generate(
        model, [prompt], 6, spec_for(model, "recent_global", 12, recent_window=4, compress_first_token=True)
    ).tokens[0]
    caches = make_caches(
        "recent_global",
        model.config.n_layer,
        1,
        model.config.n_local_heads,
        12,
        model.config.head_dim,
        torch.float32,
        recent_window=4,
    )
    model.setup_caches(caches)
    model.cache_key = None
    with torch.no_grad():
        model(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1)[None], prefill=True)
        first = model(torch.tensor([[prompt[-1]]]), torch.tensor([[len(prompt) - 1]]))[0, -1].argmax().item()
    assert compressed[0] == first
    assert (
        generate(model, [prompt], 6, spec_for(model, compress_first_token=True)).tokens[0]
        == generate(model, [prompt], 6).tokens[0]
    )  # full: exact either way


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["heavy_hitter", "heavy_hitter_mean"])
def test_heavy_hitter_takes_the_prefills_log_sum_exp_and_keeps_the_same_tokens(smollm, monkeypatch, compressor):
    """On CPU the prefill hands its attention's log-sum-exp to H2O's prompt scoring (directly and through a
    recorded prefill, which a layer budget planner uses); the tokens generated are those of the softmax
    path, for a batch of two lengths."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(paul_graham_text()[:3000])
    prompts = [ids[:150], ids[200:320]]
    received = []
    real = prompt_compression.received_attention
    monkeypatch.setattr(
        prompt_compression,
        "received_attention",
        lambda *a, lse=None, **kw: received.append(lse is not None) or real(*a, lse=lse, **kw),
    )
    specs = [
        spec_for(model, "heavy_hitter", 48, recent_window=8, prompt_compression_strategy=compressor, layer_budget=b)
        for b in ("uniform", "pyramid")
    ]
    with_lse = [generate(model, prompts, 12, spec).tokens for spec in specs]
    assert received and all(received)
    monkeypatch.setattr(AttentionScores, "uses_lse", False)
    received.clear()
    softmax = [generate(model, prompts, 12, spec).tokens for spec in specs]
    assert received and not any(received)
    assert with_lse == softmax

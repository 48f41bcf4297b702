"""FastGen `hybrid`: per-head policies chosen from prompt attention, and what each policy keeps while decoding."""

from __future__ import annotations

import torch

from conftest import spec_for
from kvlab.engine import generate
from kvlab.hybrid import HybridCache

SPECIAL, PUNCT, WORD = 1, 2, 5


def handmade_cache() -> HybridCache:
    """Three KV heads over a 12-token prompt: special token at 0, punctuation at 4 and 8. Head 0's queries
    match only the special key, head 1's only punctuation keys, head 2 attends uniformly."""
    tokens = torch.full((1, 12), WORD)
    tokens[0, 0], tokens[0, 4], tokens[0, 8] = SPECIAL, PUNCT, PUNCT
    k = torch.zeros(1, 3, 12, 2)
    k[:, :, 0, 0] = 10.0
    k[:, :, [4, 8], 1] = 10.0
    q = torch.zeros(1, 3, 12, 2)
    q[:, 0, :, 0] = 5.0
    q[:, 1, :, 1] = 5.0
    cache = HybridCache(1, 3, 16, 2, torch.float32, global_tokens=0, special_ids=(SPECIAL,), punctuation_ids=(PUNCT,))
    cache.profile_queries = 8  # the last 8 queries (positions 4..11), which all see a punctuation token
    cache.prefill(torch.arange(12)[None], k, k.clone(), q, tokens=tokens)
    return cache


def held(cache: HybridCache, head: int) -> list[int]:
    return sorted(p for p in cache.pos[0, head].tolist() if p >= 0)


def test_each_head_gets_the_cheapest_policy_that_recovers_its_attention():
    cache = handmade_cache()
    assert [cache.policies[p] for p in cache.policy[0].tolist()] == ["special", "special+punct", "full"]
    assert held(cache, 0) == [0]
    assert held(cache, 1) == [0, 4, 8]
    assert held(cache, 2) == list(range(12))
    assert cache.stats() == {
        "heads special": 1,
        "heads special+punct": 1,
        "heads special+punct+heavy": 0,
        "heads special+punct+heavy+window": 0,
        "heads full": 1,
    }


def test_decoding_keeps_what_each_policy_covers_and_attends_the_incoming_token_once():
    cache = handmade_cache()
    kv = torch.zeros(1, 3, 1, 2)
    for position, token in [(12, PUNCT), (13, WORD)]:
        _, _, pos = cache.update(
            torch.tensor([[position]]), kv, kv, torch.zeros(1, 3, 1, 2), tokens=torch.tensor([[token]])
        )
    assert held(cache, 0) == [0, 13]  # the punctuation at 12 was attended once, then dropped
    assert held(cache, 1) == [0, 4, 8, 12, 13]
    assert held(cache, 2) == list(range(14))


def test_heavy_and_window_policies_keep_their_share_of_the_sequence():
    cache = HybridCache(1, 1, 32, 1, torch.float32, global_tokens=0, heavy_hitter_frac=0.25, window_frac=0.25)
    n = torch.tensor(20).view(1, 1, 1)
    pos = torch.arange(20).view(1, 1, 20)
    classes = torch.zeros(1, 1, 20, dtype=torch.uint8)
    scores = torch.zeros(1, 1, 20)
    scores[0, 0, [2, 5, 7, 9, 11, 17]] = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 9.0])
    heavy = cache._covered(torch.full((1, 1, 1), 2), pos, classes, scores, n)
    assert heavy[0, 0].nonzero().flatten().tolist() == [2, 5, 7, 9, 17]  # the top 25% of 20 tokens
    windowed = cache._covered(torch.full((1, 1, 1), 3), pos, classes, scores, n)
    # newest 5, then the top 5 of the rest
    assert windowed[0, 0].nonzero().flatten().tolist() == [2, 5, 7, 9, 11, 15, 16, 17, 18, 19]


def test_hybrid_generates_with_a_model_and_stronger_recovery_keeps_more(tiny_model):
    prompts = [[1, 9, 27, 17, 2, 25, 11, 33, 5, 40, 2, 6, 9, 12, 2, 30], [1, 21, 63, 2, 8, 7]]
    held_tokens = []
    for frac in (0.5, 0.99):
        spec = spec_for(
            tiny_model, "hybrid", token_classes=dict(special_ids=(1,), punctuation_ids=(2,)), min_recovery_frac=frac
        )
        result = generate(tiny_model, prompts, 12, spec)
        assert sum(result.cache_stats.values()) == 2 * 2 * 2  # layers x sequences x KV heads
        held_tokens.append(sum(result.tokens_held))
    assert held_tokens[0] < held_tokens[1]


def test_decoded_tokens_accumulate_the_attention_they_receive_under_a_heavy_policy():
    """Issue 15: decoded tokens used to keep score 0, so "heavy" ranked by the prefill profile only."""
    cache = handmade_cache()
    cache.policy.fill_(cache.policies.index("special+punct+heavy"))
    prompt_scores = cache.scores.clone()
    kv = torch.zeros(1, 3, 1, 2)
    received = {}  # decoded position -> attention mass it received, per head
    for step, position in enumerate(range(12, 16)):
        _, _, pos = cache.update(
            torch.tensor([[position]]), kv, kv, torch.zeros(1, 3, 1, 2), tokens=torch.tensor([[WORD]])
        )
        # Attention that favours newer slots: weight 1 + step + position/10 on every held slot, normalised.
        weights = torch.where(cache.pos >= 0, 1.0 + step + cache.pos.float() / 10, 0.0)
        probs = (weights / weights.sum(dim=-1, keepdim=True))[:, :, None, None, :]  # [B, H_kv, group, 1, S]
        cache.observe(probs)
        for head in range(3):
            for slot, p in enumerate(cache.pos[0, head].tolist()):
                if p >= 12:
                    received[(head, p)] = received.get((head, p), 0.0) + probs[0, head, 0, 0, slot].item()
    decoded = 0
    for head in range(3):
        for slot, p in enumerate(cache.pos[0, head].tolist()):
            if p >= 12:
                decoded += 1
                assert cache.scores[0, head, slot].item() > 0
                assert abs(cache.scores[0, head, slot].item() - received[(head, p)]) < 1e-5
    assert decoded > 0
    # Prompt tokens still held also gain the decoded steps' attention on top of their prefill profile.
    for head in range(3):
        for slot, p in enumerate(cache.pos[0, head].tolist()):
            if 0 <= p < 12:
                assert cache.scores[0, head, slot].item() > prompt_scores[0, head, slot].item()

"""Each score is written once (kvlab/scores.py) and applied by the bases to the prompt and to the cache:
the scores agree with direct computations, and a key-scored strategy ranks its prompt and its cache
with the very same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from kvlab.attention import causal_attention_lse
from kvlab.build import make_caches
from kvlab.config import CACHE_KEYS, options_table
from kvlab.expected_attention import ExpectedAttention
from kvlab.model import ModelArgs, apply_rope, rope_tables
from kvlab.prompt_compression import RKV, KeyScores
from kvlab.scores import (
    attention_mass,
    chunk_mean,
    keydiff,
    lagkv,
    pool_keys,
    prompt_attention,
    received_attention,
    rkv,
    window_attention,
)
from kvlab.strategies import (
    CACHE_STRATEGIES,
    PROMPT_COMPRESSORS,
    ExpectedAttentionCache,
    KeyDiffCache,
    RKVCache,
    make_prompt_compressor,
)


def test_keydiff_is_minus_the_cosine_to_the_mean_of_held_unit_keys():
    """KeyDiff's anchor (and kvpress's): the mean of the held keys scaled to unit length, which differs from the
    plain mean key when the norms differ (scaled here from 0.1 to 10)."""
    torch.manual_seed(0)
    k = torch.randn(2, 3, 7, 8) * torch.logspace(-1, 1, 7)[:, None]
    pos = torch.arange(7).expand(2, 3, 7).clone()
    pos[1, :, 5:] = -1  # empty slots do not count towards the anchor
    scores = keydiff(k, pos)
    for b, held in ((0, 7), (1, 5)):
        keys = k[b, :, :held]
        anchor = (keys / keys.norm(dim=-1, keepdim=True)).mean(dim=1, keepdim=True)
        torch.testing.assert_close(scores[b, :, :held], -F.cosine_similarity(keys, anchor, dim=-1))
        assert not torch.allclose(
            scores[b, :, :held], -F.cosine_similarity(keys, keys.mean(dim=1, keepdim=True), dim=-1), atol=1e-3
        )


def test_keydiff_prompt_and_cache_share_one_score():
    assert KeyDiffCache.key_score is keydiff
    assert isinstance(PROMPT_COMPRESSORS["keydiff"], KeyScores) and PROMPT_COMPRESSORS["keydiff"].score is keydiff
    cache = make_caches("keydiff", 1, 1, 2, 12, 8, torch.float32, recent_window=1, global_tokens=0)[0]
    assert cache.prompt_compressor.score is keydiff


def test_keydiff_evicts_the_key_closest_to_the_mean():
    """Keys 0..5 point one way except key 3; the incoming token replaces the most typical one, never key 3."""
    torch.manual_seed(1)
    base = torch.randn(8)
    keys = base + 0.01 * torch.randn(6, 8)
    keys[3] = -base
    k = keys[None, None]  # [1, 1, 6, 8]
    cache = make_caches("keydiff", 1, 1, 1, 6, 8, torch.float32, recent_window=1, global_tokens=0)[0]
    input_pos = torch.arange(6)[None]
    cache.prefill(input_pos, k, k, torch.randn(1, 1, 6, 8))
    expected = int(keydiff(k, input_pos[:, None]).argmin())
    cache.update(torch.tensor([[6]]), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
    assert expected != 3 and cache.pos[0, 0].tolist() == [6 if i == expected else i for i in range(6)]


def test_window_attention_is_the_last_queries_rows_of_full_prompt_attention():
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 10, 16), torch.randn(2, 2, 10, 16)
    input_pos = torch.arange(10).expand(2, 10).clone()
    input_pos[1, 7:] = -1  # a shorter, right-padded row
    full = prompt_attention(q, k, input_pos, input_pos)  # [B, H_kv, group, T, T]
    window = window_attention(input_pos, k, q, 4)
    torch.testing.assert_close(window[0], full[0, :, :, 6:10])
    torch.testing.assert_close(window[1], full[1, :, :, 3:7])
    torch.testing.assert_close(window_attention(input_pos, k, q, None), full)
    assert window_attention(input_pos, k, q, 32).shape[3] == 10  # never more queries than the prompt has


def test_pool_keys_matches_max_and_avg_pooling():
    scores = torch.rand(2, 3, 11)
    for kind, pool in (("max", F.max_pool1d), ("avg", F.avg_pool1d)):
        expected = pool(scores.reshape(6, 1, 11), 5, stride=1, padding=2).view(2, 3, 11)
        torch.testing.assert_close(pool_keys(scores, 5, kind), expected)


ROPE = rope_tables(
    ModelArgs(
        vocab_size=1,
        n_layer=1,
        n_head=4,
        n_local_heads=2,
        dim=32,
        intermediate_size=1,
        rope_base=100.0,
        block_size=1024,
    )
)


def rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's RoPE of x [..., T, D] at positions [T]."""
    return apply_rope(x, ROPE[0][positions], ROPE[1][positions])


def brute_force_logits(x: torch.Tensor, keys: torch.Tensor, observed: slice, now: int, future: int) -> torch.Tensor:
    """Expected attention logits of one sequence, from its pre-RoPE queries x [H, T, D] and keys [H_kv, S, D]:
    the Gaussian of x[:, observed], its mean explicitly rotated to each of positions now..now+future-1 and
    averaged, its covariance turned by the averaged rotation matrix -> [H, S]."""
    H, _, D = x.shape
    obs = x[:, observed]
    mean = obs.mean(dim=1)
    cov = torch.stack([(o - m).T @ (o - m) / o.shape[0] for o, m in zip(obs, mean, strict=True)])
    positions = torch.arange(now, now + future)
    mean_future = torch.stack([rotated(mean[:, None], positions[j : j + 1])[:, 0] for j in range(future)]).mean(dim=0)
    # mean of R(p)
    rotation = torch.stack([rotated(torch.eye(D), torch.full((D,), int(p))).T for p in positions]).mean(dim=0)
    cov_future = rotation @ cov @ rotation.T
    k = keys.repeat_interleave(H // keys.shape[0], dim=0)  # [H, S, D]
    quadratic = torch.einsum("hsd,hde,hse->hs", k, cov_future, k)
    return torch.einsum("hsd,hd->hs", k, mean_future) / D**0.5 + quadratic / (2 * D)


def test_expected_attention_matches_explicitly_rotated_queries():
    """Scores of the compressor == softmax over the non-sink keys of the brute-force expected logits, mean over each
    KV head's query group, sinks kept; a padded row scores like its unpadded prompt."""
    torch.manual_seed(0)
    T, D, future = 14, 8, 6
    x = torch.randn(1, 4, T, D) + torch.randn(1, 4, 1, D)  # pre-RoPE queries with a non-zero mean
    q = rotated(x, torch.arange(T))
    k, v = torch.randn(1, 2, T, D), torch.randn(1, 2, T, D)
    compressor = ExpectedAttention(window=7, future=future).with_rope(ROPE)
    logits = brute_force_logits(x[0], k[0], slice(T - 7, T), T, future)  # window 7: queries 7..13, all past the 4 sinks
    probs = logits[:, 4:].softmax(dim=-1).view(2, 2, -1).mean(dim=1)
    scores = compressor(torch.arange(T)[None], k, v, q)[0]
    torch.testing.assert_close(scores[:, 4:], probs)
    # sinks first, as kvpress
    torch.testing.assert_close(scores[:, :4], probs.max(dim=-1, keepdim=True).values.expand(2, 4) + 1)
    whole = ExpectedAttention(future=future).with_rope(ROPE)  # every query but the 4 sinks
    expected = brute_force_logits(x[0], k[0], slice(4, T), T, future)[:, 4:].softmax(dim=-1).view(2, 2, -1).mean(dim=1)
    torch.testing.assert_close(whole(torch.arange(T)[None], k, v, q)[0, :, 4:], expected)
    short = torch.where(torch.arange(T + 3) < T, torch.arange(T + 3), -1)[None]  # the same prompt right-padded by 3
    padded = whole(short, F.pad(k, (0, 0, 0, 3)), F.pad(v, (0, 0, 0, 3)), F.pad(q, (0, 0, 0, 3)))[0]
    torch.testing.assert_close(padded[:, 4:T], expected)


def test_expected_attention_cache_scores_decoded_keys_under_the_prompts_gaussian():
    """The strategy keeps the prompt's Gaussian and normaliser: every held key, prompt or decoded, scores
    mean over the group of exp(logit - log sum over the keys held at prefill of exp(logit)) x ||v||."""
    torch.manual_seed(1)
    T, D = 10, 8
    x = torch.randn(1, 4, T, D)
    q = rotated(x, torch.arange(T))
    k, v = torch.randn(1, 2, T + 1, D), torch.randn(1, 2, T + 1, D)
    cache = ExpectedAttentionCache(1, 2, 12, D, torch.float32, rope=ROPE, global_tokens=0, recent_window=1)
    assert cache.expected.rope is ROPE and cache.expected.future == 512
    cache.prefill(torch.arange(T)[None], k[:, :, :T], v[:, :, :T], q)
    cache.update(torch.tensor([[T]]), k[:, :, T:], v[:, :, T:], torch.randn(1, 4, 1, D))
    logits = brute_force_logits(x[0], k[0], slice(4, T), T, 512).view(2, 2, T + 1)
    expected = (logits - logits[..., :T].logsumexp(dim=-1, keepdim=True)).exp().mean(dim=1) * v[0].norm(dim=-1)
    torch.testing.assert_close(cache.scores[0, :, : T + 1], expected)


def test_chunk_mean_gives_each_token_its_chunks_mean_and_a_cache_keeps_whole_chunks():
    torch.manual_seed(0)
    scores = torch.rand(2, 3, 23)
    input_pos = torch.arange(23).expand(2, 23).clone()
    input_pos[1, 17:] = -1  # padding counts for nothing: the row's last chunk is 15, 16
    chunked = chunk_mean(scores, input_pos, 5)
    for row, length in ((0, 23), (1, 17)):
        for start in range(0, length, 5):
            chunk = slice(start, min(start + 5, length))
            torch.testing.assert_close(
                chunked[row, :, chunk], scores[row, :, chunk].mean(dim=-1, keepdim=True).expand(3, chunk.stop - start)
            )
    q, k = torch.randn(1, 6, 40, 8), torch.randn(1, 2, 40, 8)
    options = dict(
        prompt_compression_strategy="snapkv", snapkv_window=4, chunk_size=5, global_tokens=0, recent_window=1
    )
    cache = make_caches("heavy_hitter", 1, 1, 2, 15, 8, torch.float32, **options)[0]
    cache.prefill(torch.arange(40)[None], k, k, q)
    snapkv = make_prompt_compressor("snapkv", snapkv_window=4)(torch.arange(40)[None], k, k, q)[:, :, :35]
    per_head = chunk_mean(snapkv, torch.arange(35)[None], 5)[0, :, ::5]  # [head, chunk]
    # ChunkKVPress: chunks ranked by their mean over the heads
    best = sorted(per_head.mean(dim=0).topk(2).indices.tolist())
    assert per_head[0].topk(2).indices.sort().values.tolist() != per_head[1].topk(2).indices.sort().values.tolist()
    # the window's chunk (35..39) and the two best others, whole, the same in every head
    for head in cache.pos[0].tolist():
        assert sorted(head) == [p for c in (*best, 7) for p in range(5 * c, 5 * c + 5)]


def test_value_weight_ranks_prompt_tokens_by_score_times_value_norm():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8) * torch.rand(1, 1, 30, 1) * 4
    options = dict(prompt_compression_strategy="heavy_hitter", global_tokens=0, recent_window=1)
    weighted = make_caches("tova", 1, 1, 1, 10, 8, torch.float32, value_weight="norm", value_epsilon=0.01, **options)[0]
    weighted.prefill(torch.arange(30)[None], k, v, q)
    scores = (PROMPT_COMPRESSORS["heavy_hitter"](torch.arange(30)[None], k, v, q)[0, 0, :29] + 0.01) * v[
        0, 0, :29
    ].norm(dim=-1)
    assert sorted(weighted.pos[0, 0].tolist()) == sorted([29, *scores.topk(9).indices.tolist()])
    # kvpress's default for it
    assert CACHE_STRATEGIES["expected_attention"](1, 1, 16, 4, torch.float32).value_weight == "norm"
    assert CACHE_STRATEGIES["heavy_hitter"](1, 1, 16, 4, torch.float32).value_weight == "none"


def test_lagkv_normalises_each_partition_by_the_next_ones_range():
    """2 sinks, partitions of 3: positions 2-4 and 5-7 are scored against 5-7 and 8-10; 8-10 and 11 have no
    complete successor and are kept (recency order), the sinks above all."""
    torch.manual_seed(0)
    k, v = torch.randn(1, 1, 12, 5), torch.randn(1, 1, 12, 5)
    pos = torch.arange(12).view(1, 1, 12)
    scores = lagkv(k, v, pos, 3, 2)[0, 0]

    def spread(x: torch.Tensor, start: int) -> torch.Tensor:
        ref = x[0, 0, start + 3 : start + 6]
        low, high = ref.min(dim=0).values, ref.max(dim=0).values
        return ((x[0, 0, start : start + 3] - low) / (high - low)).std(dim=-1).softmax(dim=-1)

    for start in (2, 5):
        direct = (spread(k, start) + spread(v, start)) / 2
        rank = direct.argsort().argsort().float()
        torch.testing.assert_close(scores[start : start + 3], rank + direct)
    torch.testing.assert_close(scores[8:], 3 + torch.arange(8, 12) / 12)
    assert scores[:2].tolist() == [4.0, 4.0]
    shuffled = torch.randperm(12)  # the running cache: any slot order, empty slots anywhere
    held = torch.cat([pos[..., shuffled], torch.full((1, 1, 3), -1)], dim=-1)
    padded = lagkv(F.pad(k[:, :, shuffled], (0, 0, 0, 3)), F.pad(v[:, :, shuffled], (0, 0, 0, 3)), held, 3, 2)[0, 0]
    scored = shuffled < 8
    torch.testing.assert_close(padded[:12][scored], scores[shuffled][scored])
    assert torch.equal(padded[:12].argsort(), scores[shuffled].argsort())  # the kept ones too, in recency order
    # no complete successor: recency alone
    assert (lagkv(k[..., :7, :], v[..., :7, :], pos[..., :7], 3, 2)[0, 0] >= 3).all()


def rkv_direct(importance: torch.Tensor, keys: torch.Tensor, positions: list[int], mix: float) -> torch.Tensor:
    """R-KV's score of one head's held keys [S, D], entry by entry: each key's cosine similarity to the newest other
    key it resembles (> 0.5) left out, the mean similarity per key softmaxed into redundancy."""
    S = len(keys)
    sim = torch.tensor(
        [[F.cosine_similarity(keys[i], keys[j], dim=0).item() if i != j else 0.0 for j in range(S)] for i in range(S)]
    )
    newest = [max((j for j in range(S) if sim[i, j] > 0.5), key=lambda j: positions[j], default=None) for i in range(S)]
    for i, j in enumerate(newest):
        if j is not None:
            sim[i, j] = 0.0
    return mix * importance - (1 - mix) * (sim.sum(dim=0) / S).softmax(dim=0)


def test_rkv_evicts_the_older_of_two_near_duplicate_keys():
    """Key 4 nearly repeats key 1: the prompt compressor's and the cache's scores equal the direct computation
    (importance: the last 4 queries' attention, group-averaged, max-pooled), and the incoming token replaces key 1,
    where importance alone would have evicted key 4."""
    torch.manual_seed(0)
    T, D, w = 7, 8, 4
    k, v, q = torch.randn(1, 1, T, D), torch.randn(1, 1, T, D), torch.randn(1, 2, T, D)
    k[0, 0, 4] = k[0, 0, 1] + 0.05 * torch.randn(D)
    probs = (
        (q[0] @ k[0].transpose(-1, -2) / D**0.5)
        .masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        .softmax(-1)
        .mean(0)
    )
    importance = F.max_pool1d(probs[-w:].sum(dim=0)[None, None] / w, 7, stride=1, padding=3)[0, 0]
    expected = rkv_direct(importance, k[0, 0], list(range(T)), 0.1)
    torch.testing.assert_close(RKV(window=w)(torch.arange(T)[None], k, v, q)[0, 0], expected)
    cache = RKVCache(1, 1, T, D, torch.float32, global_tokens=0, recent_window=1, prompt_compressor=RKV(window=w))
    cache.prefill(torch.arange(T)[None], k, v, q)
    torch.testing.assert_close(cache._token_importances()[0, 0], expected)  # the ring holds the prompt's last 4 queries
    cache.update(torch.tensor([[T]]), torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D), torch.randn(1, 2, 1, D))
    assert (
        int(expected.argmin()) == 1
        and int(importance.argmin()) == 4
        and cache.pos[0, 0].tolist() == [0, T, 2, 3, 4, 5, 6]
    )
    for slot in range(w):  # w decoded queries, each all on one slot, push the prompt's out of the ring
        cache.observe(F.one_hot(torch.tensor(slot), T).float().expand(1, 1, 2, 1, T))
    assert cache.recent.sum(dim=-1)[0, 0].tolist() == [1.0] * w + [0.0] * (T - w)
    shuffled = torch.randperm(T)  # any slot order, empty slots anywhere
    held = F.pad(torch.arange(T)[shuffled], (0, 2), value=-1).view(1, 1, -1)
    scores = rkv(F.pad(importance[shuffled], (0, 2)).view(1, 1, -1), F.pad(k[:, :, shuffled], (0, 0, 0, 2)), held, 0.1)[
        0, 0
    ]
    torch.testing.assert_close(scores[:T], expected[shuffled])


def test_every_declared_option_is_a_setting_and_in_the_table():
    """Options are declared once, with what uses them: each strategy's and compressor's options reach
    CACHE_KEYS (flags, YAML) and the generated table."""
    declared = {o.name for cls in CACHE_STRATEGIES.values() for o in cls.options}
    declared |= {o.name for c in PROMPT_COMPRESSORS.values() for o in c.options}
    assert declared <= set(CACHE_KEYS)
    table = options_table()
    assert all(f"| `--{name}` |" in table for name in CACHE_KEYS)


def test_readme_table_is_the_generated_one():
    """The README's settings table is derived from the declarations (regenerate: python -m kvlab.config)."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index("<!-- options:start -->\n"), readme.index("<!-- options:end -->")
    assert readme[start + len("<!-- options:start -->\n") : end].strip() == options_table()


def test_received_attention_equals_the_whole_matrix_summed_without_building_it():
    """H2O's prompt scores in chunks over only the keys each chunk sees equal the summed [T, T]
    probabilities (1e-5), padded rows included; the per-chunk reduction is the caller's (KV-Compress)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 300, 16), torch.randn(2, 2, 300, 16)
    input_pos = torch.arange(300).expand(2, 300).clone()
    input_pos[1, 170:] = -1  # a shorter row, right-padded
    whole = prompt_attention(q, k, input_pos, input_pos)
    torch.testing.assert_close(
        received_attention(q, k, input_pos, chunk=64), attention_mass(whole), atol=1e-5, rtol=1e-5
    )
    squared = received_attention(q, k, input_pos, lambda probs, query_pos: probs.square().sum(dim=(2, 3)), chunk=100)
    torch.testing.assert_close(squared, whole.square().sum(dim=(2, 3)), atol=1e-5, rtol=1e-5)
    input_pos[0, 40:50] = -1  # padding inside a row: later chunks must mask it, not only their own diagonal
    holes = received_attention(q, k, input_pos, chunk=64)
    torch.testing.assert_close(
        holes, attention_mass(prompt_attention(q, k, input_pos, input_pos)), atol=1e-5, rtol=1e-5
    )
    assert (holes[0, :, 40:50] == 0).all() and (holes[1, :, 170:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_received_attention_from_the_prefills_log_sum_exp_equals_the_softmax_path(dtype):
    """H2O's prompt scores from the log-sum-exp the CPU flash kernel returns with the prefill's attention
    equal those from normalising the softmax again (1e-5 of the largest score), right-padded rows
    included; padding inside a row falls back to the softmax path, where that log-sum-exp would be wrong."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 6, 300, 16, dtype=dtype),
        torch.randn(2, 2, 300, 16, dtype=dtype),
        torch.randn(2, 2, 300, 16, dtype=dtype),
    )
    input_pos = torch.arange(300).expand(2, 300).clone()
    input_pos[1, 170:] = -1
    _, lse = causal_attention_lse(q, k, v)
    expected = received_attention(q.float(), k.float(), input_pos, chunk=64)
    got = received_attention(q, k, input_pos, chunk=64, lse=lse)
    torch.testing.assert_close(
        got, expected, atol=1e-5 * expected.max().item(), rtol=1e-3 if dtype == torch.bfloat16 else 1e-5
    )
    assert (got[1, :, 170:] == 0).all() and got.isfinite().all()
    input_pos[0, 40:50] = -1
    assert torch.equal(
        received_attention(q, k, input_pos, chunk=64, lse=lse), received_attention(q, k, input_pos, chunk=64)
    )


def test_prompt_attention_equals_textbook_softmax():
    """Probabilities from one explicit masked softmax per query (GQA by repeating keys): 1e-5, padding
    queries' rows zero, padding keys never attended."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 20, 8), torch.randn(2, 2, 20, 8)
    pos = torch.arange(20).expand(2, 20).clone()
    pos[1, 12:] = -1
    pos[0, 5] = -1
    got = prompt_attention(q, k, pos, pos, chunk=7)  # [2, 2, 2, 20, 20]
    keys = k.repeat_interleave(2, dim=1)
    for b in range(2):
        for h in range(4):
            for i in range(20):
                row = got[b, h // 2, h % 2, i]
                if pos[b, i] < 0:
                    assert (row == 0).all()
                    continue
                seen = (pos[b] >= 0) & (pos[b] <= pos[b, i])
                logits = (keys[b, h] @ q[b, h, i]) / 8**0.5
                expected = torch.where(seen, logits, float("-inf")).softmax(-1)
                torch.testing.assert_close(row, expected, atol=1e-6, rtol=1e-5)

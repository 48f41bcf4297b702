"""Recallable caches (recall.py): k-means, what each step attends, exactness with a budget covering the
sequence, the slow tier keeping every token, periodic clustering, compiled == eager, batch == alone,
and the top-B recall diagnostic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import spec_for
from kvlab.cache import FullCache
from kvlab.clusterkv import ClusterKVCache, cosine_kmeans
from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config, resolve_settings
from kvlab.diagnostics import AttentionLossProbe
from kvlab.engine import compile_decode_step, generate
from kvlab.quest import QuestCache
from kvlab.strategies import WindowCache
from test_generate import run_cli
from tolerance import assert_reordered_close

RECALLABLE = {"clusterkv": ClusterKVCache, "quest": QuestCache}


def test_kmeans_assigns_every_key_to_its_most_similar_centroid_and_finds_the_groups():
    g = torch.Generator().manual_seed(0)
    directions = F.normalize(torch.randn(3, 16, generator=g), dim=-1)
    group = torch.arange(90) % 3
    # lengths vary: cosine ignores them
    x = (directions[group] + 0.05 * torch.randn(90, 16, generator=g)) * torch.rand(90, 1, generator=g).add(0.5)
    x = torch.stack([x, x.flip(0)])[:, None]  # [2 rows, 1 head, 90, 16]
    valid = torch.ones(2, 1, 90, dtype=torch.bool)
    centroids, labels = cosine_kmeans(x, valid, 3)
    nearest = (F.normalize(x, dim=-1) @ F.normalize(centroids, dim=-1).transpose(-1, -2)).argmax(dim=-1)
    assert torch.equal(labels, nearest)
    for row, groups in enumerate((group, group.flip(0))):
        pairs = set(zip(groups.tolist(), labels[row, 0].tolist(), strict=True))
        assert len(pairs) == 3 and len({label for _, label in pairs}) == 3  # one cluster per group, no mixing


def test_kmeans_handles_empty_clusters_and_invalid_points():
    # two distinct directions among valid points, asked for 3
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])[None]
    valid = torch.tensor([[True, True, True, False]])
    centroids, labels = cosine_kmeans(x, valid, 3)
    assert centroids.isfinite().all() and labels[0, 3] == -1
    assert labels[0, 0] == labels[0, 1] != labels[0, 2]


@pytest.mark.parametrize("strategy", sorted(RECALLABLE))
@pytest.mark.parametrize("select", ["kv_head", "query_head"])
def test_each_step_attends_exactly_the_budget_with_sinks_and_recent_tokens(strategy, select):
    torch.manual_seed(0)
    B, H_kv, group, T, D, budget = 2, 2, 2, 100, 8, 40
    options = (
        dict(cluster_every=6, new_clusters=2, tokens_per_cluster=10) if strategy == "clusterkv" else dict(page_size=8)
    )
    cache = RECALLABLE[strategy](
        B,
        H_kv,
        budget,
        D,
        torch.float32,
        history=120,
        n_heads=H_kv * group,
        sink_tokens=4,
        recall_select=select,
        **options,
    )
    lengths = torch.tensor([100, 70])
    input_pos = torch.where(torch.arange(T) < lengths[:, None], torch.arange(T), -1)
    cache.prefill(input_pos, torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv * group, T, D))
    heads = H_kv if select == "kv_head" else H_kv * group
    for step in range(14):
        current = (lengths + step)[:, None]
        keys, values, pos = cache.update(
            current, torch.randn(B, H_kv, 1, D), torch.randn(B, H_kv, 1, D), torch.randn(B, H_kv * group, 1, D)
        )
        cache.maintain()
        assert keys.shape == (B, heads, budget, D) and pos.shape == (B, heads, budget)
        for row in range(B):
            n = int(current[row]) + 1
            recent = range(int(cache.indexed_upto[row]) if strategy == "clusterkv" else int(current[row]) // 8 * 8, n)
            for head in range(heads):
                attended = pos[row, head].tolist()
                assert len(set(attended)) == budget and all(0 <= p < n for p in attended)
                assert set(range(4)) | set(recent) <= set(attended)
        assert torch.equal(
            keys,
            cache.storage.k.repeat_interleave(heads // H_kv, dim=1).gather(2, pos[..., None].expand(-1, -1, -1, D)),
        )
    if strategy == "clusterkv":  # 14 steps: clustered twice (every 6), 2 tokens still unclustered
        assert cache.n_clusters == 10 + 2 * 2 and cache.indexed_upto.view(-1).tolist() == [112, 82]
        assert cache.labels[0, :, 100:112].min() >= 10 and cache.labels[0, :, 100:112].max() < 14


def test_quest_page_score_is_the_largest_dot_product_the_page_bounds_allow():
    torch.manual_seed(0)
    cache = QuestCache(1, 1, 20, 4, torch.float32, history=32, n_heads=1, sink_tokens=0, page_size=8)
    k = torch.randn(1, 1, 32, 4)
    cache.prefill(torch.arange(32)[None], k, k, torch.zeros(1, 1, 32, 4))
    q = torch.randn(1, 1, 1, 4)
    scores = cache._scores(q)[0, 0]
    for page in range(4):
        box = k[0, 0, page * 8 : (page + 1) * 8]
        bound = torch.maximum(q[0, 0, 0] * box.min(dim=0).values, q[0, 0, 0] * box.max(dim=0).values).sum()
        assert torch.allclose(scores[page * 8 : (page + 1) * 8], bound.expand(8))
        assert bound >= (box @ q[0, 0, 0]).max() - 1e-6


@pytest.mark.parametrize("strategy", sorted(RECALLABLE))
@pytest.mark.parametrize("select", ["kv_head", "query_head"])
def test_a_budget_covering_the_sequence_equals_the_full_cache(smollm, strategy, select):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode("The history of the printing press begins in the fifteenth century, in Mainz. " * 6)
    full = generate(model, [prompt], 12, spec_for(model, "full")).tokens
    n = len(prompt) + 12
    # quest takes no cluster_every (old generate() dropped it for quest)
    clustering = dict(cluster_every=5) if strategy == "clusterkv" else {}
    assert (
        generate(model, [prompt], 12, spec_for(model, strategy, n, recall_select=select, **clustering)).tokens == full
    )


@pytest.mark.parametrize("strategy", sorted(RECALLABLE))
def test_slow_tier_keeps_every_token(smollm, strategy):
    """Every position's keys stay as a full cache holds them for the same tokens: all layers for the prompt;
    layer 0 (whose keys depend on the token alone) for generated tokens too. The two runs differ only in
    summation order (the full cache prefills prompt and generated tokens at once), so layer l's keys agree
    to the rounding of l + 1 layers of sums of up to intermediate_size terms (tests/tolerance.py), and
    layer 0's to one sum of dim terms: measured 5e-6 at most, bounds 2e-4 (layer 0) to 3e-2 (layer 29).
    Keys stored in float16 (4e-3 off at layer 0) fail the layer-0 bound."""
    model, tokenizer, _ = smollm
    a = model.config
    prompt = tokenizer.encode("Photosynthesis is the process by which plants turn light into sugar. " * 8)
    generated = generate(model, [prompt], 20, spec_for(model, strategy, 32, sink_tokens=4)).tokens[0]
    slow = [layer.attention.kv_cache.storage.k.clone() for layer in model.layers]
    n = len(prompt) + 19  # the last generated token is never written
    assert model.layers[3].attention.kv_cache.pos[0, :n].tolist() == list(range(n))
    generate(model, [prompt + generated[:19]], 1, spec_for(model, "full"))
    full = [layer.attention.kv_cache.storage.k for layer in model.layers]
    for layer, (s, f) in enumerate(zip(slow, full, strict=True)):
        assert_reordered_close(
            s[:, :, : len(prompt)], f[:, :, : len(prompt)], terms=a.intermediate_size, chain=layer + 1
        )
    assert_reordered_close(slow[0][:, :, :n], full[0][:, :, :n], terms=a.dim)
    with pytest.raises(AssertionError):
        assert_reordered_close(slow[0][:, :, :n].half().float(), full[0][:, :, :n], terms=a.dim)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(RECALLABLE))
def test_recallable_compiled_equals_eager_and_batch_equals_alone(tiny_model, strategy):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    options = (
        dict(sink_tokens=2, tokens_per_cluster=4, cluster_every=5, new_clusters=2)
        if strategy == "clusterkv"
        else dict(sink_tokens=2, page_size=4)
    )
    spec = spec_for(tiny_model, strategy, 10, **options)
    kwargs = dict(max_seq_length=44)
    eager = generate(tiny_model, prompts, 24, spec, **kwargs)
    assert [generate(tiny_model, [p], 24, spec, **kwargs).tokens[0] for p in prompts] == eager.tokens
    torch._dynamo.reset()
    compiled = generate(tiny_model, prompts, 24, spec, decode_step=compile_decode_step(torch.device("cpu")), **kwargs)
    assert compiled.tokens == eager.tokens and compiled.cache_stats == eager.cache_stats


def test_recall_diagnostic_counts_the_attended_share_of_the_full_top_b():
    torch.manual_seed(0)
    H_kv, group, D, T = 2, 2, 8, 30
    window, full = WindowCache(1, H_kv, 12, D, torch.float32, recent_window=1), FullCache(1, H_kv, 40, D, torch.float32)
    probe = AttentionLossProbe(window, full)
    k, q = torch.randn(1, H_kv, T, D), torch.randn(1, H_kv * group, T, D)
    probe.prefill(torch.arange(T)[None], k, k, q)
    k_new, q_new = torch.randn(1, H_kv, 1, D), torch.randn(1, H_kv * group, 1, D)
    _, _, pos = probe.update(torch.tensor([[T]]), k_new, k_new, q_new)
    keys = torch.cat([k, k_new], dim=2)
    expected = []
    for head in range(H_kv * group):
        probs = (q_new[0, head, 0] @ keys[0, head // group].T / D**0.5).softmax(dim=-1)
        top = set(probs.topk(12).indices.tolist())
        expected.append(len(top & set(pos[0, head // group].tolist())) / 12)
    assert probe.recalls[0].item() == pytest.approx(sum(expected) / len(expected))


def test_full_layers_and_recallable_settings(smollm):
    tokenizer = smollm[1]
    spec = cache_spec(resolve_settings({}, load_cache_config("clusterkv")), 30, tokenizer)
    assert spec.strategies == ["full"] * 2 + ["clusterkv"] * 28 and spec.lengths == [None, None] + [512] * 28
    assert spec.options == dict(
        sink_tokens=16,
        recall_select="kv_head",
        tokens_per_cluster=80,
        cluster_every=320,
        new_clusters=8,
        kmeans_iterations=20,
    )
    with pytest.raises(ValueError, match="--full_layers 30 leaves none of the model's 30 layers to compress"):
        cache_spec(dict(cache_strategy="quest", full_layers=30), 30, tokenizer)
    with pytest.raises(
        ValueError,
        match="--layer_budget squeeze splits an evicting cache's budget; clusterkv and quest keep every token",
    ):
        cache_spec(dict(cache_strategy="quest", layer_budget="squeeze"), 30, tokenizer)
    with pytest.raises(
        ValueError, match="--page_size does not apply to --cache_strategy clusterkv; it applies to: quest"
    ):
        cache_spec(dict(cache_strategy="clusterkv", page_size=8), 30, tokenizer)
    with pytest.raises(ValueError, match="recall_select in kv_head, query_head"):
        ClusterKVCache(1, 1, 8, 4, torch.float32, history=16, sink_tokens=2, recall_select="head")


@pytest.mark.parametrize("strategy", sorted(RECALLABLE))
@pytest.mark.parametrize("select", ["kv_head", "query_head"])
def test_host_tier_copies_only_the_missing_tokens_and_decodes_like_the_device_tier(tiny_model, strategy, select):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    options = dict(
        sink_tokens=2,
        recall_select=select,
        **(
            dict(tokens_per_cluster=4, cluster_every=5, new_clusters=2)
            if strategy == "clusterkv"
            else dict(page_size=4)
        ),
    )
    kwargs = dict(max_seq_length=44)
    device = generate(tiny_model, prompts, 24, spec_for(tiny_model, strategy, 10, **options), **kwargs)
    host = generate(
        tiny_model, prompts, 24, spec_for(tiny_model, strategy, 10, **{**options, "slow_tier": "host"}), **kwargs
    )
    assert host.tokens == device.tokens
    stats = host.cache_stats
    copied, selected, reused = (
        stats["recall: copied from the host tier"],
        stats["recall: selected tokens"],
        stats["recall: also selected in the previous reuse_steps"],
    )
    assert 0 < copied == selected - reused < selected  # exactly the tokens the last step did not attend
    cache = tiny_model.layers[1].attention.kv_cache
    # the whole history in the host store, one step's budget on the device
    assert cache.storage.k.shape[2] == 44 and cache.fast_k.shape[2] == 10
    held = cache.fast_slots >= 0
    kv_head = torch.arange(cache.fast_slots.shape[1]) // (cache.fast_slots.shape[1] // cache.storage.k.shape[1])
    expected = cache.storage.k[torch.arange(2)[:, None, None], kv_head[None, :, None], cache.fast_slots.clamp(min=0)]
    torch.testing.assert_close(cache.fast_k[held], expected[held])  # the fast tier holds the attended tokens' keys


def test_host_tier_refuses_compile():
    proc = run_cli("--cache_config", "clusterkv", "--slow_tier", "host", "--compile", "--max_new_tokens", "2")
    assert proc.returncode != 0 and "--slow_tier host copies a data-dependent number of KVs" in proc.stderr

"""Layer budget planners (budget.py) and their use by generate(): totals, schedules, squeeze's grouping,
caches sized per prompt, and one compiled decode step for every plan."""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo.utils
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, paul_graham_text, spec_for
from kvlab.budget import kmeans_1d, plan_budgets, pyramid_schedule, residual_similarity, split_budget, squeeze_weights
from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config, resolve_settings
from kvlab.engine import compile_decode_step, generate
from kvlab.recording import PrefillRecorder
from kvlab.slot_counts import cache_slots

sys.path.insert(0, str(ROOT / "scripts"))
from plot_layers import main as plot_layers  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_split_budget_sums_to_the_total_within_bounds(data):
    n = data.draw(st.integers(1, 12))
    weights = data.draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    floor = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    ceiling = [f + data.draw(st.integers(0, 300)) for f in floor]
    total = data.draw(st.integers(sum(floor), sum(ceiling)))
    counts = split_budget(weights, total, floor, ceiling)
    assert sum(counts) == total
    assert all(f <= c <= m for f, c, m in zip(floor, counts, ceiling, strict=True))


def test_split_budget_is_proportional_when_no_bound_binds():
    assert split_budget([1, 1, 2], 400, [0, 0, 0], [1000] * 3) == [100, 100, 200]
    assert split_budget([1, 1, 1], 10, [0, 0, 0], [100] * 3) == [4, 3, 3]  # largest remainder, ties to the first layer
    # A layer at its ceiling gives its excess to the others, in proportion to their weights.
    assert split_budget([8, 1, 1], 300, [0, 0, 0], [120, 1000, 1000]) == [120, 90, 90]


def reference_pyramid(C: int, w: int, L: int, prompt: int, beta: int) -> list[int]:
    """The PyramidKV schedule transcribed from the facts doc (KVCache-Factory's PyramidKVCluster)."""
    min_num = (C - w) // beta
    max_num = (C - w) * 2 - min_num
    if max_num >= prompt - w:
        max_num = prompt - w
        min_num = (C - w) * 2 - max_num
    steps = (max_num - min_num) // (L - 1)
    return [max_num - layer * steps + w for layer in range(L)]


@pytest.mark.parametrize(
    "C, w, L, prompt, beta",
    [(128, 8, 4, 1000, 20), (128, 8, 4, 240, 20), (512, 14, 30, 4096, 20), (300, 14, 30, 620, 5)],
)
def test_pyramid_schedule_matches_the_reference_formula(C, w, L, prompt, beta):
    assert pyramid_schedule(C, w, L, prompt, beta) == reference_pyramid(C, w, L, prompt, beta)


def test_pyramid_is_uniform_on_short_sequences_and_funnel_is_its_reverse():
    assert pyramid_schedule(128, 8, 4, 200, 20) == [128] * 4  # 200 < 2 * (128 - 8)
    # The window is the protected count (floor - 1 = 14); where the schedule's integer steps add up to the
    # total, the plan is the schedule itself; else it is scaled to the total.
    assert plan_budgets("pyramid", 384, 1000, [15] * 3) == pyramid_schedule(128, 14, 3, 1000) == [237, 128, 19]
    assert sum(pyramid_schedule(128, 14, 4, 1000)) == 516 and sum(plan_budgets("pyramid", 512, 1000, [15] * 4)) == 512
    assert plan_budgets("funnel", 512, 1000, [15] * 4) == plan_budgets("pyramid", 512, 1000, [15] * 4)[::-1]


def test_kmeans_1d_finds_three_separated_groups():
    values = torch.tensor([0.61, 0.99, 0.84, 0.98, 0.86, 0.985, 0.60, 0.97])
    assert kmeans_1d(values).tolist() == [0, 2, 1, 2, 1, 2, 0, 2]
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # the groups depend on the values, not their order
    assert kmeans_1d(values[perm]).tolist() == torch.tensor([0, 2, 1, 2, 1, 2, 0, 2])[perm].tolist()


def test_squeeze_gives_the_most_similar_group_p_of_uniform():
    similarity = torch.tensor([0.6, 0.85, 0.99, 0.98, 0.99, 0.97, 0.84, 0.99])
    weights = squeeze_weights(similarity, p=0.3)
    low = [2, 3, 4, 5, 7]
    assert all(weights[i] == 0.3 for i in low) and sum(weights) == pytest.approx(len(weights))
    budgets = plan_budgets("squeeze", 800, 2000, [15] * 8, similarity, squeeze_p=0.3)
    assert sum(budgets) == 800 and all(budgets[i] == 30 for i in low)  # 0.3 x the uniform 100
    assert squeeze_weights(torch.full((6,), 0.9)) == [1.0] * 6  # no structure: uniform


def test_squeeze_measures_attention_that_changes_the_hidden_state(tiny_model):
    """Constructed hidden states: a layer whose attention output is zero leaves x unchanged (similarity 1),
    so it is least important and gets p x the uniform budget."""
    model = tiny_model
    silenced = 1
    original = model.layers[silenced].attention.wo.weight.detach().clone()
    try:
        with torch.no_grad():
            model.layers[silenced].attention.wo.weight.zero_()
        tokens = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(80)[None]
        model.setup_caches([PrefillRecorder()] * 2)
        with residual_similarity(model) as per_token:
            model(tokens, pos, prefill=True)
        assert torch.allclose(per_token[silenced], torch.ones(1, 80)) and per_token[0].max() < 0.99
        result = generate(
            model,
            [tokens[0].tolist()],
            8,
            spec_for(model, "heavy_hitter", 0.5, layer_budget="squeeze", recent_window=4),
        )
        assert result.layer_similarity[0][silenced] == pytest.approx(1.0)
        total = 2 * cache_slots(0.5, 88)
        # Two layers: KMeans puts each in its own group; the silenced one gets p x the uniform share.
        assert result.layer_budgets[0][silenced] == round(0.35 * total / 2) and sum(result.layer_budgets[0]) == total
    finally:
        with torch.no_grad():
            model.layers[silenced].attention.wo.weight.copy_(original)


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["pyramid", "squeeze"])
def test_generate_keeps_the_total_and_sizes_each_layer_by_its_plan(smollm, planner):
    model, tokenizer, _ = smollm
    prompts = [tokenizer.encode(paul_graham_text()[:3000])[:600], tokenizer.encode(paul_graham_text()[5000:8000])[:450]]
    result = generate(model, prompts, 8, spec_for(model, "heavy_hitter", 0.25, layer_budget=planner))
    caches = [layer.attention.kv_cache for layer in model.layers]
    for row, n in enumerate(len(p) + 8 for p in prompts):
        assert sum(result.layer_budgets[row]) == 30 * cache_slots(0.25, n)
    assert [c.capacity for c in caches] == [max(r[i] for r in result.layer_budgets) for i in range(30)]
    held = torch.stack([c.tokens_held() for c in caches], dim=1)  # [B, L]: every layer full to its own budget
    stored = [len(p) + 7 for p in prompts]  # the last generated token is never written to the cache
    assert held.tolist() == [
        [float(min(b, n)) for b in row] for row, n in zip(result.layer_budgets, stored, strict=True)
    ]
    assert len(set(result.layer_budgets[0])) > 1


@pytest.mark.slow
def test_uniform_planner_equals_no_planner(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode(paul_graham_text()[:2000])[:300]
    plain = generate(model, [prompt], 12, spec_for(model, "heavy_hitter", 0.3))
    planned = generate(
        model, [prompt], 12, spec_for(model, ["heavy_hitter"] * 30, 0.3, layer_budget="pyramid", pyramid_beta=1)
    )
    # pyramid_beta=1 puts min at (C - w) and max at (C - w): every layer equal, the uniform plan.
    assert planned.layer_budgets[0] == [cache_slots(0.3, 312)] * 30 and planned.tokens == plain.tokens


@pytest.mark.slow
def test_one_compiled_decode_step_serves_every_plan(tiny_model):
    """Planned capacities differ per prompt, yet the decode step compiles once (slot axis dynamic) and
    agrees with eager decoding."""
    model = tiny_model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = compile_decode_step(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    plans = []
    for n in (60, 75, 90):
        prompts = [torch.randint(0, 64, (n,), generator=g).tolist(), torch.randint(0, 64, (50,), generator=g).tolist()]
        spec = spec_for(model, "l2", 0.4, layer_budget="pyramid", recent_window=4, cache_bits=4)
        kwargs = dict(max_seq_length=110)
        compiled = generate(model, prompts, 12, spec, decode_step=step, **kwargs)
        eager = generate(model, prompts, 12, spec, **kwargs)
        assert compiled.tokens == eager.tokens
        plans.append(compiled.layer_budgets)
    assert len({str(p) for p in plans}) == 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_budget_settings_from_flags_and_yaml(smollm):
    tokenizer = smollm[1]
    spec = cache_spec(resolve_settings({}, load_cache_config("squeeze_heavy_hitter")), 30, tokenizer)
    assert spec.layer_budget == "squeeze" and spec.strategies == ["heavy_hitter"] * 30
    assert cache_spec(
        dict(cache_strategy="window", layer_budget="pyramid", pyramid_beta=10), 30, tokenizer
    ).budget_options == dict(pyramid_beta=10)
    with pytest.raises(ValueError, match="--squeeze_p applies to --layer_budget squeeze, not pyramid"):
        cache_spec(dict(cache_strategy="window", layer_budget="pyramid", squeeze_p=0.3), 30, tokenizer)
    with pytest.raises(ValueError, match="needs a compressing --cache_strategy"):
        cache_spec(dict(layer_budget="squeeze"), 30, tokenizer)
    with pytest.raises(
        ValueError, match="unknown layer budget planner 'wide'; choose from: uniform, pyramid, funnel, squeeze"
    ):
        plan_budgets("wide", 100, 100, [10])


def test_plot_layers_writes_a_png_and_a_table(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(paul_graham_text()[:1200])
    plot_layers(["--prompt", str(prompt), "--out", str(tmp_path / "layers.png"), "--planners", "uniform", "squeeze"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 30 and (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    uniform, squeeze = zip(*[(int(r.split("|")[3]), int(r.split("|")[4])) for r in rows], strict=True)
    assert sum(uniform) == sum(squeeze) and len(set(uniform)) == 1

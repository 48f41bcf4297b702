"""Chunked prefill (--prefill_chunk): held slots stay within budget + chunk, exact attention chunked equals the
one-shot prefill, rows of a batch stay independent, every strategy runs, bad values are one-line errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import ROOT, fast_few, miniature_smollm
from kvlab.chunked import prefill_chunk_step
from kvlab.config import cache_spec, parse_flag
from kvlab.engine import generate
from kvlab.eviction import EvictionCache
from kvlab.paged import PagedKV
from kvlab.scores import chunk_attention, chunk_mean, window_attention
from kvlab.strategies import CACHE_STRATEGIES

SCORED = [name for name, cls in CACHE_STRATEGIES.items() if cls.takes_prompt_compressor]
VARIANTS = [
    {"cache_strategy": "heavy_hitter", "prompt_compression_strategy": "snapkv"},
    {"cache_strategy": "heavy_hitter", "prompt_compression_strategy": "heavy_hitter_mean"},
    {"cache_strategy": "tova", "chunk_size": 4},
    {"cache_strategy": "l2", "cache_bits": 4},
    {"cache_strategy": "keydiff", "cache_bits": 8, "key_quant_axis": "channel"},
    {"cache_strategy": "keydiff", "cache_bits": 16},
    {"cache_strategy": "keydiff", "key_channel_pruning": 0.5},
    {"cache_strategy": "recent_global", "prompt_compression_strategy": "kvzip"},
]


def settings_for(strategy: str) -> dict:
    """A cache strategy's settings, or KVzip's (a prompt compressor: on StreamingLLM's cache, as configs/kvzip.yaml)."""
    if strategy == "kvzip":
        return {"cache_strategy": "recent_global", "prompt_compression_strategy": "kvzip"}
    return {"cache_strategy": strategy}


@pytest.fixture
def chunk_log(monkeypatch):
    """Per chunk and layer: the real keys each head attended over, and the tokens each head held afterwards, read
    from the cache's positions; and the slots of its buffers."""
    log = {"attended": [], "held": [], "layer_held": [], "slots": []}
    original = EvictionCache.prefill_chunk

    def recording(self, input_pos, k, v, q, attend, probe=0):
        def attend_seen(keys, values, key_pos):
            # KVzip's repeat is not held
            log["attended"].append(int((key_pos[..., : key_pos.shape[-1] - probe] >= 0).sum(dim=-1).max()))
            return attend(keys, values, key_pos)

        y = original(self, input_pos, k, v, q, attend_seen, probe)
        log["held"].append(int((self.pos >= 0).sum(dim=-1).max()))
        log["layer_held"].append(int((self.pos >= 0).sum(dim=(1, 2)).max()))
        log["slots"].append(self.pos.shape[-1])
        return y

    monkeypatch.setattr(EvictionCache, "prefill_chunk", recording)
    return log


@pytest.mark.parametrize(
    "settings", [{"cache_strategy": s} for s in SCORED] + VARIANTS, ids=lambda s: "-".join(map(str, s.values()))
)
def test_held_slots_never_exceed_the_budget_plus_the_chunk(settings, tiny_model, chunk_log):
    budget, chunk = 24, 16
    spec = cache_spec({**settings, "max_cache_length": budget, "prefill_chunk": chunk}, tiny_model.config.n_layer)
    prompt = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    result = generate(tiny_model, [prompt, prompt[:50]], 4, spec)
    layers, later_chunks = tiny_model.config.n_layer, -(-100 // chunk) - 1
    assert len(chunk_log["attended"]) == layers * later_chunks
    assert max(chunk_log["attended"]) == budget + chunk  # held + a whole chunk, never more
    assert max(chunk_log["held"]) == budget and set(chunk_log["slots"]) == {budget}
    assert result.tokens_held == [budget] * layers


@pytest.mark.parametrize(
    "settings", [{}, {"kvc_full": True}, {"kvc_scope": "layer"}], ids=["kvc_w", "kvc_full", "layer_scope"]
)
def test_the_paged_pool_holds_the_budgets_plus_one_chunk_and_frees_blocks_between_chunks(
    settings, tiny_model, monkeypatch
):
    """Blocks in use before each compression (every layer's budget + a chunk of 10, not a multiple of the block size 4:
    a chunk fills each head's partial last block first) and the pool the prefill sized, against one-shot's."""
    budget, chunk, block = 24, 10, 4
    in_use, original = [], PagedKV.compress_row
    monkeypatch.setattr(
        PagedKV, "compress_row", lambda self, row: in_use.append(self.blocks_in_use()) or original(self, row)
    )
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (100, 50)]
    base = {"cache_strategy": "kvcompress", "max_cache_length": budget, "kvc_block_size": block, **settings}
    one_shot = generate(tiny_model, prompts, 4, cache_spec(base, 2))
    in_use.clear()
    chunked = generate(tiny_model, prompts, 4, cache_spec({**base, "prefill_chunk": chunk}, 2))
    kept = max(budget, 32 if settings.get("kvc_full") else 8)  # KVC-full protects its newest 32 tokens
    per_head = -(-kept // block) + -(-chunk // block) + 1  # + one block a chunk straddles
    assert max(in_use) <= 2 * 2 * tiny_model.config.n_local_heads * per_head  # layers x rows x heads
    assert chunked.cache_stats["kvcompress: pool blocks"] < one_shot.cache_stats["kvcompress: pool blocks"]
    # + decoded tokens
    assert chunked.cache_stats["kvcompress: blocks freed"] > 0 and max(chunked.tokens_held) <= kept + 4


def test_ada_kv_shares_each_layers_budget_between_chunks(tiny_model, chunk_log):
    budget, chunk, heads = 24, 16, tiny_model.config.n_local_heads
    spec = cache_spec(
        {"cache_strategy": "keydiff", "head_budget": "adakv", "max_cache_length": budget, "prefill_chunk": chunk}, 2
    )
    prompt = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    generate(tiny_model, [prompt], 4, spec)
    # uneven shares of one layer total
    assert max(chunk_log["layer_held"]) == heads * budget and max(chunk_log["held"]) > budget
    assert max(chunk_log["attended"]) <= max(chunk_log["slots"]) + chunk


@pytest.mark.parametrize(
    "settings, chunk",
    fast_few(
        [
            ({"cache_strategy": "full"}, 64),  # exact attention in chunks
            ({"cache_strategy": "keydiff", "max_cache_length": 400}, 64),  # a budget the prompt fits: nothing evicted
            ({"cache_strategy": "keydiff", "max_cache_length": 100}, 300),  # a chunk as long as the prompt: one prefill
            ({"cache_strategy": "tova", "max_cache_length": 100}, 1000),
            ({"cache_strategy": "kvcompress", "max_cache_length": 400}, 64),  # the paged pool
        ],
        [({"cache_strategy": "keydiff", "max_cache_length": 400}, 64)],
    ),
)
def test_a_chunked_prefill_that_evicts_nothing_between_chunks_gives_the_one_shot_tokens(settings, chunk, smollm, essay):
    model, tokenizer, _ = smollm
    prompt = essay[:300]
    one_shot = generate(model, [prompt], 8, cache_spec(settings, model.config.n_layer))
    chunked = generate(model, [prompt], 8, cache_spec({**settings, "prefill_chunk": chunk}, model.config.n_layer))
    assert chunked.tokens == one_shot.tokens and chunked.tokens_held == one_shot.tokens_held


@pytest.mark.parametrize(
    "strategy",
    fast_few(
        ["keydiff", "tova", "heavy_hitter", "expected_attention", "rkv", "lagkv", "kvzip", "kvcompress"], ["keydiff"]
    ),
)
def test_each_row_of_a_batch_of_mixed_lengths_is_compressed_as_alone(strategy, smollm, essay):
    """The short row's prompt ends chunks before the long one's: chunks of padding leave its cache unchanged."""
    model, tokenizer, _ = smollm
    spec = cache_spec(
        {**settings_for(strategy), "max_cache_length": 96, "prefill_chunk": 64}, model.config.n_layer, tokenizer
    )
    long, short = essay[:400], essay[1000:1150]
    together = generate(model, [long, short], 6, spec)
    alone = [generate(model, [p], 6, spec).tokens[0] for p in (long, short)]
    assert together.tokens == alone


@pytest.mark.slow
def test_every_strategy_runs_chunked_and_says_which_compress_only_at_the_end(smollm, capsys, monkeypatch):
    """The miniature of SmolLM2 (its shipped DuoAttention gates fit it): 600 prompt tokens in chunks of 128."""
    monkeypatch.setattr("kvlab.slot_counts._SAID", set())
    model = miniature_smollm()
    prompt = torch.randint(0, 49152, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    gates = {"duo_attention": {"duo_gates": "configs/duo/SmolLM2-135M-Instruct.json"}}
    for name, cls in CACHE_STRATEGIES.items():
        settings = {"cache_strategy": name, "prefill_chunk": 128, **gates.get(name, {})}
        if cls.takes_prompt_compressor or name == "kvcompress":
            settings["max_cache_length"] = 200
        result = generate(model, [prompt, prompt[:250]], 4, cache_spec(settings, model.config.n_layer))
        assert len(result.tokens[0]) == 4
        if cls.takes_prompt_compressor:
            assert result.tokens_held == [200] * model.config.n_layer, name
    named = [
        re.match(r"note: (.+) cannot compress between prefill chunks", line)
        for line in capsys.readouterr().err.splitlines()
    ]
    assert {m.group(1) for m in named if m} == {"hybrid", "clusterkv", "quest", "duo_attention"}


@pytest.mark.parametrize("text", ["0", "-4", "1.5", "many"])
def test_a_bad_prefill_chunk_is_one_line_naming_the_value(text):
    with pytest.raises(ValueError, match=r"prefill_chunk.*integer from 1"):
        parse_flag("prefill_chunk", text)


def test_a_chunk_beyond_the_context_and_whole_prompt_scorers_are_refused(tiny_model):
    with pytest.raises(ValueError, match="--prefill_chunk 129 exceeds the model's context of 128 tokens"):
        generate(tiny_model, [[1, 2, 3]], 2, cache_spec({"cache_strategy": "full", "prefill_chunk": 129}, 2))
    spec = cache_spec(
        {
            "cache_strategy": "keydiff",
            "prompt_compression_strategy": "oracle",
            "max_cache_length": 8,
            "prefill_chunk": 4,
        },
        2,
    )
    with pytest.raises(ValueError, match="Oracle scores the whole prompt with a further pass of the model"):
        generate(tiny_model, [list(range(20))], 2, spec)
    with pytest.raises(ValueError, match="--attention_loss compares with a one-shot prefill"):
        generate(
            tiny_model,
            [list(range(20))],
            2,
            cache_spec({"cache_strategy": "l2", "max_cache_length": 8, "prefill_chunk": 4}, 2),
            attention_loss=True,
        )


def test_a_chunks_attention_is_the_prompts_for_the_same_queries_and_keys():
    """Held keys that are the whole prefix, in each head's own order: the chunk's last queries attend as in the
    prompt."""
    torch.manual_seed(0)
    B, H, n_kv, T, N, D = 2, 6, 2, 40, 8, 16
    q, k = torch.randn(B, H, T, D), torch.randn(B, n_kv, T, D)
    input_pos = torch.arange(T).expand(B, T).clone()
    input_pos[1, 37:] = -1  # the second row's prompt is shorter: its chunk is padded (still 4 real queries)
    expected = window_attention(input_pos, k, q, 4)
    chunk_pos = input_pos[:, T - N :]
    # each head holds the keys in its own order
    shuffle = torch.stack([torch.randperm(T) for _ in range(B * n_kv)]).view(B, n_kv, T)
    got = chunk_attention(
        input_pos[:, None, :].expand(B, n_kv, T).gather(2, shuffle),
        k.gather(2, shuffle[..., None].expand(-1, -1, -1, D)),
        chunk_pos,
        q[:, :, T - N :],
        4,
    )
    unshuffled = torch.empty_like(got).scatter_(4, shuffle[:, :, None, None, :].expand_as(got), got)
    torch.testing.assert_close(unshuffled, expected)


def test_chunk_means_group_held_tokens_by_position_whatever_their_spacing():
    scores = torch.tensor([[[1.0, 3.0, 5.0, 7.0, 9.0, 0.0]]])
    pos = torch.tensor([[[0, 2, 5, 6, 11, -1]]])  # chunks of 4 positions: {0, 2}, {5, 6}, {11}; one empty slot
    assert chunk_mean(scores, pos, 4).tolist() == [[[2.0, 2.0, 6.0, 6.0, 9.0, 0.0]]]


@pytest.mark.parametrize(
    "strategy",
    [
        "keydiff",
        "kvzip",
        pytest.param("heavy_hitter", marks=pytest.mark.slow),
        pytest.param("expected_attention", marks=pytest.mark.slow),
    ],
)
def test_the_compiled_chunk_step_gives_the_eager_tokens_with_one_graph_for_every_chunk(strategy, tiny_model):
    """Chunks of one static shape (the last one padded): one compiled graph serves them all, no recompile."""
    torch._dynamo.reset()
    spec = cache_spec(
        {**settings_for(strategy), "max_cache_length": 24, "prefill_chunk": 16}, tiny_model.config.n_layer
    )
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 61)]
    eager = generate(tiny_model, prompts, 6, spec)
    compiled_step = torch.compile(prefill_chunk_step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(tiny_model, prompts, 6, spec, chunk_step=compiled_step)
    assert compiled.tokens == eager.tokens


def test_chunked_vs_oneshot_pairs_the_examples_both_runs_finished(tmp_path):
    """Two examples in both runs (one only one-shot finished is left out): means, paired difference and its SE."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chunked_vs_oneshot", ROOT / "scripts" / "chunked_vs_oneshot.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    runs = {"ratio0.5+query_agnostic": [1.0, 1.0, 0.0], "ratio0.5+query_agnostic+prefill_chunk512": [0.0, 1.0]}
    config_dir = tmp_path / "SmolLM2-135M-Instruct" / "keydiff"
    config_dir.mkdir(parents=True)
    lines = [
        {"run": run, "job": "vt@2048", "id": f"vt/{i}", "score": s}
        for run, scores in runs.items()
        for i, s in enumerate(scores)
    ]
    (config_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = script.comparisons(tmp_path)
    assert rows == [
        {
            "config": "keydiff",
            "size": "ratio0.5+query_agnostic",
            "chunk": 512,
            "task": "vt@2048",
            "measure": "score",
            "n": 2,
        }
        # diffs -1, 0: stdev 0.707 / sqrt 2
        | {"oneshot": 100.0, "chunked": 50.0, "diff": -50.0, "se": pytest.approx(50.0)}
    ]


def test_a_full_cache_chunk_attends_over_the_filled_slots_eager_and_every_slot_compiled(tiny_model, monkeypatch):
    """The full cache's chunks: eager, each attends over the slots filled so far (32, 48, ..., the prompt), never
    the empty rest of the buffer, the held ones apart from its own (`own_from`); compiled, over every slot in one
    static shape. Both give the one-shot tokens."""
    from kvlab.cache import FullCache

    prompt = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = cache_spec({"cache_strategy": "full", "prefill_chunk": 16}, tiny_model.config.n_layer)
    one_shot = generate(tiny_model, [prompt], 6, cache_spec({"cache_strategy": "full"}, tiny_model.config.n_layer))
    attended = []
    chunk = FullCache.prefill_chunk

    def spy(self, input_pos, k, v, q, attend):
        def seen(keys, *rest, **held):
            attended.append((keys.shape[2], held.get("own_from")))
            return attend(keys, *rest, **held)

        return chunk(self, input_pos, k, v, q, seen)

    monkeypatch.setattr(FullCache, "prefill_chunk", spy)
    assert generate(tiny_model, [prompt], 6, spec).tokens == one_shot.tokens
    chunks = [(32, 16), (48, 32), (64, 48), (70, 64)]  # (slots filled, where the chunk's own keys start)
    assert attended == [c for c in chunks for _ in range(tiny_model.config.n_layer)]
    monkeypatch.setattr(FullCache, "prefill_chunk", chunk)
    torch._dynamo.reset()
    compiled = generate(tiny_model, [prompt], 6, spec, chunk_step=torch.compile(prefill_chunk_step, fullgraph=True))
    assert compiled.tokens == one_shot.tokens


@pytest.mark.parametrize("ratio", [None, 0.75])
def test_the_model_wide_ranking_between_chunks_holds_the_one_shot_total(tiny_model, chunk_log, ratio):
    """After each chunk every layer's held tokens are ranked together, so a head may hold more than the budget (others
    less) while the model's total after the prompt is the one-shot prefill's: the budget's L x H x slots, or kvpress's
    count at a compression ratio; the chunks attend over what is held, not the whole prompt."""
    budget, chunk, n_layer, heads = 16, 16, tiny_model.config.n_layer, tiny_model.config.n_local_heads
    limit = {"compression_ratio": ratio} if ratio else {"max_cache_length": budget}
    settings = {"cache_strategy": "keydiff", "head_budget": "global", "global_tokens": 2, "recent_window": 0}
    spec = cache_spec({**settings, **limit, "prefill_chunk": chunk}, n_layer)
    prompt = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    generate(tiny_model, [prompt], 1, spec)
    caches = [b.attention.kv_cache for b in tiny_model.layers]
    total = n_layer * heads * len(prompt)
    assert sum(int((c.pos >= 0).sum()) for c in caches) == (
        total - int(total * ratio) if ratio else n_layer * heads * budget
    )
    assert max(chunk_log["held"]) > budget and all(c.storage.compacted for c in caches)
    assert max(chunk_log["attended"]) < len(prompt)

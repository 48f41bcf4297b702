"""kvpress's evaluation protocol: compression ratios (the share of the prefilled tokens removed, every
later token kept) and query-agnostic compression (the context compressed before the question is seen,
the question decoded through the compressed cache)."""

from __future__ import annotations

import csv

import pytest
import torch

import eval as kv_eval
from kvlab.build import build_caches
from kvlab.config import cache_spec
from kvlab.engine import generate
from kvlab.eviction import EvictionCache
from kvlab.results import read_config_records, read_runs
from kvlab.strategies import CACHE_STRATEGIES
from kvlab.tasks import resolve_tasks

PROMPTS = [
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, and the birds "
    "that rested on the rail. One winter a storm broke the lamp, and for three nights he kept a lantern burning "
    "by hand. Question: what broke the lamp?",
    "Rivers carry sand to the sea, and the sea sorts it by size, so that beaches of fine sand lie where the "
    "water is calm and pebbles where the waves break hard. Over centuries a storm can move a whole beach along "
    "the coast, and towns have built walls and groynes to hold it in place. Question: where do beaches of fine "
    "sand lie?",
]


def encode(tokenizer, text: str) -> tuple[list[int], int]:
    """A prompt's ids and where its question starts."""
    ids = tokenizer.encode(text)
    return ids, len(tokenizer.encode(text[: text.index(" Question:")]))


def ratio_spec(model, strategy: str, ratio: float, **settings):
    return cache_spec({"cache_strategy": strategy, "compression_ratio": ratio, **settings}, model.config.n_layer)


def manual(model, spec, ids: list[int], question: int, max_new: int) -> list[int]:
    """The protocol written out: prefill the context into the caches, decode the rest of the prompt one
    token at a time, then decode greedily."""
    build_caches(model, spec, [len(ids)], max_new, len(ids) + max_new, prefilled=[question])
    with torch.no_grad():
        logits = model(torch.tensor([ids[:question]]), torch.arange(question)[None], prefill=True)
        for p in range(question, len(ids)):
            logits = model(torch.tensor([[ids[p]]]), torch.tensor([[p]]))
        out = [int(logits[0, -1].argmax())]
        for n in range(1, max_new):
            out.append(int(model(torch.tensor([[out[-1]]]), torch.tensor([[len(ids) + n - 1]]))[0, -1].argmax()))
    return out


@pytest.mark.parametrize("strategy", ["heavy_hitter", "snapkv_window"])
def test_query_agnostic_generation_is_context_prefill_then_question_decode(smollm, strategy):
    model, tokenizer, _ = smollm
    settings = {"prompt_compression_strategy": "snapkv"} if strategy == "snapkv_window" else {}
    spec = ratio_spec(model, "recent_global" if strategy == "snapkv_window" else strategy, 0.5, **settings)
    ids, question = encode(tokenizer, PROMPTS[0])
    got = generate(model, [ids], 8, spec, decoded_prompt_tokens=[len(ids) - question]).tokens[0]
    model.cache_key = None
    assert got == manual(model, spec, ids, question, 8)


def test_rows_decoding_different_question_lengths_equal_each_alone(smollm):
    model, tokenizer, _ = smollm
    spec = ratio_spec(model, "heavy_hitter", 0.5)
    encoded = [encode(tokenizer, p) for p in PROMPTS]
    decoded = [len(ids) - q for ids, q in encoded]
    assert decoded[0] != decoded[1]
    batch = generate(model, [ids for ids, _ in encoded], 8, spec, decoded_prompt_tokens=decoded).tokens
    alone = [
        generate(model, [ids], 8, spec, decoded_prompt_tokens=[d]).tokens[0]
        for (ids, _), d in zip(encoded, decoded, strict=True)
    ]
    assert batch == alone


def test_a_full_cache_gives_the_same_answer_whichever_protocol(smollm):
    model, tokenizer, _ = smollm
    ids, question = encode(tokenizer, PROMPTS[1])
    spec = cache_spec({}, model.config.n_layer)
    assert (
        generate(model, [ids], 8, spec, decoded_prompt_tokens=[len(ids) - question]).tokens
        == generate(model, [ids], 8, spec).tokens
    )


@pytest.mark.parametrize("head_budget", ["uniform", "adakv"])
def test_a_ratio_removes_that_share_of_the_prefill_and_evicts_nothing_after(smollm, head_budget):
    """kvpress: int(prefilled x (1 - ratio)) tokens kept per head (per layer on average with Ada-KV),
    then the question and the answer are all kept."""
    model, tokenizer, _ = smollm
    ids, question = encode(tokenizer, PROMPTS[0])
    spec = ratio_spec(model, "heavy_hitter", 0.6, head_budget=head_budget, recent_window=4)
    max_new = 6
    kept = int(question * (1 - 0.6))
    build_caches(model, spec, [len(ids)], max_new, len(ids) + max_new, prefilled=[question])
    with torch.no_grad():
        model(torch.tensor([ids[:question]]), torch.arange(question)[None], prefill=True)
    caches = [layer.attention.kv_cache for layer in model.layers]
    held = torch.stack([(c.pos >= 0).sum(dim=-1)[0] for c in caches])  # [layer, head]
    if head_budget == "uniform":
        assert held.eq(kept).all()
    else:
        assert held.sum(dim=1).eq(kept * held.shape[1]).all() and not held.eq(kept).all()
    positions = [set(c.pos[0].flatten().tolist()) - {-1} for c in caches]
    with torch.no_grad():
        for p in range(question, len(ids) + max_new - 1):
            model(torch.tensor([[ids[min(p, len(ids) - 1)]]]), torch.tensor([[p]]))
    after = torch.stack([(c.pos >= 0).sum(dim=-1)[0] for c in caches])
    assert after.eq(held + len(ids) - question + max_new - 1).all()  # every decoded token kept, no prompt token evicted
    assert all(before <= set(c.pos[0].flatten().tolist()) for before, c in zip(positions, caches, strict=True))
    model.cache_key = None


@pytest.mark.parametrize("planner", ["pyramid", "funnel"])
def test_a_ratio_with_a_pyramid_keeps_pyramidkv_press_counts_per_layer(smollm, planner):
    """kvpress's PyramidKVPress: layer i of L keeps round(max - i (max - min) / (L - 1)) of the n context
    tokens, max + min = 2 n (1 - ratio), min = n (1 - ratio) / beta, max <= n - window (SnapKV's)."""
    model, tokenizer, _ = smollm
    ids, question = encode(tokenizer, PROMPTS[1])
    settings = dict(prompt_compression_strategy="snapkv", snapkv_window=2, global_tokens=0, recent_window=1)
    spec = ratio_spec(model, "heavy_hitter", 0.5, layer_budget=planner, pyramid_beta=4, **settings)
    build_caches(model, spec, [len(ids)], 4, len(ids) + 4, prefilled=[question])
    with torch.no_grad():
        model(torch.tensor([ids[:question]]), torch.arange(question)[None], prefill=True)
    held = [int((layer.attention.kv_cache.pos[0, 0] >= 0).sum()) for layer in model.layers]
    kept = question * 0.5
    low, L = kept / 4, model.config.n_layer
    high = 2 * kept - low
    assert high < question - 2 and low >= 2  # the schedule, not SnapKV's fallback
    expected = [round(high - i * (high - low) / (L - 1)) for i in range(L)]
    assert held == (expected if planner == "pyramid" else expected[::-1])
    assert held[0] != held[-1] and abs(sum(held) - L * kept) <= L / 2
    model.cache_key = None


@pytest.mark.parametrize("strategy", ["quest", "clusterkv"])
def test_a_ratio_sizes_what_a_recallable_cache_attends_each_step(smollm, strategy):
    """Nothing is evicted; every step attends int((1 - ratio) x the prefilled tokens) + the tokens after them."""
    model, tokenizer, _ = smollm
    ids, question = encode(tokenizer, PROMPTS[1])
    spec = ratio_spec(model, strategy, 0.75, sink_tokens=4)
    max_new = 5
    build_caches(model, spec, [len(ids)], max_new, len(ids) + max_new, prefilled=[question])
    attended = int(question * 0.25) + len(ids) - question + max_new - 1
    assert {int(layer.attention.kv_cache.row_budget) for layer in model.layers} == {attended}
    model.cache_key = None
    tokens = generate(model, [ids], max_new, spec, decoded_prompt_tokens=[len(ids) - question]).tokens[0]
    assert tokens == manual(model, spec, ids, question, max_new)
    model.cache_key = None


def test_a_ratio_with_chunks_keeps_chunkkv_press_whole_chunks(smollm):
    """kvpress's ChunkKVPress: int((1 - ratio) x the chunks) whole chunks, the newest (partial) one among them,
    the same chunks in every head of a layer."""
    model, tokenizer, _ = smollm
    ids, question = encode(tokenizer, PROMPTS[1])
    settings = dict(
        prompt_compression_strategy="snapkv", snapkv_window=4, chunk_size=5, global_tokens=0, recent_window=1
    )
    build_caches(
        model, ratio_spec(model, "heavy_hitter", 0.5, **settings), [len(ids)], 4, len(ids) + 4, prefilled=[question]
    )
    with torch.no_grad():
        model(torch.tensor([ids[:question]]), torch.arange(question)[None], prefill=True)
    newest = question // 5
    assert question % 5  # this prompt's newest chunk is partial
    chunks = int((newest + 1) * 0.5)
    for layer in model.layers:
        heads = [sorted(set(h) - {-1}) for h in layer.attention.kv_cache.pos[0].tolist()]
        kept = sorted({p // 5 for p in heads[0]})
        assert all(h == heads[0] for h in heads) and len(kept) == chunks and newest in kept
        assert heads[0] == [p for c in kept for p in range(5 * c, min(5 * c + 5, question))]
    model.cache_key = None


def test_a_pyramid_falls_back_to_snapkv_counts_where_kvpress_does():
    from kvlab.budget import pyramid_ratio_schedule

    assert pyramid_ratio_schedule(1024, 0.875, 30, 64, 20) == [128] * 30  # min = 6.4 < window 64
    planned = pyramid_ratio_schedule(1024, 0.5, 30, 64, 20)  # max capped at 1024 - 64, min = 1024 - 960
    assert planned[0] == 960 and planned[-1] == 64 and sum(planned) == 30 * 512


@pytest.mark.parametrize("strategy", ["lagkv", "expected_attention", "rkv"])
def test_a_ratio_decode_skips_the_eviction_score_and_generates_the_same(smollm, monkeypatch, strategy):
    """Under a ratio every decoded token has an empty slot, so the decode step does not score the held
    tokens; forcing the score (as before) picks the same slots: the same tokens, in a batch of two."""
    model, tokenizer, _ = smollm
    spec = ratio_spec(model, strategy, 0.5, recent_window=4)
    encoded = [encode(tokenizer, p) for p in PROMPTS]
    prompts, decoded = [ids for ids, _ in encoded], [len(ids) - q for ids, q in encoded]
    scored = []
    cls = CACHE_STRATEGIES[strategy]
    own = cls._token_importances
    monkeypatch.setattr(cls, "_token_importances", lambda self: scored.append(1) or own(self))
    skipped = generate(model, prompts, 8, spec, decoded_prompt_tokens=decoded).tokens
    assert not scored

    limit_rows = EvictionCache.limit_rows

    def scoring_limit_rows(self, capacities, decode_room=None):
        limit_rows(self, capacities, decode_room)
        self.decode_evicts = True

    monkeypatch.setattr(EvictionCache, "limit_rows", scoring_limit_rows)
    model.cache_key = None
    assert generate(model, prompts, 8, spec, decoded_prompt_tokens=decoded).tokens == skipped
    assert scored  # the forced run did score
    model.cache_key = None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"cache_strategy": "heavy_hitter", "compression_ratio": 0.5, "max_cache_length": 0.5},
            "give --compression_ratio or --max_cache_length",
        ),
        (
            {"cache_strategy": "hybrid", "compression_ratio": 0.5},
            "applies to strategies that rank the prompt or recall it .*quest.*, not hybrid",
        ),
        ({"cache_strategy": "kvcompress", "compression_ratio": 0.5}, "not kvcompress"),
        (
            {"cache_strategy": "heavy_hitter", "compression_ratio": 0.5, "layer_budget": "squeeze"},
            "takes --layer_budget uniform, pyramid or funnel .*not squeeze",
        ),
        ({"cache_strategy": "full", "compression_ratio": 0.5}, "needs a compressing --cache_strategy"),
        (
            {"cache_strategy": "heavy_hitter", "compression_ratio": 1.0},
            r"compression_ratio must be a fraction in \[0, 1\), got 1.0",
        ),
    ],
)
def test_bad_ratio_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        cache_spec(settings, 30)


def test_ruler_prompts_split_before_their_question(smollm):
    _, tokenizer, _ = smollm
    for task in resolve_tasks(["ruler"]):
        for example in task.examples(tokenizer, 2, 0, 1024):
            context, rest = (
                tokenizer.decode(example.input_ids[: example.question_start]),
                tokenizer.decode(example.input_ids[example.question_start :]),
            )
            assert rest.lstrip("\n").startswith(task.question.lstrip("\n")[:10]), (task.name, rest[:40])
            # the split is at the last question: vt and cwe repeat it in their example
            assert task.question not in context[-len(task.question) - 20 :]
            assert 20 <= len(example.input_ids) - example.question_start <= 150  # question, end of turn, answer prefix


def test_query_agnostic_ratio_sweep_writes_its_own_runs(tmp_path):
    common = [
        "--out_dir",
        str(tmp_path),
        "--tasks",
        "niah_single_1",
        "--context_lengths",
        "400",
        "--num_samples",
        "2",
        "--batch_size",
        "2",
    ]
    kv_eval.main([*common, "--cache_config", "full", "snapkv", "--compression_ratios", "0.5", "--query_agnostic"])
    kv_eval.main([*common, "--cache_config", "snapkv", "--compression_ratios", "0.5"])
    runs = sorted(
        (p.parent.relative_to(tmp_path).as_posix(), run)
        for p in tmp_path.glob("*/*/runs.json")
        for run in read_runs(p.parent)
    )
    assert runs == [
        ("SmolLM2-135M-Instruct/full", "full"),
        ("SmolLM2-135M-Instruct/snapkv", "ratio0.5"),
        ("SmolLM2-135M-Instruct/snapkv", "ratio0.5+query_agnostic"),
    ]
    assert (
        read_runs(tmp_path / "SmolLM2-135M-Instruct/snapkv")["ratio0.5+query_agnostic"]["args"]["key"]["query_agnostic"]
        is True
    )
    rows = {(r["config"], r["size"], r["query_agnostic"]) for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert rows == {("full", "full", "False"), ("snapkv", "ratio0.5", "False"), ("snapkv", "ratio0.5", "True")}
    records = read_config_records(tmp_path / "SmolLM2-135M-Instruct/snapkv")
    aware, agnostic = (list(records[run, "niah_single_1@400"].values()) for _, run in runs[1:])
    # half the prompt removed, or half the context only; the answer kept in both
    for a, b in zip(aware, agnostic, strict=True):
        assert 1.0 < b["compression"] < a["compression"] < 2.0


def test_query_agnostic_needs_a_context_question_split(tmp_path):
    with pytest.raises(SystemExit):
        kv_eval.main(
            ["--out_dir", str(tmp_path), "--tasks", "book_kjv", "--cache_config", "snapkv", "--query_agnostic"]
        )

"""KV-Compress end to end (kvlab/paged.py through generate, serve and the CLI): the same tokens as the full cache
without eviction, batched and compiled as one by one and eager, continuous batching in a fixed pool (freeing every
block, preempting when it runs out), the pool sized from the budget, FlexAttention over the pool, and the one-line
errors of an exhausted or oversized pool."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import spec_for
from kvlab.block_tables import VIEW_ROUND
from kvlab.engine import compile_decode_step, generate
from kvlab.paged import PagedKV
from kvlab.pool import BlockPool
from kvlab.report import cache_report
from kvlab.serving import serve
from test_generate import run_cli


def test_kvcompress_without_eviction_equals_the_full_cache(tiny_model):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    full = generate(tiny_model, prompts, 16, spec_for(tiny_model, "full"), max_seq_length=40)
    paged = generate(
        tiny_model, prompts, 16, spec_for(tiny_model, "kvcompress", 40, kvc_block_size=4), max_seq_length=40
    )
    assert paged.tokens == full.tokens and paged.cache_stats["kvcompress: blocks freed"] == 0


def test_kvcompress_batch_equals_one_by_one_and_compiled_equals_eager(tiny_model):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    spec = spec_for(tiny_model, "kvcompress", 0.4, kvc_block_size=2, kvc_window=4, kvc_protect=3)
    kwargs = dict(max_seq_length=44)
    batch = generate(tiny_model, prompts, 24, spec, **kwargs)
    alone = [generate(tiny_model, [p], 24, spec, **kwargs) for p in prompts]
    assert [a.tokens[0] for a in alone] == batch.tokens
    assert batch.cache_stats["kvcompress: blocks freed"] > 0
    # compression changed something
    assert batch.tokens != generate(tiny_model, prompts, 24, spec_for(tiny_model, "full"), max_seq_length=44).tokens
    torch._dynamo.reset()
    compiled = generate(tiny_model, prompts, 24, spec, decode_step=compile_decode_step(torch.device("cpu")), **kwargs)
    assert compiled.tokens == batch.tokens and compiled.cache_stats == batch.cache_stats


SERVED = [
    [3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1],
    [7, 21, 63, 1, 8, 30, 45, 12],
    [5, 5, 19, 44, 2, 61, 38, 20, 16, 9, 3, 27],
]


def test_continuous_batching_equals_one_by_one_and_frees_every_block(tiny_model):
    options = dict(kvc_block_size=2, kvc_window=4, kvc_protect=3)
    alone = [
        generate(tiny_model, [p], 20, spec_for(tiny_model, "kvcompress", 0.4, **options), max_seq_length=40).tokens[0]
        for p in SERVED
    ]
    result = serve(tiny_model, SERVED, 20, 2, spec_for(tiny_model, "kvcompress", 0.4, **options), max_seq_length=40)
    assert result.tokens == alone and result.preemptions == 0
    # the third request joined when a row freed
    assert max(result.rows_in_flight) == 2 and result.rows_in_flight[-1] == 1
    paged = tiny_model.layers[0].attention.kv_cache.paged
    assert paged.pool.free_blocks() == paged.pool.n_blocks and not paged.active.any()


def test_a_fixed_pool_holds_more_compressed_sequences_and_preempts_when_it_runs_out(tiny_model):
    prompts = SERVED * 2
    options = dict(kvc_block_size=2, kvc_window=4, kvc_protect=3, kvc_pool_blocks=120)
    full, compressed = (
        serve(tiny_model, prompts, 16, 6, spec_for(tiny_model, "kvcompress", length, **options), max_seq_length=40)
        for length in (1.0, 0.25)
    )
    assert (
        max(compressed.rows_in_flight) > max(full.rows_in_flight) and full.peak_blocks <= 120 >= compressed.peak_blocks
    )
    heads = 2 * 2  # layers x KV heads
    # blocks the six sequences need uncompressed: 352
    uncompressed = sum(heads * -(-(len(p) + 16) // 2) for p in prompts)
    # in blocks, + a growing block per head: 112
    budgets = sum(heads * round(0.25 * (len(p) + 16)) // 2 + heads for p in prompts)
    # two sequences uncompressed (prompts of 20 and 8 tokens + 16) fill the pool
    assert full.peak_blocks == 72 + 48 == 120
    # all six at their budgets at once
    assert compressed.peak_blocks == budgets < uncompressed and max(compressed.rows_in_flight) == 6
    protected = spec_for(tiny_model, "kvcompress", 0.25, **{**options, "kvc_protect": 40, "kvc_pool_blocks": 90})
    uncompressible = serve(tiny_model, prompts, 16, 6, protected, max_seq_length=40)
    # every KV protected: they outgrow the pool
    assert uncompressible.preemptions > 0 and [len(t) for t in uncompressible.tokens] == [16] * len(prompts)
    with pytest.raises(ValueError, match=r"request 0 \(20 prompt tokens\) needs 48 blocks; the pool has 30"):
        serve(
            tiny_model,
            prompts,
            4,
            2,
            spec_for(tiny_model, "kvcompress", 1.0, **{**options, "kvc_pool_blocks": 30}),
            max_seq_length=40,
        )


def test_cli_serves_a_prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("The capital of France is\n\nWater boils at\nThe largest planet is\n")
    proc = run_cli(
        "--cache_strategy",
        "kvcompress",
        "--prompts_file",
        str(path),
        "--batch_size",
        "2",
        "--max_new_tokens",
        "5",
        "--ignore_eos",
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(line.split("]")[0] for line in proc.stdout.splitlines() if line.startswith("--- [")) == [
        "--- [0",
        "--- [1",
        "--- [2",
    ]
    assert "served 3 requests" in proc.stderr and "15 tokens generated" in proc.stderr and "at most 2)" in proc.stderr


def test_compiled_decode_compiles_a_log_bounded_number_of_view_widths(tiny_model):
    """kvc_block_size 1 without recompression: the largest head grows a block per token, so a
    generation of 100+ tokens crosses many view widths; the compiled step must not recompile for each
    (dynamo's recompile limit is 8) and must give eager's tokens."""
    prompt = [[3, 9, 27, 17, 51, 25, 11, 33]]
    spec = spec_for(tiny_model, "kvcompress", 1.0, kvc_block_size=1, kvc_compress_every=0)
    eager = generate(tiny_model, prompt, 110, spec, max_seq_length=120)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs compiled by earlier tests do not count
    compiled = generate(
        tiny_model, prompt, 110, spec, max_seq_length=120, decode_step=compile_decode_step(torch.device("cpu"))
    )
    assert compiled.tokens == eager.tokens
    paged = tiny_model.layers[0].attention.kv_cache.paged
    widths = {min(paged.max_blocks, VIEW_ROUND << i) for i in range(paged.max_blocks.bit_length())}
    assert len(widths) <= 1 + math.ceil(math.log2(paged.max_blocks / VIEW_ROUND))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= len(widths)


def test_the_default_pool_is_sized_from_the_budget_and_allocates_less_than_a_full_cache(tiny_model):
    """Without kvc_pool_blocks the pool holds each sequence's budget in blocks, a growing block per head
    and the prompts' transient need, not every sequence uncompressed; tokens are those of the old
    default (a pool for every sequence uncompressed), and the report tells allocation from use."""
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    options = dict(kvc_block_size=2, kvc_window=4, kvc_protect=3)
    sized = generate(tiny_model, prompts, 40, spec_for(tiny_model, "kvcompress", 0.25, **options), max_seq_length=60)
    paged = tiny_model.layers[0].attention.kv_cache.paged
    assert paged.pool.n_blocks < paged.full_pool
    assert sized.kv_cache_bytes == paged.pool.n_blocks * paged.pool.block_bytes() < sized.full_cache_bytes
    assert (
        sized.cache_stats["kvcompress: bytes in use"]
        == sized.cache_stats["kvcompress: blocks in use"] * paged.pool.block_bytes()
        <= sized.kv_cache_bytes
    )
    old = generate(
        tiny_model,
        prompts,
        40,
        spec_for(tiny_model, "kvcompress", 0.25, **options, kvc_pool_blocks=paged.full_pool),
        max_seq_length=60,
    )
    assert old.tokens == sized.tokens and old.kv_cache_bytes > sized.full_cache_bytes
    text = cache_report("kvcompress", sized)
    mib = sized.kv_cache_bytes / 2**20
    assert (
        f"{mib:.1f} MiB allocated (a block pool; {sized.cache_stats['kvcompress: bytes in use'] / 2**20:.1f} "
        "MiB in blocks in use)" in text
    )
    assert (
        f"{sized.kv_cache_bytes / sized.full_cache_bytes:.2f}x the" in text
        and "bytes in use" not in text.split("\n", 1)[1]
    )
    dense = generate(tiny_model, prompts, 4, spec_for(tiny_model, "full"), max_seq_length=60)
    assert "MiB allocated (buffers sized by max_seq_length), " in cache_report("full", dense)


def test_an_exhausted_pool_is_a_user_error_naming_the_blocks_and_the_flag(tiny_model):
    spec = spec_for(tiny_model, "kvcompress", 0.5, kvc_block_size=2, kvc_pool_blocks=1)
    with pytest.raises(
        ValueError, match=r"the pool has 1 free blocks of 1, 10 needed; raise --kvc_pool_blocks to at least 10"
    ):
        generate(tiny_model, [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40]], 4, spec)


def test_cli_reports_an_exhausted_pool_in_one_line():
    proc = run_cli("--cache_strategy", "kvcompress", "--kvc_pool_blocks", "1", "--max_new_tokens", "2")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("error: kvcompress: the pool has 1 free blocks of 1")
        and "--kvc_pool_blocks" in proc.stderr
    )


def test_kvcompress_with_flex_attention_generates_the_gathered_paths_tokens_eager_compiled_and_served(tiny_model):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    options = dict(kvc_block_size=2, kvc_window=4, kvc_protect=3, kvc_compress_every=0)
    gathered = generate(tiny_model, prompts, 24, spec_for(tiny_model, "kvcompress", 0.4, **options), max_seq_length=44)
    spec = spec_for(tiny_model, "kvcompress", 0.4, kvc_attention="flex", **options)
    flex = generate(tiny_model, prompts, 24, spec, max_seq_length=44)
    assert tiny_model.layers[0].attention.kv_cache.attends_itself
    assert (
        flex.tokens == gathered.tokens
        and flex.cache_stats == gathered.cache_stats
        and flex.cache_stats["kvcompress: blocks freed"] > 0
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = compile_decode_step(torch.device("cpu"))
    compiled = generate(tiny_model, prompts, 24, spec, max_seq_length=44, decode_step=step)
    # one block-mask shape: no recompiles
    assert compiled.tokens == gathered.tokens and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    other = [SERVED[2], SERVED[1][:3]]  # a batch whose pool is sized differently: one more graph, at that size
    gathered_other = generate(
        tiny_model, other, 24, spec_for(tiny_model, "kvcompress", 0.4, **options), max_seq_length=44
    )
    assert generate(tiny_model, other, 24, spec, max_seq_length=44, decode_step=step).tokens == gathered_other.tokens
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    served = serve(tiny_model, SERVED, 12, 2, spec, max_seq_length=40)
    assert (
        served.tokens
        == serve(
            tiny_model, SERVED, 12, 2, spec_for(tiny_model, "kvcompress", 0.4, **options), max_seq_length=40
        ).tokens
    )


def test_flex_attention_with_continual_compression_is_refused_naming_both_settings():
    with pytest.raises(ValueError, match="kvc_attention flex needs kvc_compress_every 0 \\(got 1\\)"):
        PagedKV(1, 1, 2, 4, torch.float32, None, history=64, attention="flex")
    with pytest.raises(ValueError, match="kvc_attention must be one of gather, flex; got 'paged'"):
        PagedKV(1, 1, 2, 4, torch.float32, None, history=64, attention="paged", compress_every=0)


@pytest.mark.parametrize("how", ["resize", "grow"])
def test_a_pool_sized_for_a_batch_is_refused_before_allocating_more_than_is_free(monkeypatch, how):
    """No --kvc_pool_blocks: the pool grows to what the batch needs. Past the free memory that is one error naming
    the flags to lower, and the pool keeps its blocks, rather than the allocator's error or the OOM killer."""
    pool = BlockPool(4, 16, 8, torch.float32)
    footprint = BlockPool.block_footprint(16, 8, torch.float32)
    monkeypatch.setattr("kvlab.pool.free_memory", lambda device: 10 * footprint)
    getattr(pool, how)(14)  # 10 more blocks: exactly what is free
    assert pool.n_blocks == 14
    with pytest.raises(
        ValueError,
        match=r"the pool needs 25 blocks of 16 slots \(--kvc_block_size\).*lower --kvc_block_size or "
        r"--batch_size.*at most 24 blocks of this size fit",
    ):
        getattr(pool, how)(25)
    assert pool.n_blocks == 14

"""The paged KV-Compress cache (paged.py): compaction keeps exactly the chosen KVs with their positions
and metrics, freed block counts are exact, the paged view attends like a contiguous cache, block size 1
is a top-k over all heads, a batch equals one-by-one runs, the metrics agree with a direct computation,
and compiled == eager."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import spec_for
from kvlab.attention import grouped_attention
from kvlab.block_tables import VIEW_ROUND
from kvlab.engine import compile_decode_step, generate
from kvlab.paged import PagedKV
from kvlab.pool import BlockPool, PoolExhausted
from kvlab.report import cache_report
from kvlab.serving import serve
from test_generate import run_cli


def filled_pool(
    L=2, B=1, H=2, T=45, D=4, block_size=4, seed=0, **options
) -> tuple[PagedKV, torch.Tensor, torch.Tensor]:
    """A PagedKV holding a T-token prompt in every layer (nothing evicted yet), with random metrics.
    Keys encode (layer, head, position) so tests can tell which KV sits where."""
    g = torch.Generator().manual_seed(seed)
    paged = PagedKV(L, B, H, D, torch.float32, None, history=64, block_size=block_size, **options)
    input_pos = torch.arange(T).expand(B, T)
    for layer in range(L):
        k = torch.zeros(B, H, T, D)
        k[..., 0], k[..., 1] = layer, torch.arange(H)[:, None].float()
        k[..., 2] = torch.arange(T).float()
        paged.write_prompt(layer, input_pos, k, k + 0.5, torch.randn(B, 2 * H, T, D, generator=g))
    metrics = torch.rand(paged.pool.metric.shape, generator=g)
    paged.pool.metric.copy_(metrics)
    return paged, input_pos, metrics


def compressed_pool(D: int, **options) -> PagedKV:
    """One layer, 3 rows: rows 0 and 1 compressed to different lengths (heads holding different block counts, last
    blocks partly filled), row 2 released (idle); random keys and values, every head given room for its next KV."""
    paged, _, _ = filled_pool(L=1, B=3, H=2, T=45, D=D, block_size=4, seed=5, **options)
    paged.pool.k.normal_()
    paged.pool.v.normal_()
    paged.budget[0], paged.budget[1] = 9, 14
    paged.release_row(2)
    for row in (0, 1):
        paged.compress_row(row)
    paged.make_room()
    return paged


def held(paged: PagedKV, row: int = 0) -> dict[tuple[int, int], dict[int, tuple[torch.Tensor, float]]]:
    """(layer, head) -> {position: (key, metric)} of the KVs a sequence holds, read through its block table."""
    out = {}
    L, _, H, _ = paged.table.shape
    for layer in range(L):
        for head in range(H):
            n = int(paged.length[layer, row, head])
            slots = paged._slot_ids(paged.table[layer, row, head])[:n]
            pos = paged.pool.pos.view(-1)[slots]
            assert (pos >= 0).all() and (
                paged.pool.pos.view(-1)[paged._slot_ids(paged.table[layer, row, head])[n:]] < 0
            ).all()
            keys, metric = paged.pool.k.view(-1, paged.pool.k.shape[-1])[slots], paged.pool.metric.view(-1)[slots]
            out[layer, head] = {int(p): (keys[i], float(metric[i])) for i, p in enumerate(pos)}
    return out


def check_pool_invariants(paged: PagedKV) -> None:
    """Every block in a table is in use exactly once, heads hold ceil(length / block) blocks, and the
    pool's free count is what the tables leave."""
    ids = paged.table[paged.table >= 0]
    assert ids.unique().numel() == ids.numel() and paged.pool.in_use[ids].all()
    assert paged.pool.free_blocks() == paged.pool.n_blocks - ids.numel()
    blocks, bs = (paged.table >= 0).sum(dim=-1), paged.block_size
    # make_room's block for the next token
    room_for_next = paged.active[None, :, None] & (blocks == paged.length // bs + 1)
    assert ((blocks == (paged.length + bs - 1) // bs) | room_for_next).all()


def reference_eviction(
    paged: PagedKV, metrics: dict, budget_blocks: int, protect_from: int
) -> set[tuple[int, int, int]]:
    """KV-Compress eviction written out plainly: per head, sort by metric (protected last), cut into
    chunks from the bottom (the first one partial), evict the chunks with the lowest maxima over all
    heads until the blocks fit. Returns the kept (layer, head, position)."""
    bs = paged.block_size
    chunks, held_blocks = [], 0
    for (layer, head), kvs in metrics.items():
        order = sorted(kvs, key=lambda p: (math.inf if p >= protect_from else kvs[p][1], 0))
        n = len(order)
        blocks = -(-n // bs)
        held_blocks += blocks
        first = n - (blocks - 1) * bs
        for c in range(blocks):
            members = order[: first + c * bs]
            top = math.inf if members[-1] >= protect_from else kvs[members[-1]][1]
            chunks.append((top, layer, head, c, members))
    chunks.sort(key=lambda x: (x[0], x[1], x[2], x[3]))
    evicted: dict[tuple[int, int], list[int]] = {}
    for top, layer, head, _, members in chunks[: max(held_blocks - budget_blocks, 0)]:
        if top < math.inf:
            evicted[layer, head] = members
    return {
        (layer, head, p)
        for (layer, head), kvs in metrics.items()
        for p in kvs
        if p not in evicted.get((layer, head), [])
    }


@pytest.mark.parametrize("block_size", [1, 4])
def test_compression_keeps_exactly_the_intended_kvs_with_positions_and_metrics(block_size):
    paged, _, _ = filled_pool(block_size=block_size)
    before = held(paged)
    blocks_before, free_before = paged.blocks_in_use(), paged.pool.free_blocks()
    paged.budget[0] = 10  # tokens per head and layer: 2 layers x 2 heads x 10 = 40 of 180 KVs
    freed = paged.compress_row(0)
    after = held(paged)
    expected = reference_eviction(paged, before, 2 * 2 * 10 // block_size, protect_from=45 - paged.protect)
    assert {(layer, head, p) for (layer, head), kvs in after.items() for p in kvs} == expected
    for (layer, head), kvs in after.items():
        for p, (key, metric) in kvs.items():
            # each KV moved with its position and metric
            assert key.tolist() == [layer, head, p, 0.0] and metric == before[layer, head][p][1]
        assert list(kvs) == sorted(kvs)  # survivors keep their order
    assert paged.blocks_in_use() <= 2 * 2 * 10 // block_size
    assert freed == blocks_before - paged.blocks_in_use() == paged.pool.free_blocks() - free_before
    assert paged.counts["kvcompress: blocks freed"] == freed
    check_pool_invariants(paged)


def test_block_size_one_keeps_the_top_k_over_all_layers_and_heads():
    paged, _, _ = filled_pool(L=3, H=3, block_size=1, window=4, protect=0)
    before = held(paged)
    paged.budget[0] = 7
    paged.compress_row(0)
    everything = sorted(
        ((m, layer, head, p) for (layer, head), kvs in before.items() for p, (_, m) in kvs.items()), reverse=True
    )
    top_k = {(layer, head, p) for _, layer, head, p in everything[: 3 * 3 * 7]}
    assert {(layer, head, p) for (layer, head), kvs in held(paged).items() for p in kvs} == top_k
    lengths = paged.length[:, 0].flatten().tolist()
    assert sum(lengths) == 63 and len(set(lengths)) > 1  # heads and layers keep different amounts


def test_layer_scope_and_head_floor_bound_each_layer_and_head():
    paged, _, _ = filled_pool(L=2, H=3, block_size=1, scope="layer", head_floor=0.5, protect=0)
    before = held(paged)
    paged.budget[0] = torch.tensor([4, 12])
    paged.compress_row(0)
    assert paged.length[:, 0].sum(dim=-1).tolist() == [12, 36]  # per layer: its budget x heads
    for (layer, head), kvs in held(paged).items():
        best = sorted(before[layer, head], key=lambda p: -before[layer, head][p][1])[: math.ceil(0.5 * [4, 12][layer])]
        assert set(best) <= set(kvs)  # the floor: each head's own best half-share survives


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    budget=st.integers(1, 40),
    lengths=st.lists(st.integers(1, 45), min_size=2, max_size=2),
    seed=st.integers(0, 1000),
)
def test_pool_invariants_hold_through_prefill_compression_and_decoding(block_size, budget, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    L, B, H, D = 2, 2, 2, 4
    paged = PagedKV(L, B, H, D, torch.float32, None, history=64, block_size=block_size, window=3, kernel=3, protect=2)
    T = max(lengths)
    input_pos = torch.where(torch.arange(T) < torch.tensor(lengths)[:, None], torch.arange(T), -1)
    paged.budget.fill_(budget)
    for layer in range(L):
        paged.write_prompt(
            layer,
            input_pos,
            torch.randn(B, H, T, D, generator=g),
            torch.randn(B, H, T, D, generator=g),
            torch.randn(B, 2 * H, T, D, generator=g),
        )
    check_pool_invariants(paged)
    for step in range(6):
        current = torch.tensor(lengths)[:, None] + step
        for layer in range(L):
            keys, values, pos = paged.append(
                layer, current, torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
            )
            assert (pos == current[:, :, None]).sum(dim=-1).eq(1).all()  # the new token is attended, once per head
            probs = torch.rand(B, H, 2, 1, pos.shape[-1], generator=g).masked_fill(pos[:, :, None, None] < 0, 0.0)
            paged.observe(layer, probs)
        paged.maintain()
        check_pool_invariants(paged)
        blocks = (paged.table >= 0).sum(dim=(0, 2, 3))
        # the chunks holding a head's protected KVs stay
        least = L * H * -(-(paged.protect + block_size - 1) // block_size)
        # + a block per head for the next token
        assert (blocks <= max(budget * L * H // block_size, least) + L * H).all()


def test_paged_view_attends_like_a_contiguous_cache_of_each_heads_kvs():
    paged, _, _ = filled_pool(L=1, B=1, H=2, block_size=4, seed=3)
    paged.pool.k.normal_()
    paged.pool.v.normal_()
    paged.budget[0] = 9
    paged.compress_row(0)
    paged.make_room()
    kept = held(paged)
    keys, values, pos = paged.view(0, 1)
    q = torch.randn(1, 4, 1, 4)
    query_pos = torch.tensor([[44]])
    mask = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= query_pos[:, None, :, None])
    y, _ = grouped_attention(q, keys, values, mask, False)
    for head in range(4):
        kv_head = head // 2
        n = int(paged.length[0, 0, kv_head])
        slots = paged._slot_ids(paged.table[0, 0, kv_head])[:n]
        k, v = paged.pool.k.view(-1, 4)[slots], paged.pool.v.view(-1, 4)[slots]
        assert len(kept[0, kv_head]) == n
        expected = (q[0, head, 0] @ k.T / 2).softmax(dim=-1) @ v
        torch.testing.assert_close(y[0, head, 0], expected)


def test_prompt_metrics_agree_with_a_direct_computation():
    torch.manual_seed(0)
    B, H, group, T, D = 1, 2, 2, 30, 8
    k, q = torch.randn(B, H, T, D), torch.randn(B, H * group, T, D)
    input_pos = torch.arange(T)[None]
    probs = (
        (q.view(B, H, group, T, D) @ k[:, :, None].transpose(-1, -2) / D**0.5)
        .masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        .softmax(dim=-1)
    )
    window = PagedKV(1, B, H, D, torch.float32, None, history=T, window=8, kernel=7)
    squared = probs[..., -8:, :].square().sum(dim=(2, 3))
    pooled = torch.nn.functional.max_pool1d(squared.view(H, 1, T), 7, stride=1, padding=3).view(B, H, T)
    torch.testing.assert_close(window._prompt_metric(input_pos, k, q), pooled)
    full = PagedKV(1, B, H, D, torch.float32, None, history=T, full=True, skip=10, metric="l1")
    far = (torch.arange(T)[:, None] - torch.arange(T)[None, :]) >= 10
    torch.testing.assert_close(full._prompt_metric(input_pos, k, q), (probs * far).sum(dim=(2, 3)))
    assert full.protect == 32 and window.protect == 8


def test_decode_attention_accumulates_squared_probabilities():
    paged, input_pos, _ = filled_pool(L=1, block_size=4)
    paged.make_room()
    paged.pool.metric.zero_()
    _, _, pos = paged.append(0, torch.tensor([[45]]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    probs = torch.rand(1, 2, 2, 1, pos.shape[-1]) * (pos[:, :, None, None] >= 0)
    paged.observe(0, probs)
    paged.observe(0, probs)
    slots = paged._slot_ids(paged.table[0, :, :, : paged.view_blocks])
    torch.testing.assert_close(paged.pool.metric.view(-1)[slots], 2 * probs.square().sum(dim=(2, 3)))


def test_an_exhausted_pool_says_so():
    paged = PagedKV(1, 1, 2, 4, torch.float32, None, history=64, block_size=4, pool_blocks=5)
    with pytest.raises(PoolExhausted, match="the pool has 5 free blocks of 5, 6 needed"):
        paged.write_prompt(
            0, torch.arange(10)[None], torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 4, 10, 4)
        )


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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_over_the_pool_equals_attention_over_the_gathered_view(compiled):
    """Two rows of different lengths after compression (heads holding different block counts, last
    blocks partly filled), and an idle third row: FlexAttention over the pool from the block tables
    gives the gathered view's attention for every active row and query head, and writes the same KVs."""
    paged = compressed_pool(D=8, attention="flex", compress_every=0)
    gathered = copy.deepcopy(paged)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
    input_pos = torch.tensor([[45], [45], [-1]])
    keys, values, pos = gathered.append(0, input_pos, k, v)
    expected, _ = grouped_attention(
        q, keys, values, (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= input_pos[:, None, :, None]), False
    )
    attend = torch.compile(paged.attend) if compiled else paged.attend
    y = attend(0, input_pos, k, v, q)
    assert (paged.length[0, 0] != paged.length[0, 1]).any() and (paged.length[0, :2] % 4 != 0).all()
    torch.testing.assert_close(y[:2], expected[:2])
    assert (y[2] == 0).all()
    assert (
        torch.equal(paged.length, gathered.length)
        and torch.equal(paged.pool.k, gathered.pool.k)
        and torch.equal(paged.pool.pos, gathered.pool.pos)
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

"""The paged KV-Compress cache (paged.py): compaction keeps exactly the chosen KVs with their positions
and metrics, freed block counts are exact, the paged view attends like a contiguous cache (FlexAttention over
the pool too), block size 1 is a top-k over all heads, and the metrics agree with a direct computation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.attention import grouped_attention
from kvlab.paged import PagedKV
from kvlab.pool import PoolExhausted


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

"""Storage sized by what each head keeps (kvlab/compact.py): the native attention over per-head rows agrees with the
dense kernel and torch's, the packed rows hold exactly the budgets, and generation with uneven budgets gives the
same tokens in fewer bytes, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from kvlab import kernels
from kvlab.attention import attention_mask, grouped_attention
from kvlab.compact import CompactKVStorage, make_kv_store
from kvlab.config import cache_spec
from kvlab.engine import compile_decode_step, generate
from kvlab.report import cache_report
from kvlab.storage import HalfKVStorage, QuantizedKVStorage

needs_native = pytest.mark.skipif(not kernels.NATIVE, reason=f"native kernels: {kernels.REASON}")


def uneven_heads(B: int, H: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head budgets in 1..C (one head of each row keeps nothing, one keeps all C) and positions [B, H, C] whose
    first `budget` slots are filled (in shuffled order, some left empty) and the rest -1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, C + 1, (B, H), generator=g)
    lengths[:, 0], lengths[:, -1] = 0, C
    pos = torch.stack([torch.randperm(C, generator=g) for _ in range(B * H)]).view(B, H, C)
    pos = pos.masked_fill(torch.rand(B, H, C, generator=g) < 0.1, -1)
    return lengths, pos.masked_fill(torch.arange(C) >= lengths[..., None], -1)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [8, 64])
def test_ragged_attention_matches_the_dense_kernel_and_torch(dtype, D):
    B, Hkv, G, T, C = 2, 3, 2, 2, 600  # three tasks of 256 slots per head: heads end inside, at and past a task
    lengths, pos = uneven_heads(B, Hkv, C, seed=D)
    g = torch.Generator().manual_seed(1)
    dense_k, dense_v = (torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    query_pos = torch.tensor([[C - 2, C - 1], [300, 301]])
    storage = CompactKVStorage((B, Hkv, C, D), torch.float32, dtype)
    storage.write(torch.arange(C).expand(B, Hkv, C), dense_k, dense_v, prompt=True)
    storage.compact(lengths)
    assert storage.k.shape == (int(lengths.sum()) + 1, D)
    ragged = storage.attend(q, pos, query_pos)
    dense = torch.ops.kvlab.attend_fp32(q, dense_k, dense_v, pos, query_pos)
    mask = attention_mask(pos, query_pos)
    reference = grouped_attention(q.double(), dense_k.double(), dense_v.double(), mask, False)[0].nan_to_num(
        0.0
    )  # seeing nothing: 0
    atol = kernels.reordering_atol(C, float(dense_v.float().abs().max()), chain=2)
    torch.testing.assert_close(ragged, dense, rtol=0, atol=atol)
    torch.testing.assert_close(ragged.double(), reference, rtol=0, atol=atol)
    assert ragged[0, :G].abs().sum() == 0  # head 0 of row 0 keeps nothing: its queries see no slot


@needs_native
def test_ragged_attention_refuses_rows_past_the_store():
    q, k = torch.zeros(1, 2, 1, 16), torch.zeros(10, 16)
    pos, query_pos = torch.zeros(1, 2, 8, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="head 1 holds rows 6 \\+ 5 of 10"):
        torch.ops.kvlab.attend_ragged(q, k, k, pos, torch.tensor([[0, 6]]), torch.tensor([[6, 5]]), query_pos)


def test_compacted_storage_reads_and_writes_each_head_in_its_own_rows():
    B, H, C, D = 2, 3, 5, 4
    storage = CompactKVStorage((B, H, C, D), torch.float32, torch.float32)
    k, v = torch.randn(B, H, C, D), torch.randn(B, H, C, D)
    storage.write(torch.arange(C).expand(B, H, C), k, v, prompt=True)
    dense_bytes = storage.nbytes()
    lengths = torch.tensor([[2, 5, 0], [1, 3, 4]])
    storage.compact(lengths)
    assert storage.compacted and storage.nbytes() == (int(lengths.sum()) + 1) * D * 4 * 2 < dense_bytes
    held = torch.arange(C) < lengths[..., None]
    keys, values = storage.read()
    assert torch.equal(keys[held], k[held]) and torch.equal(values[held], v[held])
    new_k, new_v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    slot = torch.tensor(
        [[[1], [4], [0]], [[0], [2], [3]]]
    )  # head (0, 2) keeps nothing: its write goes to the scratch row
    storage.write(slot, new_k, new_v)
    keys, values = storage.read()
    k.scatter_(2, slot[..., None].expand(B, H, 1, D), new_k)
    assert torch.equal(keys[held], k[held])
    assert torch.equal(storage.k[-1], new_k[0, 2, 0])
    storage.reset()  # a compacted store goes back to nothing; the next prompt's first write allocates the dense form
    assert (
        not storage.compacted and not storage.allocated and storage.k.numel() == 0 and storage.nbytes() == dense_bytes
    )
    storage.write(torch.arange(C).expand(B, H, C), k, v, prompt=True)
    assert storage.k.shape == (B, H, C, D) and storage.nbytes() == dense_bytes and torch.equal(storage.read()[0], k)


def test_every_head_keeping_every_slot_stays_dense():
    storage = CompactKVStorage((1, 2, 4, 8), torch.float32, torch.float16)
    storage.write(torch.arange(4).expand(1, 2, 4), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), prompt=True)
    storage.compact(torch.tensor([[4, 4]]))
    assert not storage.compacted and storage.k.shape == (1, 2, 4, 8)


def test_packed_integer_and_pruned_storage_stay_dense():
    shape = (1, 2, 4, 8)
    assert isinstance(make_kv_store("compact", shape, torch.float32, None, 16), CompactKVStorage)
    assert isinstance(make_kv_store("dense", shape, torch.float32, None, 16), HalfKVStorage)
    assert isinstance(make_kv_store("compact", shape, torch.float32, None, 8), QuantizedKVStorage)
    assert not isinstance(make_kv_store("compact", shape, torch.float32, None, None, key_pruning=0.5), CompactKVStorage)
    with pytest.raises(ValueError, match="kv_store must be one of compact, dense, got 'ragged'"):
        make_kv_store("ragged", shape, torch.float32, None, None)


# decode scoring keys (keydiff), attention (heavy_hitter: the probabilities' path) or nothing (recent_global)
UNEVEN = {
    "adakv": dict(cache_strategy="keydiff", prompt_compression_strategy="snapkv", snapkv_window=4, head_budget="adakv"),
    "adakv_attention": dict(
        cache_strategy="heavy_hitter", prompt_compression_strategy="snapkv", snapkv_window=4, head_budget="adakv"
    ),
    "global": dict(
        cache_strategy="recent_global", prompt_compression_strategy="l2", head_budget="global", recent_window=0
    ),
    "pyramid": dict(cache_strategy="keydiff", layer_budget="pyramid", compression_ratio=0.5, recent_window=1),
}


@pytest.mark.parametrize("plan", sorted(UNEVEN))
def test_uneven_budgets_give_the_same_tokens_in_the_bytes_they_keep(tiny_model, plan):
    settings = {"max_cache_length": 0.5, **UNEVEN[plan]} if "compression_ratio" not in UNEVEN[plan] else UNEVEN[plan]
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1], [7, 21, 63, 1, 8, 30, 45, 12]]
    n_layer = tiny_model.config.n_layer
    dense = generate(
        tiny_model, prompts, 12, cache_spec({**settings, "global_tokens": 1, "kv_store": "dense"}, n_layer)
    )
    spec = cache_spec({**settings, "global_tokens": 1}, n_layer)
    compact = generate(tiny_model, prompts, 12, spec)
    caches = [layer.attention.kv_cache for layer in tiny_model.layers]
    assert compact.tokens == dense.tokens
    assert any(c.storage.compacted for c in caches)
    # a compacted layer: every head's budget (its decoded tokens included) + the scratch row; a layer keeping C slots
    # in every head stays dense
    rows = sum(int(c.row_capacity.sum()) + 1 if c.storage.compacted else c.pos.numel() for c in caches)
    D, itemsize = tiny_model.config.head_dim, caches[0].storage.k.itemsize
    assert compact.kv_cache_bytes == rows * 2 * D * itemsize < dense.kv_cache_bytes
    assert all(c.attends_itself == (kernels.NATIVE and not c.needs_attention) for c in caches)
    compacted = sum(c.storage.compacted for c in caches)
    dense_mib = dense.kv_cache_bytes / 2**20
    told = f"MiB allocated (each head's budget in {compacted} of {n_layer} layers; {dense_mib:.1f} MiB in buffers sized"
    assert f"{compact.kv_cache_bytes / 2**20:.1f} {told}" in cache_report(plan, compact)
    torch._dynamo.reset()
    compiled = generate(tiny_model, prompts, 12, spec, decode_step=compile_decode_step(torch.device("cpu")))
    assert compiled.tokens == compact.tokens


def test_a_replayed_prefill_holds_one_layer_dense_at_a_time(tiny_model, monkeypatch):
    """KVzip's model-wide ranking replays a recorded prefill: each layer's dense buffers are allocated as it is
    filled and freed as it is compacted, so the peak holds one layer's dense form, not every layer's."""
    dense_at_once = []
    allocate = CompactKVStorage.dense

    def counting(storage):
        allocate(storage)
        storages = [layer.attention.kv_cache.storage for layer in tiny_model.layers]
        dense_at_once.append(sum(s.allocated and not s.compacted for s in storages))

    monkeypatch.setattr(CompactKVStorage, "dense", counting)
    spec = cache_spec({**UNEVEN["global"], "max_cache_length": 0.5, "global_tokens": 1}, tiny_model.config.n_layer)
    for prompt in (
        [3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22, 9, 48, 13, 1],
        [7, 21, 63, 1, 8, 30, 45, 12],
    ):
        generate(tiny_model, [prompt], 4, spec)
        assert max(dense_at_once) == 1 and all(
            layer.attention.kv_cache.storage.compacted for layer in tiny_model.layers
        )


def test_a_dense_cache_reused_for_another_prompt_keeps_its_buffers(tiny_model):
    spec = cache_spec(
        {"cache_strategy": "keydiff", "max_cache_length": 12, "recent_window": 1}, tiny_model.config.n_layer
    )
    generate(tiny_model, [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6, 14, 60, 31, 22]], 4, spec)
    storage = tiny_model.layers[0].attention.kv_cache.storage
    assert isinstance(storage, CompactKVStorage) and not storage.compacted  # every head keeps all 12 slots
    before = storage.k.data_ptr()
    generate(
        tiny_model, [[7, 21, 63, 1, 8, 30, 45, 12, 4, 4, 19, 23, 2, 50, 61, 3]], 4, spec
    )  # the same length: the cache is reused
    assert tiny_model.layers[0].attention.kv_cache.storage is storage and storage.k.data_ptr() == before

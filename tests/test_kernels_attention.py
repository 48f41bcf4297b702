"""The native CPU attention kernel against torch: any slots, an empty slot holding NaN, positions past int32,
a query that sees no slot; a decode step and greedy text with it against torch's."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, native, spec_for
from kvlab import kernels
from kvlab.build import make_caches
from kvlab.engine import generate
from kvlab.kernels.__main__ import attention_reference
from tolerance import assert_reordered_close


def attention_inputs(
    batch: int, heads: int, kv_heads: int, steps: int, slots: int, dim: int, per_head: bool, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random q, k, v and positions: some slots empty (-1), some later than the earliest query (masked)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, heads, steps, dim, generator=g),
        torch.randn(batch, kv_heads, slots, dim, generator=g),
        torch.randn(batch, kv_heads, slots, dim, generator=g),
    )
    key_pos = torch.randint(-1, slots + steps, (batch, kv_heads, slots) if per_head else (batch, slots), generator=g)
    key_pos[..., 0] = 0
    return q, k, v, key_pos, torch.arange(slots, slots + steps).expand(batch, steps)


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,steps,slots,dim,per_head",
    [
        (1, 9, 3, 1, 512, 64, False),
        (1, 9, 3, 1, 2049, 64, True),
        (2, 4, 2, 3, 257, 64, False),
        (3, 8, 8, 8, 33, 40, True),
        (1, 2, 1, 1, 1, 16, False),
        (1, 4, 4, 1, 101, 32, False),
        (1, 2, 1, 2, 40, 272, False),
    ],
)
def test_attention_equals_torch_over_any_slots(batch, heads, kv_heads, steps, slots, dim, per_head, kv_dtype):
    """Decode attention over a cache's slots (shared or per-head positions, empty and future slots masked;
    one or several runs of 256 slots merged; blocks of 16 keys (AVX-512) and 4 (AVX2) with a tail; head_dim 64
    (four vectors a step), 32 and 16 (AVX2: two), 40 (one at a time; no whole number of AVX-512's vectors: the
    scalar path there), or wider than the SIMD paths take (272: the scalar path); up to 8 query positions, so
    1 to 8 rows per KV head, in groups of three for AVX2's scores and four for the weighted sums; keys and
    values float32, float16 or bfloat16, a 16-bit cache's, which widen to float32 exactly) against grouped_attention
    under attention_mask over the widened keys and values, within the bound `attention_reference` derives."""
    q, k, v, key_pos, query_pos = attention_inputs(batch, heads, kv_heads, steps, slots, dim, per_head)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    want, atol = attention_reference(q, k.float(), v.float(), key_pos, query_pos)
    torch.testing.assert_close(torch.ops.kvlab.attend_fp32(q, k, v, key_pos, query_pos), want, rtol=0, atol=atol)


@native
def test_attention_that_ignores_the_mask_is_caught():
    """The bound is far below a masking fault: attending over every slot, future and empty ones too, fails it."""
    q, k, v, key_pos, query_pos = attention_inputs(1, 9, 3, 1, 300, 64, True)
    want, atol = attention_reference(q, k, v, key_pos, query_pos)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            torch.ops.kvlab.attend_fp32(q, k, v, torch.zeros_like(key_pos), query_pos), want, rtol=0, atol=atol
        )


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_empty_slot_holding_nan_adds_nothing(kv_dtype):
    """An empty slot (-1) may hold anything, NaN included (a slot never written, a block of a pool): the rows
    that do not see it get what torch gives over the cache with that slot zeroed. Slots 5 and 37 sit inside
    a block of 16 (8) keys whose other slots are seen, so the block is read and only the slot is dropped."""
    q, k, v, key_pos, query_pos = attention_inputs(1, 9, 3, 1, 40, 64, False)
    key_pos[..., [5, 37]] = -1
    want, atol = attention_reference(q, k, v, key_pos, query_pos)
    k[..., [5, 37], :], v[..., [5, 37], :] = float("nan"), float("nan")
    got = torch.ops.kvlab.attend_fp32(q, k.to(kv_dtype), v.to(kv_dtype), key_pos, query_pos)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@native
def test_attention_refuses_positions_past_int32():
    """Positions are compared as int32: a query position of 2^31 - 1 or more is a one-line error, not a wrong mask."""
    q, k, v, key_pos, _ = attention_inputs(1, 2, 1, 1, 8, 16, False)
    with pytest.raises(RuntimeError, match="query positions must be below 2\\^31 - 1, got 2147483647"):
        torch.ops.kvlab.attend_fp32(q, k, v, key_pos, torch.tensor([[2**31 - 1]]))


@native
def test_a_query_that_sees_no_slot_gets_zeros_as_in_torch():
    q, k, v, _, _ = attention_inputs(1, 4, 2, 2, 3, 16, False)
    # the first query sees none, the second one slot
    key_pos, query_pos = torch.tensor([[2, -1, 3]]), torch.tensor([[1, 2]])
    y = torch.ops.kvlab.attend_fp32(q, k, v, key_pos, query_pos)
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0])) and torch.allclose(
        y[:, :, 1], v[:, :, [0]].repeat_interleave(2, 1)[:, :, 0], atol=1e-6
    )


@native
@pytest.mark.parametrize("strategy", ["full", "l2"])
def test_decode_step_with_native_attention_matches_torch(strategy, monkeypatch):
    """A tiny model's decode step over a full cache and a compressed one (per-head slots, 6 of 9 prompt
    tokens kept) on every native kernel against torch's: logits to summation order through its chain of sums."""
    model = make_tiny_model()
    logits = {}
    for native_path in (True, False):
        monkeypatch.setattr(kernels, "NATIVE", native_path)
        options = {} if strategy == "full" else {"global_tokens": 1, "recent_window": 2}
        model.setup_caches(make_caches(strategy, 2, 2, 2, 16 if strategy == "full" else 6, 8, torch.float32, **options))
        with torch.no_grad():
            model(torch.arange(18).view(2, 9) * 3 % 64, torch.arange(9).expand(2, 9), prefill=True)
            logits[native_path] = model(torch.tensor([[4], [6]]), torch.full((2, 1), 9))
    assert_reordered_close(logits[True], logits[False], terms=64, chain=4 * model.config.n_layer + 1)


@native
@pytest.mark.parametrize("prompt", ["The history of the printing press begins", "What is the capital of France?"])
def test_native_and_torch_kernels_give_the_same_greedy_text(smollm, prompt, monkeypatch):
    """The default model, the README's prompts: the same 24 greedy tokens on either path (the weights stay
    row-major: torch's kernels take them as they are)."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(prompt)
    tokens = {}
    for native_path in (True, False):
        monkeypatch.setattr(kernels, "NATIVE", native_path)
        tokens[native_path] = generate(model, [ids], 24, spec_for(model, "full")).tokens
    assert tokens[True] == tokens[False]

"""kvlab's native prefill attention (kvlab::attend_prefill) against torch: a prompt over itself, a chunk over held slots
and its own, compressed caches' slots in any order, 16-bit caches, padding, NaN in empty slots, every instruction set,
inside torch.compile, and a model's prefill and chunked prefill with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import cpu_isas, run_module

from conftest import make_tiny_model
from kvlab import kernels
from kvlab.attention import causal_attention_lse
from kvlab.build import make_caches
from kvlab.kernels.__main__ import prefill_attention_reference

native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def inputs(batch, heads, kv_heads, steps, held, dim, per_head=False, seed=0):
    """Queries at held..held+steps (the second row's last three padding) over `held` slots at shuffled positions, some
    empty, then the queries' own keys; per KV head positions if `per_head`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, steps, dim, generator=g)
    k, v = torch.randn(2, batch, kv_heads, held + steps, dim, generator=g)
    query_pos = torch.arange(held, held + steps).repeat(batch, 1)
    if batch > 1:
        query_pos[1, -3:] = -1
    shape = (batch, kv_heads) if per_head else (batch,)
    earlier = torch.stack([torch.randperm(held, generator=g) for _ in range(int(torch.tensor(shape).prod()))]).reshape(
        *shape, held
    )
    earlier[..., ::7] = -1
    own = query_pos[:, None].expand(*shape, steps) if per_head else query_pos
    return q, k, v, torch.cat([earlier, own], dim=-1), query_pos


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,steps,held,dim,per_head",
    [
        (1, 9, 3, 130, 0, 64, False),
        (2, 9, 3, 70, 200, 64, False),
        (2, 4, 2, 33, 65, 64, True),
        (1, 4, 4, 1, 10, 64, False),
        (2, 8, 8, 12, 50, 40, True),
        (1, 2, 1, 45, 64, 32, False),
        (1, 2, 1, 20, 30, 128, False),
    ],
)
def test_prefill_attention_equals_torch(batch, heads, kv_heads, steps, held, dim, per_head, kv_dtype):
    """Outputs and log-sum-exps against torch's masked softmax over the widened keys and values, within the bounds
    `prefill_attention_reference` derives: query blocks of 32 with and without a tail, key blocks of 64 seen in full, in
    part or not at all, GQA groups of 1 to 3, head sizes the AVX-512 path takes (64, 128), the AVX2 path only (32) and
    neither (40: the scalar path), a padding query seeing every filled slot."""
    q, k, v, key_pos, query_pos = inputs(batch, heads, kv_heads, steps, held, dim, per_head)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    want, want_lse, atol, lse_atol = prefill_attention_reference(q, k.float(), v.float(), key_pos, query_pos)
    y, lse = torch.ops.kvlab.attend_prefill(q, k, v, key_pos, query_pos)
    torch.testing.assert_close(y, want, rtol=0, atol=atol)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=lse_atol)


@native
def test_prefill_attention_that_ignores_the_mask_is_caught():
    """The bound is far below a masking fault: every slot seen by every query fails it."""
    q, k, v, key_pos, query_pos = inputs(1, 9, 3, 40, 30, 64)
    want, _, atol, _ = prefill_attention_reference(q, k, v, key_pos, query_pos)
    y, _ = torch.ops.kvlab.attend_prefill(q, k, v, torch.zeros_like(key_pos), query_pos)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(y, want, rtol=0, atol=atol)


@native
def test_causal_prefill_equals_torchs_flash_attention():
    """A prompt over itself (strided q, as the model's transpose gives it) against scaled_dot_product_attention."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 200, 9, 64, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 2, 3, 200, 64, generator=g)
    y, lse = causal_attention_lse(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    score_error = kernels.reordering_atol(64, (q.abs().amax() * k.abs().amax() * 8).item())
    v_max = v.abs().amax().item()
    torch.testing.assert_close(
        y, want, rtol=0, atol=v_max * (2 * score_error + 8 * 2.0**-24) + kernels.reordering_atol(200, v_max)
    )
    assert lse.shape == (2, 9, 200) and torch.isfinite(lse).all()


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_an_empty_slot_holding_nan_adds_nothing(kv_dtype):
    """Empty slots (-1) may hold NaN (a block never written): no output or log-sum-exp sees it."""
    q, k, v, key_pos, query_pos = inputs(2, 4, 2, 40, 70, 64)
    want, want_lse, atol, lse_atol = prefill_attention_reference(q, k, v, key_pos, query_pos)
    k[..., :70:7, :], v[..., :70:7, :] = float("nan"), float("nan")
    y, lse = torch.ops.kvlab.attend_prefill(q, k.to(kv_dtype), v.to(kv_dtype), key_pos, query_pos)
    torch.testing.assert_close(
        y, want, rtol=0, atol=atol + (0 if kv_dtype == torch.float32 else 2.0**-10 * v.nan_to_num().abs().max().item())
    )
    assert torch.isfinite(lse).all()


@native
def test_a_query_that_sees_no_slot_gets_zeros_and_minus_infinity():
    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    y, lse = torch.ops.kvlab.attend_prefill(q, k, v, torch.tensor([[2, -1, 3]]), torch.tensor([[1, 2]]))
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0])) and torch.equal(
        lse[:, :, 0], torch.full_like(lse[:, :, 0], float("-inf"))
    )
    torch.testing.assert_close(y[:, :, 1], v[:, :, 0].expand(1, 2, 16), rtol=0, atol=1e-6)


@native
def test_prefill_attention_rejects_bad_inputs():
    q, k, v, key_pos, query_pos = inputs(1, 4, 2, 5, 3, 16)
    with pytest.raises(RuntimeError, match="key_pos must be int64"):
        torch.ops.kvlab.attend_prefill(q, k, v, key_pos.int(), query_pos)
    with pytest.raises(RuntimeError, match="takes float32 q"):
        torch.ops.kvlab.attend_prefill(q.double(), k, v, key_pos, query_pos)


@native
@pytest.mark.parametrize("isa", cpu_isas())
def test_every_instruction_set_matches_torch(isa):
    """`python -m kvlab.kernels` with KVLAB_KERNEL_ISA checks attend_prefill (among every op) on each path this CPU
    has."""
    result = run_module(isa)
    assert result.returncode == 0 and "every op matches torch" in result.stdout, result.stdout + result.stderr


@native
def test_compiled_prefill_attention_equals_eager():
    """The op's fake implementation lets torch.compile keep it in the graph: the same numbers as eager."""
    q, k, v, key_pos, query_pos = inputs(2, 4, 2, 20, 30, 64)
    compiled = torch.compile(lambda *a: torch.ops.kvlab.attend_prefill(*a), fullgraph=True)
    for got, want in zip(
        compiled(q, k, v, key_pos, query_pos), torch.ops.kvlab.attend_prefill(q, k, v, key_pos, query_pos), strict=True
    ):
        assert torch.equal(got, want)


@native
@pytest.mark.parametrize("chunk", [None, 16])
def test_model_prefill_with_native_attention_matches_torch(chunk, monkeypatch):
    """A tiny model's prefill logits for a batch of two lengths (45 and 40 tokens, right-padded), at once and in chunks
    of 16 over a full cache, with the native attention and with torch's: equal at every real token to the rounding of
    their chain of sums through the layers."""
    model = make_tiny_model()
    prompt = torch.randint(0, model.config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(45).repeat(2, 1)
    pos[1, 40:] = -1
    logits = {}
    for native_path in (True, False):
        monkeypatch.setattr(kernels, "NATIVE", native_path)
        c = model.config
        model.setup_caches(make_caches("full", c.n_layer, 2, c.n_local_heads, 64, c.head_dim, torch.float32))
        if chunk is None:
            logits[native_path] = model(prompt, pos, prefill=True)
        else:
            first = model(prompt[:, :16], pos[:, :16], prefill=True)
            rest = [model(prompt[:, i : i + 16], pos[:, i : i + 16], chunk=True) for i in range(16, 45, 16)]
            logits[native_path] = torch.cat([first, *rest], dim=1)
    real = pos >= 0
    magnitude = logits[False][real].abs().max().item()
    atol = kernels.reordering_atol(64, magnitude, chain=2 * model.config.n_layer)
    torch.testing.assert_close(logits[True][real], logits[False][real], rtol=0, atol=atol)

"""DuoAttention: retrieval heads keep every token, streaming heads sinks + a recent window (against a
full cache masked per head), bytes saved, compiled == eager, batch == alone; the gate calibration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import spec_for
from kvlab.build import make_caches
from kvlab.cache import FullCache
from kvlab.config import cache_spec
from kvlab.duo import calibrate, mixed_attention, read_gates, retrieval_heads, streaming_mask, write_gates
from kvlab.engine import compile_decode_step, generate

# the tiny model: 2 layers x 2 KV heads; retrieval: layer 0 head 0, layer 1 head 1
GATES = torch.tensor([[0.9, 0.1], [0.2, 0.8]])


@pytest.fixture
def gates_file(tmp_path):
    path = tmp_path / "duo_attention.json"
    write_gates(path, GATES, sinks=2, recent=5)
    return str(path)


class MaskedFull(FullCache):
    """The reference: a full cache whose streaming heads see only the sinks and the newest `recent` tokens before
    each query (ring), or the prompt's newest `recent` and every token after the prompt (`prompt` tokens long)."""

    positions_per_head = False

    def __init__(
        self, *args, retrieval: torch.Tensor, sinks: int, recent: int, prompt: int | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.retrieval, self.sinks, self.recent, self.prompt = retrieval, sinks, recent, prompt

    def update(self, input_pos, k, v, q):
        keys, values, pos = super().update(input_pos, k, v, q)
        per_head = pos[:, None, :].expand(k.shape[0], k.shape[1], -1)
        newest = input_pos[:, :, None] if self.prompt is None else self.prompt - 1
        visible = (per_head < self.sinks) | (per_head > newest - self.recent) | self.retrieval[None, :, None]
        return keys, values, torch.where(visible, per_head, -1)


def teacher_forced_logits(model, caches, tokens: list[int], prompt: int) -> torch.Tensor:
    model.setup_caches(caches)
    with torch.no_grad():
        model(torch.tensor([tokens[:prompt]]), torch.arange(prompt)[None], prefill=True)
        return torch.stack(
            [model(torch.tensor([[tokens[p]]]), torch.tensor([[p]]))[0, -1] for p in range(prompt, len(tokens))]
        )


@pytest.mark.parametrize("ring", [False, True])
def test_retrieval_heads_keep_everything_and_streaming_heads_sinks_and_window(tiny_model, gates_file, ring):
    """Against a full cache masked per head, 28 tokens decoded after a 12-token prompt: streaming heads keep 2 sinks
    and the prompt's newest 5 tokens plus all 28 after it (kvpress's rule), or with duo_ring the newest 5 of all 40
    in a buffer of 2 + 5 slots."""
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a = tiny_model.config
    settings = dict(duo_gates=gates_file, global_tokens=2, recent_window=5, duo_ring=ring)
    duo = make_caches("duo_attention", a.n_layer, 1, a.n_local_heads, 48, a.head_dim, torch.float32, **settings)
    reference = [
        MaskedFull(
            1,
            a.n_local_heads,
            48,
            a.head_dim,
            torch.float32,
            retrieval=retrieval_heads(GATES, 0.5)[layer],
            sinks=2,
            recent=5,
            prompt=None if ring else 12,
        )
        for layer in range(a.n_layer)
    ]
    torch.testing.assert_close(
        teacher_forced_logits(tiny_model, duo, tokens, 12),
        teacher_forced_logits(tiny_model, reference, tokens, 12),
        atol=1e-5,
        rtol=1e-5,
    )
    streamed = [0, 1, 35, 36, 37, 38, 39] if ring else [0, 1, *range(7, 40)]
    for layer, cache in enumerate(duo):
        for head in range(a.n_local_heads):
            held = sorted(set(cache.pos[0, head].tolist()) - {-1})
            assert held == (list(range(40)) if GATES[layer, head] > 0.5 else streamed)
    # K and V, float32: one head of 48 slots, the other 2 + 5 or 48
    assert duo[0].nbytes() == 2 * 4 * a.head_dim * (48 + (7 if ring else 48))


@pytest.mark.parametrize("ring", [False, True])
def test_compiled_decode_equals_eager_and_batch_equals_alone(tiny_model, gates_file, ring):
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6], [7, 21, 63, 1, 8]]
    spec = spec_for(
        tiny_model, "duo_attention", 1.0, duo_gates=gates_file, global_tokens=2, recent_window=3, duo_ring=ring
    )
    eager = generate(tiny_model, prompts, 24, spec).tokens
    assert eager == [generate(tiny_model, [p], 24, spec, max_seq_length=36).tokens[0] for p in prompts]
    torch._dynamo.reset()
    assert generate(tiny_model, prompts, 24, spec, decode_step=compile_decode_step(torch.device("cpu"))).tokens == eager


def test_mixed_attention_is_full_at_gate_one_and_streaming_at_zero():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(mixed_attention(torch.ones(2), 2, 3, q, k, v), full)
    mask = streaming_mask(12, 2, 3, q.device)
    assert mask[11].nonzero()[:, 0].tolist() == [0, 1, 9, 10, 11]
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / 8**0.5
    stream = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v.repeat_interleave(2, dim=1)
    mixed = mixed_attention(torch.tensor([1.0, 0.0]), 2, 3, q, k, v)
    torch.testing.assert_close(mixed[:, :2], full[:, :2])
    torch.testing.assert_close(mixed[:, 2:], stream[:, 2:], atol=1e-5, rtol=1e-5)


def test_calibration_streams_heads_that_lose_nothing_and_keeps_those_that_do(tiny_model):
    """Sequences within the window: streaming equals full, so only the L1 term acts and every gate falls.
    Longer ones: the distillation term holds gates up where streaming changes the output."""
    short = [(torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(i)).tolist(), 4) for i in range(2)]
    gates, losses = calibrate(tiny_model, short, steps=5, sinks=4, recent=8, lr=0.05, l1=1.0)
    torch.testing.assert_close(gates, torch.full_like(gates, 1 - 5 * 0.05), atol=1e-3, rtol=0)
    assert losses[0] == pytest.approx(4.0) and losses == sorted(losses, reverse=True)  # l1 x the 4 gates
    long = [(torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(i)).tolist(), 20) for i in range(2)]
    held, _ = calibrate(tiny_model, long, steps=30, sinks=1, recent=2, lr=0.05, l1=1e-4)
    assert held.min() > 0.5  # streaming with a 3-token window would change the output: no gate gives up
    assert all(p.requires_grad for p in tiny_model.parameters())  # the model's own flags are restored


def test_gates_files_and_settings_are_checked(tmp_path, gates_file, tiny_model):
    a = tiny_model.config
    build = dict(
        strategy="duo_attention",
        n_layer=2,
        batch_size=1,
        n_kv_heads=a.n_local_heads,
        capacity=16,
        head_dim=a.head_dim,
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="duo_attention needs --duo_gates FILE: calibrate"):
        make_caches(**build)
    with pytest.raises(ValueError, match="no such file"):
        make_caches(**build, duo_gates=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"gates": [1, 2]}')
    with pytest.raises(ValueError, match=r"gates must be \[layers\]\[KV heads\]"):
        read_gates(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="this model has 4 KV heads per layer"):
        make_caches(**{**build, "n_kv_heads": 4}, duo_gates=gates_file)
    with pytest.raises(ValueError, match="duo_attention: --recent_window 0 leaves its streaming heads no window"):
        make_caches(**build, duo_gates=gates_file, recent_window=0)
    caches = make_caches(**build, duo_gates=gates_file, duo_retrieval=0.25)
    assert [c.stats() for c in caches] == [
        {"heads retrieval": 1, "heads streaming": 1},
        {"heads retrieval": 0, "heads streaming": 2},
    ]


@pytest.mark.parametrize("ratio, retrieval", [(0.75, 0.25), (0.5, 0.5), (0.0, 1.0)])
def test_compression_ratio_is_the_share_of_streaming_heads(tiny_model, gates_file, ratio, retrieval):
    """kvpress's protocol for DuoAttentionPress (head_compression_ratio = the compression ratio): a ratio replaces
    duo_retrieval, whatever the config says, with 1 - ratio, and sizes nothing else."""
    settings = dict(duo_gates=gates_file, global_tokens=2, recent_window=3, duo_retrieval=0.5)
    spec = cache_spec({"cache_strategy": "duo_attention", "compression_ratio": ratio, **settings}, 2)
    assert spec.compression_ratio is None and spec.options["duo_retrieval"] == retrieval
    prompts = [[3, 9, 27, 17, 51, 25, 11, 33, 5, 40, 2, 6]]
    direct = spec_for(tiny_model, "duo_attention", 1.0, **{**settings, "duo_retrieval": retrieval})
    assert generate(tiny_model, prompts, 12, spec).tokens == generate(tiny_model, prompts, 12, direct).tokens
    streaming = sum(layer.attention.kv_cache.stats()["heads streaming"] for layer in tiny_model.layers)
    assert streaming == round(ratio * GATES.numel())

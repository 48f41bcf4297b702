"""The model against independent references: HF transformers on the same GGUF, published perplexity,
and the attention pieces against their textbook forms."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model, paul_graham_text
from kvlab import kernels
from kvlab.attention import attention_mask, chunk_attention, grouped_attention, split_chunk_attention
from kvlab.build import make_caches
from kvlab.cache import FullCache
from kvlab.checkpoint import KNOWN_MODELS, known_model_name
from kvlab.convert import default_gguf_path, hf_model_args
from kvlab.engine import generate
from kvlab.model import ModelArgs, lay_out_for_matvec
from tolerance import assert_reordered_close


def full_caches(model, batch_size: int, capacity: int, cls=FullCache):
    a = model.config
    caches = [cls(batch_size, a.n_local_heads, capacity, a.head_dim, torch.float32) for _ in range(a.n_layer)]
    model.setup_caches(caches)
    return caches


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor([ids])
    full_caches(model, 1, len(ids))
    with torch.no_grad():
        return model(tokens, torch.arange(len(ids))[None], prefill=True)[0]


@pytest.fixture(scope="module")
def essay_ids(smollm):
    _, tokenizer, _ = smollm
    return tokenizer.encode(paul_graham_text()[:20000])


@pytest.mark.slow
def test_logits_match_transformers_on_the_same_gguf(smollm, essay_ids):
    """HF transformers dequantizes the GGUF with its own code and runs its own Llama: <= 1e-3 max abs.
    The last 16 tokens go through the decode path (cache.update + position mask) one at a time."""
    transformers = pytest.importorskip("transformers")
    model, _, _ = smollm
    ids = essay_ids[:300]
    gguf_path = default_gguf_path()
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    del ref_model

    n_prefill = len(ids) - 16
    full_caches(model, 1, len(ids))
    with torch.no_grad():
        ours = [model(torch.tensor([ids[:n_prefill]]), torch.arange(n_prefill)[None], prefill=True)[0]]
        for p in range(n_prefill, len(ids)):
            ours.append(model(torch.tensor([[ids[p]]]), torch.tensor([[p]]))[0])
    ours = torch.cat(ours)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-3


def test_perplexity_of_paul_graham_essays_matches_reference(smollm, essay_ids):
    """Facts doc: perplexity 20.70 on the first 1,024 tokens of RULER's essays (independent fp32 forward)."""
    model, _, _ = smollm
    ids = essay_ids[:1024]
    logits = prompt_logits(model, ids)
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert math.exp(nll.item()) == pytest.approx(20.70, abs=0.05)


def test_greedy_chat_answer_names_paris(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = generate(model, [prompt], 20, stop_ids=tokenizer.stop_ids)
    answer = tokenizer.decode(result.tokens[0])
    assert answer == "The capital of France is Paris."
    assert result.finished == [True]


def test_batch_of_different_lengths_equals_one_by_one(smollm):
    model, tokenizer, _ = smollm
    texts = ["The quick brown fox", "In 1854, the city of London suffered a cholera outbreak that", "Photosynthesis is"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    single = [generate(model, [p], 12).tokens[0] for p in prompts]
    batched = generate(model, prompts, 12).tokens
    assert batched == single
    assert generate(model, prompts, 12, max_seq_length=64).tokens == single  # unused slots change nothing


def test_attention_probability_path_equals_sdpa(smollm, essay_ids):
    """Caches that learn from attention get probabilities from an explicit softmax; it must give the
    same outputs as the fused kernel, and the probabilities must be a distribution over filled slots."""
    model, _, _ = smollm
    observed = []

    class Recording(FullCache):
        needs_attention = True

        def observe(self, probs):
            observed.append(probs)

    ids = essay_ids[:40]
    outputs = []
    for cls in (FullCache, Recording):
        full_caches(model, 1, 48, cls)
        with torch.no_grad():
            model(torch.tensor([ids[:32]]), torch.arange(32)[None], prefill=True)
            outputs.append(torch.cat([model(torch.tensor([[ids[p]]]), torch.tensor([[p]]))[0] for p in range(32, 40)]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    a = model.config
    assert len(observed) == 8 * a.n_layer
    probs = observed[-1]  # last layer, position 39: [B, H_kv, group, T, S]
    assert probs.shape == (1, a.n_local_heads, a.n_head // a.n_local_heads, 1, 48)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    assert probs[..., 40:].abs().max() == 0  # empty slots get no attention


def test_a_cpu_checkpoint_stores_weights_as_its_matvec_kernel_reads_them(smollm):
    """kvlab's native kernel streams row-major rows; without it, MKL's matrix-vector product prefers wide
    weights column-major. The LM head stays tied to the embedding either way."""
    model, _, _ = smollm
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    wide = [m for m in linears if m.out_features > m.in_features]
    assert {m.weight.shape for m in wide} == {(960, 576), (1536, 576), (49152, 576)}
    if kernels.NATIVE:
        assert all(m.weight.is_contiguous() for m in linears)
    else:
        assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in wide)
        assert all(m.weight.is_contiguous() for m in linears if m.out_features <= m.in_features)
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_either_weight_layout_gives_the_same_logits_and_tokens(native, monkeypatch):
    """Column-major wide weights (torch's kernels) or row-major ones through the native kernel: the prefill's
    logits to summation order (one Linear of 64 terms feeding the next, tests/tolerance.py) and the same
    greedy tokens as the untouched model on torch's kernels."""
    if native and not kernels.load(quiet=True):
        pytest.skip(f"needs kvlab's native kernels: {kernels.REASON}")
    model, reference = make_tiny_model(), make_tiny_model()
    model.output.weight.data = model.output.weight.data.t().contiguous().t()  # as a column-major checkpoint arrives
    monkeypatch.setattr(kernels, "NATIVE", native)
    monkeypatch.setattr(kernels, "load", lambda quiet=False: native)
    lay_out_for_matvec(model)
    assert model.output.weight.is_contiguous() == native and model.layers[0].feed_forward.w2.weight.is_contiguous()
    tokens = torch.randint(0, 64, (2, 40))
    for m in (model, reference):
        m.setup_caches(make_caches("full", 2, 2, 2, 64, 8, torch.float32))
    input_pos = torch.arange(40).expand(2, 40)
    expected = reference(tokens, input_pos, prefill=True)
    assert_reordered_close(
        model(tokens, input_pos, prefill=True), expected, terms=64, chain=2 * model.config.n_layer + 1
    )
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    monkeypatch.setattr(kernels, "NATIVE", False)
    reference_tokens = generate(reference, prompts, 20).tokens
    monkeypatch.setattr(kernels, "NATIVE", native)
    assert generate(model, prompts, 20).tokens == reference_tokens


def test_grouped_attention_equals_repeated_kv_reference():
    torch.manual_seed(0)
    B, H, n_kv, T, S, D = 2, 6, 2, 3, 10, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, n_kv, S, D), torch.randn(B, n_kv, S, D)
    key_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, -1, -1, -1], [3, 0, 1, 2, -1, 4, 5, 6, 7, 8]])
    query_pos = torch.tensor([[4, 5, 6], [6, 7, 8]])
    mask = attention_mask(key_pos, query_pos)
    y, probs = grouped_attention(q, k, v, mask, return_probs=True)
    k_rep, v_rep = k.repeat_interleave(H // n_kv, dim=1), v.repeat_interleave(H // n_kv, dim=1)
    scores = (q @ k_rep.transpose(-1, -2)) / math.sqrt(D)
    ref_probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(y, ref_probs @ v_rep)
    torch.testing.assert_close(probs.reshape(B, H, T, S), ref_probs)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, return_probs=False)[0], y)


def test_attention_mask_follows_positions():
    key_pos = torch.tensor([[0, 1, 2, -1]])
    mask = attention_mask(key_pos, torch.tensor([[1, 2]]))
    assert mask.tolist() == [[[[True, True, False, False], [True, True, True, False]]]]
    per_head = attention_mask(torch.tensor([[[2, 0, -1], [-1, 1, 0]]]), torch.tensor([[1]]))
    assert per_head.tolist() == [[[[False, True, False]], [[False, True, True]]]]


def test_full_cache_stores_tokens_at_their_positions():
    cache = FullCache(batch_size=2, n_kv_heads=1, capacity=6, head_dim=1, dtype=torch.float32)
    k = torch.arange(8.0).view(2, 1, 4, 1)
    cache.prefill(torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]]), k, k, None)
    assert cache.pos.tolist() == [[0, 1, 2, 3, -1, -1], [0, 1, -1, -1, -1, -1]]
    keys, _, pos = cache.update(
        torch.tensor([[4], [2]]), torch.tensor([[[[40.0]]], [[[20.0]]]]), torch.zeros(2, 1, 1, 1), None
    )
    assert pos.tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, -1, -1, -1]]
    assert keys[:, 0, :, 0].tolist() == [[0, 1, 2, 3, 40, 0], [4, 5, 20, 7, 0, 0]]
    assert cache.nbytes() == 2 * 2 * 6 * 4


def test_make_caches_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="unknown cache strategy 'bogus'; choose from: full"):
        make_caches("bogus", 2, 1, 1, 8, 4, torch.float32)


def test_default_model_is_recognised_as_smollm2_135m(smollm):
    assert known_model_name(smollm[0].config) == "SmolLM2-135M"


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_known_model_configs_build(name):
    args = ModelArgs(**KNOWN_MODELS[name].args)
    assert args.n_head % args.n_local_heads == 0 and args.head_dim > 0


def test_hf_config_of_llama_3_1_8b_maps_to_table_entry():
    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    assert hf_model_args(hf) == ModelArgs(**KNOWN_MODELS["Llama-3.1-8B"].args)
    qwen = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    }
    assert hf_model_args(qwen) == ModelArgs(**KNOWN_MODELS["Qwen2.5-0.5B"].args)


@pytest.mark.parametrize(
    "name, shape",
    [
        (
            "Qwen3-0.6B",
            dict(
                num_hidden_layers=28,
                num_attention_heads=16,
                hidden_size=1024,
                intermediate_size=3072,
                tie_word_embeddings=True,
            ),
        ),
        (
            "Qwen3-8B",
            dict(
                num_hidden_layers=36,
                num_attention_heads=32,
                hidden_size=4096,
                intermediate_size=12288,
                tie_word_embeddings=False,
            ),
        ),
    ],
)
def test_hf_config_of_qwen3_maps_to_table_entry(name, shape):
    """The fields of the hub's config.json (transformers 4.51 names; head_dim 128 is not hidden_size // heads in
    0.6B)."""
    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        **shape,
    }
    args = hf_model_args(hf)
    assert args == ModelArgs(**KNOWN_MODELS[name].args)
    assert args.qk_norm and not args.qkv_bias
    assert known_model_name(args) == name


def test_unknown_model_family_and_config_keys_are_rejected():
    from kvlab.model import ConfigError

    with pytest.raises(ConfigError, match="unknown model family 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        hf_model_args({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match=r"unknown model config keys \['n_embd'\]"):
        ModelArgs.from_dict(dict(KNOWN_MODELS["SmolLM2-135M"].args, n_embd=3))


def test_a_chunk_split_into_held_and_own_keys_equals_the_masked_attention():
    """chunk_attention with own_from (the held keys seen by every real query, the chunk's own causal, both by the flash
    kernel, merged by log-sum-exps) against the one masked softmax, for every real query: a row ending mid-chunk (its
    padding queries' outputs are kept by nothing), GQA. Tolerance: the output sums S products of weights and values
    (terms S, magnitude max |v|), after the scores' own sums (each score's error moves a weight by that much
    relative) and the softmax: a chain of 3."""
    g = torch.Generator().manual_seed(0)
    B, H, n_kv, N, D, held = 2, 4, 2, 8, 16, 20
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, N), (n_kv, held + N), (n_kv, held + N)))
    query_pos = torch.arange(held, held + N).repeat(B, 1)
    query_pos[1, 5:] = -1
    key_pos = torch.cat([torch.arange(held).repeat(B, 1), query_pos], dim=1)
    real = (query_pos >= 0)[:, None, :, None].expand(q.shape)
    split = split_chunk_attention(q, k, v, own_from=held)[real]
    masked = chunk_attention(q, query_pos, k, v, key_pos)[real]
    scores = (q.reshape(B, n_kv, -1, D) @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    assert_reordered_close(split, masked, terms=held + N, chain=3, magnitude=v.abs().max().item() * (1 + scores))
    future = split_chunk_attention(q, k, v, own_from=held + 2)[real]  # two own keys taken as held
    assert not torch.allclose(future, masked, atol=1e-3)


def test_a_long_inputs_feed_forward_runs_ffn_rows_at_a_time(monkeypatch):
    """More rows than FFN_ROWS go through the feed-forward FFN_ROWS at a time (the hidden activations a prefill holds
    are that many rows long), and give each row the result it gets in one pass, to the order of float32 sums (two
    sums in sequence: the gate/up product, then the down product over its hidden units)."""
    import kvlab.model as model_module

    ffn = make_tiny_model().layers[0].feed_forward
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = ffn(x)
        monkeypatch.setattr(model_module, "FFN_ROWS", 4)
        seen = []
        gated = type(ffn.w1).gated
        monkeypatch.setattr(type(ffn.w1), "gated", lambda self, up, h: seen.append(h.shape[0]) or gated(self, up, h))
        blocked = ffn(x)
    assert seen == [4, 4, 4, 4, 2] and blocked.shape == whole.shape
    rows = x.abs().reshape(-1, 32).T
    magnitude = (ffn.w2.weight.abs() @ ((ffn.w1.weight.abs() @ rows) * (ffn.w3.weight.abs() @ rows))).max().item()
    assert_reordered_close(blocked, whole, terms=64, chain=2, magnitude=magnitude)


def test_a_checkpoint_skeleton_and_an_eager_generation_never_import_the_compiler():
    """A model built on the meta device (a checkpoint's skeleton) initializes nothing there, and an eager generation
    marks no cache for the compiler: either would import torch's compiler stack (~70 MB of a process's peak). In a
    process of its own, as a user's: this suite's other tests import the compiler."""
    code = """
import sys, torch
from kvlab.model import ModelArgs, Transformer
args = ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=64, block_size=128)
with torch.device("meta"):
    skeleton = Transformer(args)
assert skeleton.rope_cos.is_meta and skeleton.output.weight.is_meta
model = Transformer(args).eval()
from kvlab.config import cache_spec
from kvlab.engine import generate
out = generate(model, [[1, 2, 3, 4, 5]], 3, cache_spec({"cache_strategy": "full"}, args.n_layer))
print(len(out.tokens[0]), "torch._dynamo" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "False"]

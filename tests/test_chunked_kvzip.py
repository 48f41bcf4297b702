"""KVzip under chunked prefill: a repeat that fits the context or a one-line refusal, each chunk scored as its own
repeat pass would, and the model-wide ranking between chunks keeping the one-shot choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config
from kvlab.engine import generate
from kvlab.reconstruction import KVzip, Pass, prompt_attention_from
from kvlab.recording import PrefillRecorder


def test_kvzip_refuses_a_repeat_beyond_the_context_in_one_line(tiny_model):
    """Chunked, the repeat is the chunk: 100 prompt tokens + a chunk of 32 exceed the tiny model's 128 positions.
    One-shot, a prompt whose request fills the context leaves no room for any repeat. Without a tokenizer the request
    is empty, but one-shot passes after the first quote the previous chunk's last 8 tokens."""
    settings = {"cache_strategy": "recent_global", "prompt_compression_strategy": "kvzip", "max_cache_length": 24}
    chunked = cache_spec({**settings, "prefill_chunk": 32}, 2)
    refused = (
        r"the prompt \(100 tokens\) \+ its request \(0\) \+ 32 must fit the model's context of 128 tokens; give "
        r"a smaller --prefill_chunk$"
    )
    with pytest.raises(ValueError, match=refused):
        generate(tiny_model, [[i % 64 for i in range(100)]], 2, chunked)
    assert len(generate(tiny_model, [[i % 64 for i in range(96)]], 2, chunked).tokens[0]) == 2
    no_room = (
        r"the prompt \(120 tokens\) and its request \(8\) leave no room in the model's context of 128 tokens; "
        r"shorten the prompt$"
    )
    with pytest.raises(ValueError, match=no_room):
        generate(tiny_model, [[i % 64 for i in range(120)]], 2, cache_spec(settings, 2))
    assert len(generate(tiny_model, [[i % 64 for i in range(119)]], 2, cache_spec(settings, 2)).tokens[0]) == 2


@pytest.mark.parametrize("given", [None, 32])
def test_kvzip_repeats_what_fits_after_a_long_prompt(tiny_model, capsys, given):
    """A 100-token prompt on 128 positions repeats 128 - 100 - 8 = 20 tokens a pass (one note line) whether
    --kvzip_chunk is the default (2,048) or given (32), as --kvzip_chunk 20 does; a prompt with room for the
    default is scored as before, without a note."""
    settings = {"cache_strategy": "recent_global", "prompt_compression_strategy": "kvzip", "max_cache_length": 24}
    asked = settings if given is None else {**settings, "kvzip_chunk": given}
    prompt = [i % 64 for i in range(100)]
    fitted = generate(tiny_model, [prompt], 2, cache_spec(asked, 2))
    note = (
        f"note: kvzip repeats the context 20 tokens at a time, not {given or 2048} (--kvzip_chunk), so that the "
        "prompt (100"
    )
    assert note in capsys.readouterr().err
    shortened = generate(tiny_model, [prompt], 2, cache_spec({**settings, "kvzip_chunk": 20}, 2))
    assert fitted.tokens == shortened.tokens and fitted.tokens_held == shortened.tokens_held
    short = [i % 64 for i in range(40)]
    default = generate(tiny_model, [short], 2, cache_spec(settings, 2))
    assert default.tokens == generate(tiny_model, [short], 2, cache_spec({**settings, "kvzip_chunk": 2048}, 2)).tokens
    assert "note: kvzip" not in capsys.readouterr().err


def test_kvzip_scores_each_chunk_by_repeating_it_as_a_separate_pass_would(smollm, essay):
    """Two chunks of 80 and a budget that evicts nothing: after the second, a first chunk's token keeps what the first
    chunk's repeat paid it (over the first chunk alone), a second chunk's token what the second's pays it (after both
    chunks, in KVzip's scope: the sinks, the second chunk and the repeat), each computed here by a separate pass of the
    model over the recorded keys, as one-shot KVzip scores."""
    model, tokenizer, _ = smollm
    prompt, N = essay[:160], 80
    settings = {
        "cache_strategy": "recent_global",
        "prompt_compression_strategy": "kvzip",
        "max_cache_length": 200,
        "prefill_chunk": N,
    }
    spec = cache_spec(settings, model.config.n_layer, tokenizer)
    generate(model, [prompt], 2, spec)
    caches = [layer.attention.kv_cache for layer in model.layers]
    recorder = PrefillRecorder()
    model.setup_caches([recorder] * len(caches))
    with torch.no_grad():
        model(torch.tensor([prompt]), torch.arange(160)[None], prefill=True)
    model.setup_caches(caches)
    instruction = list(spec.repeat.instruction)
    # the first chunk is scored as one-shot KVzip scores a prompt
    one_shot = KVzip().queries(prompt[:N], [], spec.repeat)
    first = prompt_attention_from(model, [(k[:, :, :N], v[:, :, :N]) for k, v, _ in recorder.layers], one_shot, "max")
    second = prompt_attention_from(
        model,
        [(k, v) for k, v, _ in recorder.layers],
        [Pass(instruction + prompt[N:], len(instruction), (N, 2 * N))],
        "max",
    )
    for cache, a, b in zip(caches, first, second, strict=True):
        assert torch.equal(cache.pos[0, :, :160], torch.arange(160).expand(cache.pos.shape[1], 160))
        # fp32 attention through 30 layers by other kernels (one pass vs two, masked vs causal): 3e-6 measured on AVX2
        torch.testing.assert_close(
            cache.prompt_scores[0, :, :160], torch.maximum(F.pad(a, (0, N)), b), atol=1e-4, rtol=0
        )


def test_the_model_wide_ranking_between_chunks_keeps_the_one_shot_choice_when_nothing_is_evicted_before_the_last(
    tiny_model,
):
    """head_budget global under --prefill_chunk ranks every layer's held and chunk tokens together after each chunk.
    With a key score (l2) and a total that holds the first chunk whole, the last ranking sees every prompt token with
    its exact key: the same tokens kept per head, and the same text, as the one-shot prefill's ranking."""
    settings = {"cache_strategy": "l2", "head_budget": "global", "max_cache_length": 48, "global_tokens": 2}
    prompt = torch.randint(0, 64, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    held = {}
    for chunk in (None, 40):
        spec = cache_spec({**settings, **({"prefill_chunk": chunk} if chunk else {})}, tiny_model.config.n_layer)
        out = generate(tiny_model, [prompt], 1, spec)
        held[chunk] = (
            out.tokens,
            [sorted(p.tolist()) for c in (b.attention.kv_cache for b in tiny_model.layers) for p in c.pos[0]],
        )
    assert held[40] == held[None]
    counts = [sum(p >= 0 for p in head) for head in held[40][1]]
    assert sum(counts) == 48 * len(counts) and len(set(counts)) > 1  # the one-shot total, shared unevenly


@pytest.mark.parametrize("ratio", [None, 0.75])
def test_kvzips_model_wide_ranking_under_chunks_records_the_prompt_in_chunks_and_keeps_the_one_shot_choice(
    tiny_model, monkeypatch, ratio
):
    """configs/kvzip.yaml under --prefill_chunk: the prompt is recorded chunk by chunk (each attending over the
    recorded columns), then scored by KVzip's repeat, ranked over the model and replayed as one-shot: the same tokens
    kept by every head, and the same text, as without chunks."""
    calls = []
    original = PrefillRecorder.prefill_chunk
    monkeypatch.setattr(
        PrefillRecorder, "prefill_chunk", lambda self, *a, **k: calls.append(a[1].shape[2]) or original(self, *a, **k)
    )
    kvzip = {k: v for k, v in load_cache_config("kvzip").items() if k != "max_cache_length"}
    limit = {"compression_ratio": ratio} if ratio else {"max_cache_length": 16}
    prompt = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    kept = {}
    for chunk in (None, 16):
        spec = cache_spec({**kvzip, **limit, **({"prefill_chunk": chunk} if chunk else {})}, tiny_model.config.n_layer)
        out = generate(tiny_model, [prompt], 6, spec)
        caches = [b.attention.kv_cache for b in tiny_model.layers]
        kept[chunk] = (out.tokens, [sorted(p.tolist()) for c in caches for p in c.pos[0]])
    assert kept[16] == kept[None]
    assert calls and max(calls) == 16 and len(calls) == tiny_model.config.n_layer * (len(prompt) // 16)

"""Scores that need the model to run again: KVzip's context reconstruction and the oracle's future
attention, against attention computed directly from a plain prefill of the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvlab import kernels, reconstruction
from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config
from kvlab.engine import generate
from kvlab.reconstruction import KVZIP_SINKS, KVzip, Oracle, Pass, RepeatRequest, prompt_attention_from, repeat_request
from kvlab.recording import RecordedPrefill, reads_recorded_queries
from kvlab.scores import prompt_attention
from kvlab.strategies import make_prompt_compressor


def direct(model, prompt: list[int], passes: list[Pass], reduce: str) -> list[torch.Tensor]:
    """Per layer [H_kv, n]: each pass prefilled after the prompt as one sequence, its attention computed
    from the recorded queries and keys, counted rows only, over the prompt's keys; with a window, a softmax
    over only the first KVZIP_SINKS keys, the window's and the pass's own (KVzip's scope), scoring the window."""
    n = len(prompt)
    total = None
    for p in passes:
        recorded = RecordedPrefill()
        sequence = torch.tensor([prompt + p.ids])
        positions = torch.arange(sequence.shape[1])[None]
        recorded.record(model, sequence, positions, positions[:, -1:])
        start, end = p.window or (0, n)
        cols = [*range(min(KVZIP_SINKS, start) if p.window else 0), *range(start, end), *range(n, sequence.shape[1])]
        per_layer = []
        for k, _, q in recorded.recorder.layers:
            # [H_kv, group, t, cols]
            probs = prompt_attention(
                q[:, :, n + p.skip :], k[:, :, cols], positions[:, cols], positions[:, n + p.skip :]
            )[0]
            scored = torch.zeros(*probs.shape[:3], n)
            scored[..., start:end] = probs[..., cols.index(start) : cols.index(start) + end - start]
            per_layer.append(scored.amax(dim=(1, 2)) if reduce == "max" else scored.sum(dim=(1, 2)))
        total = (
            per_layer
            if total is None
            else [torch.maximum(a, b) if reduce == "max" else a + b for a, b in zip(total, per_layer, strict=True)]
        )
    return total


def prompt_kv(model, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    recorded = RecordedPrefill()
    positions = torch.arange(len(prompt))[None]
    recorded.record(model, torch.tensor([prompt]), positions, positions[:, -1:])
    return [(k, v) for k, v, _ in recorded.recorder.layers]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("chunk", [64, 10, 7])
def test_kvzip_scores_are_the_max_attention_of_the_repeated_context(tiny_model, monkeypatch, chunk, native):
    """kvpress's KVzipPress passes: the context after the chat prefix (2 tokens here), in chunks, each after the
    request (a later one quoting the previous chunk's last 8 tokens) and the answer header; every token of a pass
    counts, in a softmax over the sinks, the chunk and the pass. The probe's two paths: probabilities of the scored
    keys from the native attention's log-sum-exps, and torch's whole softmax."""
    monkeypatch.setattr(kernels, "NATIVE", native and kernels.NATIVE)
    prompt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    request = RepeatRequest(first=(5, 9, 11), later=(7,), header=(13, 2), prefix=tuple(prompt[:2]))
    passes = KVzip(chunk=chunk).queries(prompt, [], request)
    starts = list(range(2, 30, chunk))
    assert [p.window for p in passes] == [(s, min(s + chunk, 30)) for s in starts] and all(p.skip == 0 for p in passes)
    assert passes[0].ids == [5, 9, 11, 13, 2, *prompt[2 : 2 + chunk]]
    if chunk == 10:
        assert passes[1].ids == [7, *prompt[4:12], 13, 2, *prompt[12:22]]
    if chunk == 7:  # a previous chunk shorter than the hint is quoted whole
        assert passes[1].ids == [7, *prompt[2:9], 13, 2, *prompt[9:16]] and passes[2].ids == [
            7,
            *prompt[9:16],
            13,
            2,
            *prompt[16:23],
        ]
    got = prompt_attention_from(tiny_model, prompt_kv(tiny_model, prompt), passes, "max")
    for ours, reference in zip(got, direct(tiny_model, prompt, passes, "max"), strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_oracle_scores_are_the_attention_summed_over_the_future(tiny_model, monkeypatch, native):
    monkeypatch.setattr(kernels, "NATIVE", native and kernels.NATIVE)
    prompt = torch.randint(0, 64, (25,), generator=torch.Generator().manual_seed(1)).tolist()
    future = [3, 14, 15, 9, 2, 6]
    passes = Oracle().queries(prompt, future, None)
    got = prompt_attention_from(tiny_model, prompt_kv(tiny_model, prompt), passes, "sum")
    for ours, reference in zip(got, direct(tiny_model, prompt, passes, "sum"), strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert all((g.sum(dim=-1) > 0).all() for g in got)


@pytest.mark.parametrize("queries", [1, 2, 5])
def test_a_pass_run_in_parts_scores_as_the_pass_run_whole(tiny_model, monkeypatch, queries):
    """A long pass runs `part_length` queries at a time, each part over the prompt, the pass's earlier keys and its
    own: with parts of 1, 2 or 5 queries (a skip of 3 falling inside a part) the scores are the direct reference's."""
    prompt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    passes = [Pass([5, 9, 11, *prompt[2:12]], 0, (2, 12)), Pass([7, *prompt[4:12], 13, 2, *prompt[12:22]], 3, (12, 22))]
    monkeypatch.setattr(reconstruction, "PROBS_BYTES", 4 * tiny_model.config.n_head * (30 + 23) * queries)
    assert reconstruction.part_length(tiny_model, 30 + 23) == queries
    for reduce in ("max", "sum"):
        got = prompt_attention_from(tiny_model, prompt_kv(tiny_model, prompt), passes, reduce)
        for ours, reference in zip(got, direct(tiny_model, prompt, passes, reduce), strict=True):
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compressor", ["kvzip", "oracle"])
def test_generation_keeps_the_prompt_tokens_the_model_scores_highest(tiny_model, compressor):
    """Through generate: each head keeps exactly the top int((1 - ratio) x prompt) tokens by the model-pass
    scores (sinks and the recent window protected), and batch rows equal each alone."""
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 33)]
    spec = cache_spec(
        {
            "cache_strategy": "recent_global",
            "prompt_compression_strategy": compressor,
            "compression_ratio": 0.5,
            "recent_window": 2,
        },
        2,
    )
    batch = generate(tiny_model, prompts, 5, spec, decoded_prompt_tokens=[4, 6])
    alone = [
        generate(tiny_model, [p], 5, spec, decoded_prompt_tokens=[d]).tokens[0]
        for p, d in zip(prompts, [4, 6], strict=True)
    ]
    assert batch.tokens == alone
    prompt, decoded = prompts[1], 6
    generate(tiny_model, [prompt], 5, spec, decoded_prompt_tokens=[decoded])
    n = len(prompt) - decoded
    if compressor == "kvzip":
        passes = KVzip().queries(prompt[:n], [], repeat_request(None))
    else:
        reference = generate(tiny_model, [prompt], 5, cache_spec({}, 2), decoded_prompt_tokens=[decoded]).tokens[0]
        passes = Oracle().queries(prompt[:n], prompt[n:] + reference[:4], None)
        generate(tiny_model, [prompt], 5, spec, decoded_prompt_tokens=[decoded])
    scores = direct(tiny_model, prompt[:n], passes, "max" if compressor == "kvzip" else "sum")
    for layer, score in zip(tiny_model.layers, scores, strict=True):
        pos = layer.attention.kv_cache.pos[0]  # [H_kv, S]
        for head in range(pos.shape[0]):
            held = sorted(p for p in pos[head].tolist() if 0 <= p < n)
            protected = {0, 1, 2, 3, n - 2, n - 1}
            ranked = [p for p in score[head].argsort(descending=True).tolist() if p not in protected]
            assert held == sorted(protected | set(ranked[: int(n * 0.5) - len(protected)]))


def test_a_model_scored_compressor_cannot_score_alone():
    with pytest.raises(RuntimeError, match="scores come from a pass of the model"):
        make_prompt_compressor("kvzip")(
            torch.zeros(1, 4, dtype=torch.long),
            torch.zeros(1, 1, 4, 2),
            torch.zeros(1, 1, 4, 2),
            torch.zeros(1, 1, 4, 2),
        )


def test_global_head_budget_keeps_the_top_scores_of_every_layer_and_head_ranked_together(tiny_model):
    """The shipped kvzip config, as kvpress's KVzipPress (head_budget global): L x H x n - int(L x H x n x ratio) of the
    n context tokens, the top of every layer's and head's KVzip scores ranked together, with the 4 sinks first and
    nothing else protected (the newest token too is ranked by its score); each head holds exactly its own, so the
    heads hold different counts. Only a token scoring within 1e-4 of the cut may fall the other way (the probes and
    this reference round differently)."""
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    n, ratio = 36, 0.5
    settings = {key: value for key, value in load_cache_config("kvzip").items() if key != "max_cache_length"} | {
        "compression_ratio": ratio
    }
    generate(tiny_model, [prompt], 3, cache_spec(settings, 2), decoded_prompt_tokens=[len(prompt) - n])
    # [L, H, n]
    scores = torch.stack(direct(tiny_model, prompt[:n], KVzip().queries(prompt[:n], [], repeat_request(None)), "max"))
    scores[..., [0, 1, 2, 3]] = float("inf")  # the 4 sinks
    kept = scores.numel() - int(scores.numel() * ratio)
    cut = scores.flatten().sort(descending=True).values[kept - 1]
    held = torch.zeros_like(scores, dtype=torch.bool)
    for layer, block in enumerate(tiny_model.layers):
        pos = block.attention.kv_cache.pos[0]
        for head in range(pos.shape[0]):
            held[layer, head, [p for p in pos[head].tolist() if 0 <= p < n]] = True
    assert int(held.sum()) == kept and len(set(held.sum(dim=-1).flatten().tolist())) > 1
    assert ((held != (scores >= cut)) <= ((scores - cut).abs() < 1e-4)).all()


@pytest.mark.parametrize("chunk", [7, 16])
def test_a_prefill_recorded_in_chunks_holds_the_one_shot_recording(tiny_model, chunk):
    """Each chunk attends over the recorded columns and itself: the same keys, values, queries, logits and layer
    similarities as one prefill (to float32 rounding), in buffers of the whole prompt; padding rows included."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (2, 40), generator=g)
    positions = torch.arange(40).expand(2, 40).clone()
    positions[1, 33:] = -1  # the second row's prompt is 33 tokens long
    at = torch.tensor([[39], [32]])
    whole, chunked = RecordedPrefill(), RecordedPrefill()
    whole.record(tiny_model, tokens, positions, at)
    chunked.record(tiny_model, tokens, positions, at, chunk)
    for a, b in zip(whole.recorder.layers, chunked.recorder.layers, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y[0], x[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y[1, :, :33], x[1, :, :33], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked.similarity, whole.similarity, atol=1e-5, rtol=1e-5)
    assert chunked.recorder.lse == [None] * tiny_model.config.n_layer


def test_a_recording_for_kvzip_keeps_no_queries_and_one_in_chunks_holds_the_caches_float16(tiny_model):
    half = RecordedPrefill(queries=False, chunk_dtype=torch.float16)
    tokens, positions = (
        torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(8)),
        torch.arange(30)[None],
    )
    half.record(tiny_model, tokens, positions, positions[:, -1:], 8)
    k, v, q = half.recorder.layers[0]
    assert k.dtype == v.dtype == torch.float16 and k.shape[2] == 30 and q.shape[2] == 0
    assert reads_recorded_queries(cache_spec(load_cache_config("kvzip"), 2)) is False
    for name in ("snapkv", "expected_attention", "kvzip_think"):
        settings = (
            load_cache_config(name)
            if name != "kvzip_think"
            else {**load_cache_config("kvzip"), "key_channel_pruning": 0.5}
        )
        assert reads_recorded_queries(cache_spec(settings, 2)) is True


def test_the_reference_steered_oracle_reads_the_given_answers(tiny_model):
    """oracle_answer reference scores the prompt by the rest of the prompt and each prompt's reference answer: given
    the full cache's own greedy answer (the generated oracle's continuation: its first max_new_tokens - 1 tokens), it
    keeps what the generated oracle keeps, token for token; other answers steer it elsewhere; without answers
    (generate.py's case) it is one error naming the setting."""
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 33)]
    settings = {"cache_strategy": "recent_global", "prompt_compression_strategy": "oracle", "compression_ratio": 0.75}
    generated = cache_spec({**settings, "recent_window": 1}, 2)
    reference = cache_spec({**settings, "recent_window": 1, "oracle_answer": "reference"}, 2)
    decoded = [4, 6]
    full = cache_spec({"cache_strategy": "full"}, 2)
    greedy = generate(tiny_model, prompts, 6, full, decoded_prompt_tokens=decoded).tokens
    want = generate(tiny_model, prompts, 6, generated, decoded_prompt_tokens=decoded).tokens
    steered = [t[:5] for t in greedy]
    got = generate(tiny_model, prompts, 6, reference, decoded_prompt_tokens=decoded, reference_answers=steered)
    assert got.tokens == want
    others = [[(t + 17) % 64 for t in answer] for answer in steered]
    moved = generate(tiny_model, prompts, 6, reference, decoded_prompt_tokens=decoded, reference_answers=others)
    assert moved.tokens != want
    with pytest.raises(ValueError, match="oracle_answer reference scores the prompt by each prompt's reference"):
        generate(tiny_model, prompts, 6, reference, decoded_prompt_tokens=decoded)

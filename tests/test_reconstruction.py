"""Scores that need the model to run again: KVzip's context reconstruction and the oracle's future
attention, against attention computed directly from a plain prefill of the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import cache_spec
from kvlab.engine import generate
from kvlab.reconstruction import KVzip, Oracle, prompt_attention_from
from kvlab.recording import RecordedPrefill
from kvlab.scores import prompt_attention
from kvlab.strategies import make_prompt_compressor


def direct(model, prompt: list[int], passes: list[tuple[list[int], int]], reduce: str) -> list[torch.Tensor]:
    """Per layer [H_kv, n]: each pass prefilled after the prompt as one sequence, its attention computed
    from the recorded queries and keys, counted rows only, over the prompt's keys."""
    n = len(prompt)
    total = None
    for ids, skip in passes:
        recorded = RecordedPrefill()
        sequence = torch.tensor([prompt + ids])
        positions = torch.arange(sequence.shape[1])[None]
        recorded.record(model, sequence, positions, positions[:, -1:])
        per_layer = []
        for k, _, q in recorded.recorder.layers:
            probs = prompt_attention(q[:, :, n + skip :], k, positions, positions[:, n + skip :])[0, ..., :n]  # [H_kv, group, t, n]
            per_layer.append(probs.amax(dim=(1, 2)) if reduce == "max" else probs.sum(dim=(1, 2)))
        total = per_layer if total is None else [torch.maximum(a, b) if reduce == "max" else a + b for a, b in zip(total, per_layer, strict=True)]
    return total


def prompt_kv(model, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    recorded = RecordedPrefill()
    positions = torch.arange(len(prompt))[None]
    recorded.record(model, torch.tensor([prompt]), positions, positions[:, -1:])
    return [(k, v) for k, v, _ in recorded.recorder.layers]


@pytest.mark.parametrize("chunk", [64, 7])
def test_kvzip_scores_are_the_max_attention_of_the_repeated_prompt(tiny_model, chunk):
    prompt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    instruction = (5, 9, 11)
    passes = KVzip(chunk=chunk).queries(prompt, [], instruction)
    assert len(passes) == -(-30 // chunk) and all(ids[:3] == list(instruction) and skip == 3 for ids, skip in passes)
    got = prompt_attention_from(tiny_model, prompt_kv(tiny_model, prompt), passes, "max")
    for ours, reference in zip(got, direct(tiny_model, prompt, passes, "max"), strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_oracle_scores_are_the_attention_summed_over_the_future(tiny_model):
    prompt = torch.randint(0, 64, (25,), generator=torch.Generator().manual_seed(1)).tolist()
    future = [3, 14, 15, 9, 2, 6]
    passes = Oracle().queries(prompt, future, ())
    got = prompt_attention_from(tiny_model, prompt_kv(tiny_model, prompt), passes, "sum")
    for ours, reference in zip(got, direct(tiny_model, prompt, passes, "sum"), strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert all((g.sum(dim=-1) > 0).all() for g in got)


@pytest.mark.parametrize("compressor", ["kvzip", "oracle"])
def test_generation_keeps_the_prompt_tokens_the_model_scores_highest(tiny_model, compressor):
    """Through generate: each head keeps exactly the top int((1 - ratio) x prompt) tokens by the model-pass
    scores (sinks and the recent window protected), and batch rows equal each alone."""
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 33)]
    spec = cache_spec({"cache_strategy": "recent_global", "prompt_compression_strategy": compressor, "compression_ratio": 0.5, "recent_window": 2}, 2)
    batch = generate(tiny_model, prompts, 5, spec, decoded_prompt_tokens=[4, 6])
    alone = [generate(tiny_model, [p], 5, spec, decoded_prompt_tokens=[d]).tokens[0] for p, d in zip(prompts, [4, 6], strict=True)]
    assert batch.tokens == alone
    prompt, decoded = prompts[1], 6
    generate(tiny_model, [prompt], 5, spec, decoded_prompt_tokens=[decoded])
    n = len(prompt) - decoded
    if compressor == "kvzip":
        passes = KVzip().queries(prompt[:n], [], ())
    else:
        reference = generate(tiny_model, [prompt], 5, cache_spec({}, 2), decoded_prompt_tokens=[decoded]).tokens[0]
        passes = Oracle().queries(prompt[:n], prompt[n:] + reference[:4], ())
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
        make_prompt_compressor("kvzip")(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))

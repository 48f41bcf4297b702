"""Streaming through texts longer than the context (`chunked.stream_losses`): StreamingLLM's positions within the
cache, keys re-rotated; exact where nothing is evicted; flat memory; positions bounded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import paul_graham_text
from kvlab.build import build_caches
from kvlab.chunked import stream_losses
from kvlab.config import cache_spec
from kvlab.eviction import EvictionCache
from kvlab.model import apply_rope


def test_repositioned_keys_are_the_keys_rotated_at_their_new_positions(tiny_model):
    """Held tokens at positions 0, 3, 7, 20 move to 0, 1, 2, 3: each stored key becomes the raw key rotated at its
    rank."""
    cache = EvictionCache(1, 2, 6, 8, torch.float32, global_tokens=1, recent_window=1)  # the tiny model's head_dim
    cos, sin = tiny_model.rope_cos, tiny_model.rope_sin
    raw = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 3, 7, 20, -1, -1], [20, 0, -1, 7, 3, -1]])[None]  # each head in its own slot order
    at = pos.clamp(min=0)
    cache.storage.write(torch.arange(6).expand(1, 2, 6), apply_rope(raw, cos[at], sin[at]), raw)
    cache.pos.copy_(pos)
    assert cache.reposition(cos, sin) == 4
    rank = torch.tensor([[0, 1, 2, 3, -1, -1], [3, 0, -1, 2, 1, -1]])[None]
    assert torch.equal(cache.pos, rank)
    held = rank >= 0
    expected = apply_rope(raw, cos[rank.clamp(min=0)], sin[rank.clamp(min=0)])
    # float32 RoPE products, |k| ~ 4
    torch.testing.assert_close(cache.storage.read()[0][held], expected[held], atol=1e-5, rtol=1e-5)


def test_streaming_that_evicts_nothing_gives_the_one_shot_losses(smollm):
    """A budget the text fits: chunks attend over every earlier token at their own positions, as one forward pass
    does."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(paul_graham_text())[:700]
    spec = cache_spec({"cache_strategy": "keydiff", "max_cache_length": 800}, model.config.n_layer)
    streamed = stream_losses(model, ids, spec, 128)
    build_caches(model, cache_spec({"cache_strategy": "full"}, model.config.n_layer), [700], 1, 701)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(700)[None], prefill=True, logits_at=torch.arange(699)[None])
    one_shot = F.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="none")
    torch.testing.assert_close(streamed, one_shot, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("strategy", ["recent_global", "keydiff", "heavy_hitter"])
def test_a_text_beyond_the_context_streams_with_flat_memory_and_bounded_positions(strategy, tiny_model, monkeypatch):
    """The tiny model's context is 128 tokens; 600 stream through a budget of 24 in chunks of 16."""
    seen = {"positions": 0, "held": 0, "bytes": set()}
    original = EvictionCache.reposition

    def watched(self, cos, sin):
        seen["held"] = max(seen["held"], int((self.pos >= 0).sum(dim=-1).max()))
        seen["positions"] = max(seen["positions"], int(self.pos.max()))
        seen["bytes"].add(self.nbytes())
        return original(self, cos, sin)

    monkeypatch.setattr(EvictionCache, "reposition", watched)
    ids = torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    losses = stream_losses(tiny_model, ids, cache_spec({"cache_strategy": strategy, "max_cache_length": 24}, 2), 16)
    assert losses.shape == (599,) and bool(losses.isfinite().all())
    assert seen["held"] == 24 and seen["positions"] == 24 + 16 - 1 and len(seen["bytes"]) == 1


def test_streaming_refuses_budgets_it_cannot_hold_flat(tiny_model):
    for settings, error in [
        ({"cache_strategy": "keydiff", "max_cache_length": 0.5}, "one slot count for every head"),
        (
            {"cache_strategy": "keydiff", "max_cache_length": 24, "head_budget": "adakv"},
            "one slot count for every head",
        ),
        ({"cache_strategy": "quest", "max_cache_length": 24}, "quest cannot"),
    ]:
        with pytest.raises(ValueError, match=error):
            stream_losses(tiny_model, list(range(100)), cache_spec(settings, 2), 16)

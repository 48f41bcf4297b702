"""Each score is written once (kvlab/scores.py) and applied by the bases to the prompt and to the cache:
the scores agree with direct computations, and a key-scored strategy ranks its prompt and its cache
with the very same function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import ROOT
from kvlab.build import make_caches
from kvlab.config import CACHE_KEYS, options_table
from kvlab.prompt_compression import KeyScores
from kvlab.scores import keydiff, pool_keys, prompt_attention, window_attention
from kvlab.strategies import CACHE_STRATEGIES, PROMPT_COMPRESSORS, KeyDiffCache


def test_keydiff_is_minus_the_cosine_to_the_mean_of_held_keys():
    torch.manual_seed(0)
    k = torch.randn(2, 3, 7, 8)
    pos = torch.arange(7).expand(2, 3, 7).clone()
    pos[1, :, 5:] = -1  # empty slots do not count towards the mean
    scores = keydiff(k, pos)
    for b, held in ((0, 7), (1, 5)):
        mean = k[b, :, :held].mean(dim=1, keepdim=True)
        torch.testing.assert_close(scores[b, :, :held], -F.cosine_similarity(k[b, :, :held], mean, dim=-1))


def test_keydiff_prompt_and_cache_share_one_score():
    assert KeyDiffCache.key_score is keydiff
    assert isinstance(PROMPT_COMPRESSORS["keydiff"], KeyScores) and PROMPT_COMPRESSORS["keydiff"].score is keydiff
    cache = make_caches("keydiff", 1, 1, 2, 12, 8, torch.float32, recent_window=1, global_tokens=0)[0]
    assert cache.prompt_compressor.score is keydiff


def test_keydiff_evicts_the_key_closest_to_the_mean():
    """Keys 0..5 point one way except key 3; the incoming token replaces the most typical one, never key 3."""
    torch.manual_seed(1)
    base = torch.randn(8)
    keys = base + 0.01 * torch.randn(6, 8)
    keys[3] = -base
    k = keys[None, None]  # [1, 1, 6, 8]
    cache = make_caches("keydiff", 1, 1, 1, 6, 8, torch.float32, recent_window=1, global_tokens=0)[0]
    input_pos = torch.arange(6)[None]
    cache.prefill(input_pos, k, k, torch.randn(1, 1, 6, 8))
    expected = int(keydiff(k, input_pos[:, None]).argmin())
    cache.update(torch.tensor([[6]]), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
    assert expected != 3 and cache.pos[0, 0].tolist() == [6 if i == expected else i for i in range(6)]


def test_window_attention_is_the_last_queries_rows_of_full_prompt_attention():
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 10, 16), torch.randn(2, 2, 10, 16)
    input_pos = torch.arange(10).expand(2, 10).clone()
    input_pos[1, 7:] = -1  # a shorter, right-padded row
    full = prompt_attention(q, k, input_pos, input_pos)  # [B, H_kv, group, T, T]
    window = window_attention(input_pos, k, q, 4)
    torch.testing.assert_close(window[0], full[0, :, :, 6:10])
    torch.testing.assert_close(window[1], full[1, :, :, 3:7])
    torch.testing.assert_close(window_attention(input_pos, k, q, None), full)
    assert window_attention(input_pos, k, q, 32).shape[3] == 10  # never more queries than the prompt has


def test_pool_keys_matches_max_and_avg_pooling():
    scores = torch.rand(2, 3, 11)
    for kind, pool in (("max", F.max_pool1d), ("avg", F.avg_pool1d)):
        expected = pool(scores.reshape(6, 1, 11), 5, stride=1, padding=2).view(2, 3, 11)
        torch.testing.assert_close(pool_keys(scores, 5, kind), expected)


def test_every_declared_option_is_a_setting_and_in_the_table():
    """Options are declared once, with what uses them: each strategy's and compressor's options reach
    CACHE_KEYS (flags, YAML) and the generated table."""
    declared = {o.name for cls in CACHE_STRATEGIES.values() for o in cls.options}
    declared |= {o.name for c in PROMPT_COMPRESSORS.values() for o in c.options}
    assert declared <= set(CACHE_KEYS)
    table = options_table()
    assert all(f"| `--{name}` |" in table for name in CACHE_KEYS)


def test_readme_table_is_the_generated_one():
    """The README's settings table is derived from the declarations (regenerate: python -m kvlab.config)."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index("<!-- options:start -->\n"), readme.index("<!-- options:end -->")
    assert readme[start + len("<!-- options:start -->\n") : end].strip() == options_table()

"""scripts/snapkv_trace.py: the needle's key and value columns, SnapKV's scores over a window as the compressor
gives them, and the shares of heads keeping a part."""

from __future__ import annotations

import sys

import torch

from conftest import ROOT
from kvlab.prompt_compression import SnapKV
from kvlab.tasks import resolve_tasks

sys.path.insert(0, str(ROOT / "scripts"))
import snapkv_trace  # noqa: E402


def test_needle_parts_are_the_key_and_value_tokens(smollm):
    _, tokenizer, _ = smollm
    (task,) = resolve_tasks(["niah_single_2"])
    for example in task.examples(tokenizer, 2, context_length=512):
        parts = snapkv_trace.needle_parts(tokenizer, example)
        decoded = {name: tokenizer.decode([example.input_ids[i] for i in columns]) for name, columns in parts.items()}
        assert decoded == {"key": " " + example.info["queries"][0], "value": example.answers[0]}


def test_window_scores_are_snapkvs_with_the_prompts_tail_kept():
    g = torch.Generator().manual_seed(0)
    k, q = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 6, 20, 8, generator=g)
    settings = dict(snapkv_trace.KVPRESS, window=5)
    direct = SnapKV(**settings)(torch.arange(20)[None], k, k, q)[0]
    assert torch.equal(snapkv_trace.window_scores(snapkv_trace.KVPRESS, k, q, 15, 19, 20), direct)
    early = snapkv_trace.window_scores(snapkv_trace.KVPRESS, k, q, 10, 14, 20)
    assert torch.equal(early[:, :15], SnapKV(**settings)(torch.arange(15)[None], k[:, :, :15], k, q[:, :, :15])[0])
    assert early[:, 15:].isinf().all()  # after the window: the prompt's tail, kept
    per_query_head = snapkv_trace.window_scores(snapkv_trace.PAPER, k, q, 12, 19, 20)
    assert per_query_head.shape == (6, 20)


def test_kept_shares_count_heads_keeping_a_whole_part():
    scores = torch.tensor([[5.0, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]])  # head 0 ranks column 0 first, head 1 column 5
    shares = snapkv_trace.kept_shares(scores, {"front": [0, 1], "back": [4, 5]}, keep=2)
    assert shares["front"][0] == 0.5 and shares["back"][0] == 0.5
    # percentiles: head 0 ranks columns 0, 1 at 0 and 1 of 6 (100, 83.3), head 1 at 5 and 4 (16.7, 33.3)
    torch.testing.assert_close(torch.tensor(shares["front"][1]), torch.tensor((100 + 500 / 6 + 100 / 6 + 200 / 6) / 4))

"""Behaviour kept across refactors: every shipped config's greedy tokens, as recorded from main before the
kvlab/ package move (tests/data/recorded_tokens.json), for a batch of two prompts of different lengths,
for one prompt decoded through the compressed cache (compress_first_token, from a recorded prefill as
eval runs it), and for kvcompress served by continuous batching. On torch's kernels (conftest.torch_kernels):
kvlab's native ones part from the recording where a decision ties within rounding, e.g. kvc_ada_snapkv, whose
eviction across every layer and head flips at the 4th decoded token (logits then 3.6e-2 apart, against 3e-5
before) and whose 6th token's top two logits lie 0.0025 apart."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import ROOT, fast_few, torch_kernels
from kvlab.config import CONFIGS_DIR, cache_spec
from kvlab.config_files import load_cache_config
from kvlab.engine import generate
from kvlab.recording import RecordedPrefill
from kvlab.serving import serve

RECORDED = json.loads((ROOT / "tests/data/recorded_tokens.json").read_text())


@pytest.fixture(autouse=True, scope="module")
def on_torch_kernels(smollm):
    with torch_kernels(smollm[0]):
        yield


def test_every_shipped_config_is_recorded():
    assert sorted(RECORDED["configs"]) == sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


@pytest.mark.parametrize(
    "name", fast_few(sorted(RECORDED["configs"]), ["heavy_hitter", "snapkv", "ada_snapkv", "kvcompress"])
)
def test_shipped_config_tokens_are_unchanged(smollm, name):
    model, tokenizer, _ = smollm
    prompts = [tokenizer.encode(p) for p in RECORDED["prompts"]]
    spec = cache_spec(load_cache_config(name), model.config.n_layer, tokenizer)
    torch.manual_seed(0)
    assert generate(model, prompts, RECORDED["max_new_tokens"], spec).tokens == RECORDED["configs"][name]["batch"]
    torch.manual_seed(0)
    first = dataclasses.replace(spec, compress_first_token=True)
    tokens = generate(model, prompts[:1], RECORDED["max_new_tokens"], first, recorded=RecordedPrefill()).tokens
    assert tokens == RECORDED["configs"][name]["compress_first_token"]


def test_served_kvcompress_tokens_are_unchanged(smollm):
    model, tokenizer, _ = smollm
    prompts = [tokenizer.encode(p) for p in RECORDED["prompts"]]
    spec = cache_spec(load_cache_config("kvcompress"), model.config.n_layer, tokenizer)
    assert (
        serve(model, prompts + prompts[:1], RECORDED["max_new_tokens"], 2, spec).tokens == RECORDED["serve_kvcompress"]
    )

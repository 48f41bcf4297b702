"""Tensor parallelism on torch.distributed (gloo, 2 CPU ranks): the sharded model gives the tokens and
logits of one process, and strategies that decide across heads (Ada-KV, KV-Compress) keep the same
KVs per head. Each test launches tests/tp_worker.py under torchrun and compares what the ranks saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tp_worker import SHORT_PROMPT, TINY_SETTINGS, per_head_slots

from conftest import ROOT, torch_kernels, two_ranks
from kvlab import parallel
from kvlab.config import cache_spec
from kvlab.config_files import load_cache_config
from kvlab.engine import generate
from kvlab.recording import RecordedPrefill
from kvlab.strategies import CACHE_STRATEGIES

RECORDED = json.loads((ROOT / "tests/data/recorded_tokens.json").read_text())
# Every strategy, and each path that differs under tensor parallelism: decisions across heads or layers
# (Ada-KV, KV-Compress, with a pyramid plan), other storage (paged, recallable, quantized), prompt
# compression (SnapKV, per query head too), layer budgets planned from hooked attention outputs (squeeze),
# mixed per-layer strategies, token ids (hybrid). `random` is checked by sampling (see tp_worker.py).
CORE = (
    "full heavy_hitter snapkv snapkv_per_query_head ada_snapkv kvcompress kvc_ada_snapkv kvc_ada_pyramidkv "
    "clusterkv quest squeeze_heavy_hitter quantized_4bit hybrid keydiff l2 tova tova_per_head window "
    "local_global expected_attention lagkv rkv duo_attention"
).split()
ACROSS_HEADS = {
    "ada_snapkv",
    "kvcompress",
    "kvc_ada_snapkv",
    "kvc_ada_pyramidkv",
    "ada_pyramidkv",
    "ada_expected_attention",
    "kvzip",
}
# A sharded matmul sums in another order (differences of ~1e-6); 4-bit codes round those into different
# codes now and then, so after a few tokens the text may part from one process's: the first 8 must agree.
ROUNDING_SENSITIVE = {"quantized_4bit"}
# random scores each head with random numbers drawn for the rank's own heads: not those of one process.
OTHERS = sorted(set(RECORDED["configs"]) - set(CORE) - {"random"})


def torchrun(tmp_path, *args: str) -> list[dict]:
    """Run tests/tp_worker.py on 2 ranks; what each rank saw."""
    cmd = [*two_ranks("torch.distributed.run"), str(ROOT / "tests/tp_worker.py"), str(tmp_path), *args]
    # as recorded: conftest.torch_kernels
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "KVLAB_KERNELS": "torch"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(autouse=True, scope="module")
def on_torch_kernels(smollm):
    with torch_kernels(smollm[0]):
        yield


def one_process_slots(model, spec, prompts) -> list[list[list[int]]]:
    generate(model, prompts, RECORDED["max_new_tokens"], spec)
    return per_head_slots(model)


def check_against_one_process(ranks: list[dict], names: list[str], smollm) -> None:
    """Each config's tokens are the recorded ones of one process; where a decision spans heads, every KV
    head of every layer also holds as many tokens as in one process."""
    model, tokenizer, _ = smollm
    prompts = [tokenizer.encode(p) for p in RECORDED["prompts"]]
    for name in names:
        expected = RECORDED["configs"][name]["batch"]
        for seen in ranks:
            if name in ROUNDING_SENSITIVE:
                assert [row[:8] for row in seen[name]["tokens"]] == [row[:8] for row in expected], name
            else:
                assert seen[name]["tokens"] == expected, name
        if name in ACROSS_HEADS:
            torch.manual_seed(0)
            alone = one_process_slots(
                model, cache_spec(load_cache_config(name), model.config.n_layer, tokenizer), prompts
            )
            sharded = [
                [r0 + r1 for r0, r1 in zip(l0, l1, strict=True)]
                for l0, l1 in zip(ranks[0][name]["slots"], ranks[1][name]["slots"], strict=True)
            ]
            assert sharded == alone, name


@pytest.mark.slow
def test_sharded_generation_equals_one_process(tmp_path, smollm):
    ranks = torchrun(tmp_path, "smollm", *CORE)
    check_against_one_process(ranks, CORE, smollm)
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode(RECORDED["prompts"][0])
    recorded = RecordedPrefill()
    recorded.record(model, torch.tensor([prompt]), torch.arange(len(prompt))[None], torch.tensor([[len(prompt) - 1]]))
    alone = recorded.logits[0, -1]
    for seen in ranks:
        torch.testing.assert_close(torch.tensor(seen["logits"]), alone, atol=2e-4, rtol=1e-4)
    assert ranks[0]["sampled_random"] == ranks[1]["sampled_random"]  # rank 0's samples, fed on every rank


@pytest.mark.slow
def test_the_core_set_runs_sharded_on_a_one_token_prompt(tmp_path, smollm):
    """Issue 33's short prompts under torchrun: every core config runs, and gives one process's tokens."""
    ranks = torchrun(tmp_path, "short", *CORE)
    model, tokenizer, _ = smollm
    for name in CORE:
        torch.manual_seed(0)
        spec = cache_spec(load_cache_config(name), model.config.n_layer, tokenizer)
        alone = generate(model, [tokenizer.encode(SHORT_PROMPT)], 8, spec).tokens
        assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"] == alone, name


@pytest.mark.slow
def test_torchrun_generate_prints_the_text_of_one_process():
    """The issue's own check: the README's `python -m kvlab.launch --nproc_per_node 2 generate.py --cache_strategy
    heavy_hitter` (torchrun's launcher) prints what one process prints (rank 0 alone talks)."""
    flags = ["generate.py", "--cache_strategy", "heavy_hitter", "--max_new_tokens", "24"]
    alone = subprocess.run([sys.executable, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    sharded = subprocess.run(
        [*two_ranks("kvlab.launch"), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == sharded.returncode == 0, sharded.stderr[-2000:]
    assert sharded.stdout == alone.stdout and len(alone.stdout) > 50
    assert "tensor parallel over 2 ranks" in sharded.stderr


@pytest.mark.slow
def test_every_other_shipped_config_sharded_equals_one_process(tmp_path, smollm):
    check_against_one_process(torchrun(tmp_path, "smollm", *OTHERS), OTHERS, smollm)


@pytest.mark.slow
def test_compiled_sharded_decode_equals_eager_and_one_process(tmp_path, tiny_model):
    ranks = torchrun(tmp_path, "tiny")
    model = tiny_model
    prompts = [[(7 * i) % 64 for i in range(40)], [(3 * i + 1) % 64 for i in range(25)]]
    for name, settings in TINY_SETTINGS.items():
        alone = generate(model, prompts, 24, cache_spec(settings, model.config.n_layer)).tokens
        for seen in ranks:
            assert seen[name]["eager"] == seen[name]["compiled"] == alone, name


def test_heads_split_unevenly_and_a_rank_finds_its_own(monkeypatch):
    assert parallel.split(3, 2) == (2, 1) and parallel.split(8, 3) == (3, 3, 2)
    x = torch.arange(9.0).view(1, 9, 1)  # 9 query heads: 3 per KV head
    assert parallel.local_heads(x) is x and parallel.all_heads(3) == 3  # one process: the identity
    monkeypatch.setattr(parallel, "_shard", parallel.HeadShard(1, (2, 1)))  # rank 1 of 2: KV head 2
    assert parallel.local_heads(x).flatten().tolist() == [6.0, 7.0, 8.0]  # its query heads
    assert (
        parallel.local_heads(x[:, :3]).flatten().tolist() == [2.0]
        and parallel.all_heads(1) == 3
        and parallel.all_heads(3) == 9
    )
    assert parallel.first_head() == 2


def test_every_strategy_is_covered():
    """A new strategy must join CORE to be tested sharded."""
    covered = set()
    for name in CORE:
        strategy = load_cache_config(name)["cache_strategy"]
        covered |= set(strategy) if isinstance(strategy, list) else {strategy}
    assert set(CACHE_STRATEGIES) - covered <= {"random"}

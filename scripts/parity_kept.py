"""Which prompt tokens kvpress's press and kvlab's method of the same name keep, on one of kvlab's RULER examples: per
layer and KV head, the positions one side keeps and the other drops. Where kvpress_parity.py finds two answers
that part, this says whether the two caches differed before the first answer token, and where.

    .venv-parity/bin/python scripts/parity_kept.py kvzip niah_single_2/1024/0 --protocol query_agnostic --ratio 0.875

kvpress's side: the context prefilled under the press on transformers' model, as the parity run does. A press that
removes tokens (a ScorerPress) is read from the keys it returns, matched to the keys it was given; one that masks
them (AdaKV, CriticalAdaKV, KVzip, DuoAttention) from each attention module's `masked_key_indices`. kvlab's side:
the positions each layer's cache holds after `generate` under the method's config at that ratio, as eval.py runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch
from kvpress_pipeline import context_end, kvpress_inputs, prefilled  # scripts/ is on the path
from torch import Tensor

from kvlab.checkpoint import load_checkpoint
from kvlab.cli import ArgumentParser, run_cli
from kvlab.convert import default_checkpoint
from kvlab.engine import generate
from kvlab.jobs import PROTOCOLS, RATIO, Job, job_spec
from kvlab.model import Transformer


def kept_by_match(keys: Tensor, kept: Tensor) -> Tensor:
    """[H, T] bool: which of keys [1, H, T, D] a press returned as kept [1, H, n, D] (exact copies: gathered)."""
    same = (kept[0][:, :, None, :] == keys[0][:, None, :, :]).all(dim=-1)  # [H, n, T]
    return same.any(dim=1)


def kvpress_kept(model: Any, press: Any, context: list[int]) -> list[Tensor]:
    """[H_kv, T] bool per layer: the context tokens the press keeps."""
    removed: dict[int, Tensor] = {}
    compress = press.compress

    def recording(
        module: Any, hidden_states: Tensor, keys: Tensor, values: Tensor, attentions: Any, kwargs: dict
    ) -> tuple[Tensor, Tensor]:
        kept_keys, kept_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        removed[module.layer_idx] = ~kept_by_match(keys, kept_keys)
        return kept_keys, kept_values

    press.compress = recording
    prefilled(model, press, context)
    layers = []
    for i, layer in enumerate(model.model.layers):
        held = ~removed.get(i, torch.zeros(model.config.num_key_value_heads, len(context), dtype=torch.bool))
        if getattr(layer.self_attn, "masked_key_indices", None) is not None:
            _, heads, positions = layer.self_attn.masked_key_indices
            held[heads, positions] = False
        layers.append(held)
    return layers


def kvlab_kept(model: Transformer, context: int) -> list[Tensor]:
    """[H_kv, context] bool per layer: the context positions each layer's cache holds (first sequence)."""
    layers = []
    for layer in model.layers:
        pos = layer.attention.kv_cache.pos[0]
        # a cache whose heads share positions
        pos = pos if pos.dim() == 2 else pos.expand(layer.attention.n_local_heads, -1)
        held = torch.zeros(pos.shape[0], context, dtype=torch.bool)
        for head, row in enumerate(pos):
            held[head, row[(row >= 0) & (row < context)]] = True
        layers.append(held)
    return layers


def differences(theirs: list[Tensor], ours: list[Tensor]) -> list[dict[str, Any]]:
    """Per layer: tokens kept by each side, and the (head, position) pairs only kvpress keeps and only kvlab keeps."""
    rows = []
    for layer, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        only_a, only_b = ((a & ~b).nonzero().tolist(), (b & ~a).nonzero().tolist())
        rows.append(
            {
                "layer": layer,
                "kvpress": int(a.sum()),
                "kvlab": int(b.sum()),
                "kvpress_only": list(map(tuple, only_a)),
                "kvlab_only": list(map(tuple, only_b)),
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", help="a kvlab config with a kvpress press (kvpress_parity.py's methods)")
    parser.add_argument("example", help="a RULER example id, e.g. niah_single_2/1024/0 (task/context length/index)")
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="query_agnostic",
        help="what is compressed: the context alone, or the question too",
    )
    parser.add_argument(
        "--ratio", type=float, default=0.875, help="compression ratio, the share of the prompt removed (default: 0.875)"
    )
    parser.add_argument(
        "--num_samples", type=int, default=2, help="examples per task, as the parity run made them (default: 2)"
    )
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=Path("results/parity"),
        help="where kvpress_parity.py keeps transformers' model (default: results/parity)",
    )
    return parser


def run(args: argparse.Namespace) -> None:
    task, length = args.example.split("/")[:2]
    inputs = argparse.Namespace(
        tasks=[task], num_samples=args.num_samples, context_length=int(length), out_dir=args.out_dir
    )
    tokenizer, hf, factories, examples = kvpress_inputs(inputs)
    if factories.get(args.method) is None:
        raise ValueError(
            f"{args.method!r} has no kvpress press; valid: "
            f"{', '.join(m for m, f in factories.items() if f is not None)}"
        )
    ids = [e.id for e in examples[task]]
    if args.example not in ids:
        raise ValueError(
            f"example {args.example!r} is not among the {args.num_samples} made per task; valid: {', '.join(ids)}"
        )
    example = examples[task][ids.index(args.example)]
    agnostic = PROTOCOLS[args.protocol]
    split = context_end(example, agnostic)
    theirs = kvpress_kept(hf, factories[args.method](args.ratio), example.input_ids[:split])
    model, _, _ = load_checkpoint(default_checkpoint(), "cpu")
    job = Job(args.method, f"{RATIO}{args.ratio}", task, int(length), query_agnostic=agnostic)
    spec = dataclasses.replace(job_spec(job, model.config.n_layer, tokenizer), compress_first_token=True)
    decoded = [len(example.input_ids) - split] if agnostic else None
    generate(model, [example.input_ids], 1, spec, stop_ids=tokenizer.stop_ids, decoded_prompt_tokens=decoded)
    rows = differences(theirs, kvlab_kept(model, split))
    for row in rows:
        print(
            f"layer {row['layer']}: kept {row['kvpress']} / {row['kvlab']} (kvpress / kvlab); only kvpress "
            f"{row['kvpress_only']}; only kvlab {row['kvlab_only']}"
        )
    total = sum(len(r["kvpress_only"]) + len(r["kvlab_only"]) for r in rows)
    print(
        f"{args.method} {args.protocol} {args.ratio} {args.example}: {total} (head, position) pairs differ of "
        f"{sum(r['kvpress'] for r in rows)} kept by kvpress"
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

"""Calibrate DuoAttention's retrieval heads for a checkpoint, once (kvlab/duo.py has the method).

    python scripts/calibrate_duo.py   # the default model -> checkpoints/SmolLM2-135M-Instruct/duo_attention.json
    python scripts/calibrate_duo.py --checkpoint_path checkpoints/NAME --context_length 4096 --steps 200
    python generate.py --cache_strategy duo_attention --duo_gates checkpoints/NAME/duo_attention.json

The data is synthetic passkey retrieval, our own: RULER's needle tasks (a number hidden in noise or in
essays) with the answer appended; the hidden states of the question and the answer are supervised.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvlab.checkpoint import load_checkpoint
from kvlab.cli import ArgumentParser, resolve_device_dtype, run_cli
from kvlab.convert import default_checkpoint
from kvlab.duo import GATES_FILE, calibrate, write_gates
from kvlab.tasks import resolve_tasks

TASKS = ("niah_single_1", "niah_single_2")


def passkey_sequences(tokenizer, context_length: int, num_samples: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, supervised tail: question, end of turn, answer prefix and answer) per example."""
    sequences = []
    for task in resolve_tasks(list(TASKS)):
        for example in task.examples(tokenizer, num_samples, seed, context_length):
            ids = example.input_ids + tokenizer.encode(f" {example.answers[0]}.")
            sequences.append((ids, len(ids) - example.question_start))
    return sequences


def run(args: argparse.Namespace) -> None:
    if args.steps < 1 or args.num_samples < 1:
        raise ValueError(f"--steps and --num_samples must be >= 1, got {args.steps} and {args.num_samples}")
    device, dtype = resolve_device_dtype(args.device, "float32")
    checkpoint = args.checkpoint_path or default_checkpoint()
    model, tokenizer, config = load_checkpoint(checkpoint, device, dtype)
    sequences = passkey_sequences(tokenizer, args.context_length, args.num_samples, args.seed)
    torch.manual_seed(args.seed)
    gates, losses = calibrate(model, sequences, args.steps, args.sinks, args.recent, args.lr, args.l1)
    out = args.out or Path(checkpoint) / GATES_FILE
    facts = dict(model=config["name"], sinks=args.sinks, recent=args.recent, steps=args.steps, lr=args.lr, l1=args.l1)
    write_gates(
        out,
        gates,
        **facts,
        context_length=args.context_length,
        tasks=list(TASKS),
        first_loss=losses[0],
        last_loss=losses[-1],
    )
    ranked = gates.flatten().sort(descending=True).values
    print(
        f"wrote {out}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; gates from {ranked[-1]:.2f} to "
        f"{ranked[0]:.2f}, median {ranked.median():.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, help="kvlab checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, help=f"gates file (default: <checkpoint>/{GATES_FILE})")
    p.add_argument("--context_length", type=int, default=1024, help="passkey prompt length in tokens (default: 1024)")
    p.add_argument("--num_samples", type=int, default=4, help=f"examples per task ({', '.join(TASKS)}) (default: 4)")
    p.add_argument(
        "--steps", type=int, default=40, help="optimisation steps, cycling through the examples (default: 40)"
    )
    p.add_argument("--sinks", type=int, default=64, help="streaming heads' attention sinks (default: 64, the paper's)")
    p.add_argument("--recent", type=int, default=256, help="streaming heads' recent window (default: 256, the paper's)")
    p.add_argument("--lr", type=float, default=0.02, help="Adam learning rate (default: 0.02, the paper's)")
    p.add_argument(
        "--l1",
        type=float,
        default=0.05,
        help="weight of the summed gates, pushing heads to stream (default: 0.05, the paper's)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the examples (default: 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    run_cli(run, p.parse_args(argv))


if __name__ == "__main__":
    main()

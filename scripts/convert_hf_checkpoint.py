"""Convert a Hugging Face Llama / Mistral / Qwen2 / Qwen3 model directory (config.json + safetensors, sharded or
not, + tokenizer files) into a kvlab checkpoint.

    python scripts/convert_hf_checkpoint.py --hf_dir path/to/hf_model [--out_dir checkpoints/NAME]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.checkpoint import CHECKPOINTS_DIR
from kvlab.cli import ArgumentParser, run_cli
from kvlab.convert import convert_hf_checkpoint


def convert(args: argparse.Namespace) -> None:
    out_dir = args.out_dir or CHECKPOINTS_DIR / args.hf_dir.name
    convert_hf_checkpoint(args.hf_dir, out_dir, args.name)
    print(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_dir", type=Path, required=True, help="Hugging Face model directory")
    p.add_argument(
        "--out_dir", type=Path, default=None, help="output checkpoint directory (default: checkpoints/<hf_dir name>)"
    )
    p.add_argument("--name", default=None, help="model name stored in the checkpoint (default: the hf_dir name)")
    run_cli(convert, p.parse_args(argv))


if __name__ == "__main__":
    main()

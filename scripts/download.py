"""Download a Hugging Face model with huggingface_hub and convert it to a kvlab checkpoint.

    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B-Instruct [--hf_token ...]

Needs network access to the hub (gated models also need a token). Known short names: kvlab.checkpoint.KNOWN_MODELS.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvlab.checkpoint import CHECKPOINTS_DIR, KNOWN_MODELS, CheckpointError
from kvlab.cli import ArgumentParser, run_cli
from kvlab.convert import convert_hf_checkpoint

ALLOW_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
]


def download(repo_id: str, hf_dir: Path, token: str | None = None) -> Path:
    """Fetch only what conversion needs (no .bin/.pth duplicates)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, local_dir=hf_dir, allow_patterns=ALLOW_PATTERNS, token=token)
    except Exception as e:  # the hub raises many types (offline, gated, not found); all end here
        raise CheckpointError(
            f"could not download {repo_id!r} from the Hugging Face hub: {type(e).__name__}: {e}"
        ) from e
    return hf_dir


def download_and_convert(args: argparse.Namespace) -> None:
    repo_id = KNOWN_MODELS[args.repo_id].hf_repo if args.repo_id in KNOWN_MODELS else args.repo_id
    name = repo_id.split("/")[-1]
    hf_dir = download(repo_id, args.download_dir / name, args.hf_token)
    out_dir = convert_hf_checkpoint(hf_dir, args.out_dir or CHECKPOINTS_DIR / name, name)
    print(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", required=True, help=f"hub repo id, or a known short name: {', '.join(KNOWN_MODELS)}")
    p.add_argument(
        "--hf_token", default=os.environ.get("HF_TOKEN"), help="hub token for gated models (default: $HF_TOKEN)"
    )
    p.add_argument(
        "--download_dir",
        type=Path,
        default=CHECKPOINTS_DIR / "hf",
        help="where the raw HF files go (default: checkpoints/hf)",
    )
    p.add_argument(
        "--out_dir", type=Path, default=None, help="kvlab checkpoint directory (default: checkpoints/<repo name>)"
    )
    run_cli(download_and_convert, p.parse_args(argv))


if __name__ == "__main__":
    main()

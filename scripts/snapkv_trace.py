"""Where SnapKV loses the needle: on RULER needle examples with the question inside the compressed prompt
(query-aware), which of the needle's tokens each variant of SnapKV's score keeps, per layer and KV head.

    python scripts/snapkv_trace.py --task niah_single_2 --context_length 2048 --num_samples 8 --ratio 0.5

One recorded prefill per example (every layer's keys and queries), then each variant scores every layer's prompt as
the prompt compressor does (`kvlab.prompt_compression.SnapKV`), and each (layer, KV head) keeps its top
int((1 - ratio) x prompt) tokens, as kvpress's SnapKVPress does. For the needle "One of the special magic numbers
for <key> is: <value>." it reports the share of (layer, head) pairs that keep every token of the value, every token
of the key, and each part's mean percentile in the head's ranking (100: the best scored). Variants: kvpress's
SnapKVPress (window 64, average-pooled over 5, mean over the query group and the window), the SnapKV paper's code
(window 32, max-pooled over 7, summed over the window, each query head selecting for itself), and observation windows
of the question's own tokens, of the tokens after it (chat template and answer prefix), and of the last token.

Writes --out (default docs/sweeps/snapkv_trace/niah_single_2_2k.md) and a .json beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from kvlab.checkpoint import load_checkpoint
from kvlab.cli import ArgumentParser, positive_int, run_cli
from kvlab.convert import default_checkpoint
from kvlab.prompt_compression import SnapKV
from kvlab.recording import RecordedPrefill
from kvlab.tasks import resolve_tasks
from kvlab.tasks.haystack import token_position

ROOT = Path(__file__).resolve().parent.parent
KVPRESS = dict(window=64, kernel=5, pooling="avg", gqa="mean", window_reduce="mean")
PAPER = dict(window=32, kernel=7, pooling="max", gqa="query", window_reduce="sum")


def needle_parts(tokenizer, example) -> dict[str, list[int]]:
    """The prompt columns of the needle's key and value tokens."""
    needle = example.info["needles"][0]["text"]
    start = token_position(tokenizer, example.input_ids, needle)
    key, value = example.info["queries"][0], example.answers[0]
    at = tokenizer.decode(example.input_ids).index(needle)
    spans = {"key": (at + needle.index(key), len(key)), "value": (at + needle.index(value), len(value))}
    columns = {name: [] for name in spans}
    prefix = len(tokenizer.decode(example.input_ids[:start]))
    begin = prefix
    for i in range(start, start + 64):  # each token's span of the decoded text, from the needle's first token
        end = prefix + len(tokenizer.decode(example.input_ids[start : i + 1]))
        for name, (s, n) in spans.items():
            if begin < s + n and end > s:
                columns[name].append(i)
        begin = end
    return columns


def variants(question: tuple[int, int], length: int, answer: int) -> dict[str, tuple[dict, int, int]]:
    """name -> (SnapKV's settings, first and last column of the observation window); `question`: the first and last
    column of the question, `length` the compressed prompt's columns, `answer` the answer's tokens after it."""
    last = length - 1
    return {
        "kvpress (window 64, avg 5, group mean)": (KVPRESS, last - 63, last),
        "kvpress, window 32": (KVPRESS, last - 31, last),
        "paper (window 32, max 7, per query head)": (PAPER, last - 31, last),
        "kvpress, window = the question only": (KVPRESS, *question),
        "kvpress, window = after the question": (KVPRESS, question[1] + 1, last),
        "kvpress, window = the last token": (KVPRESS, last, last),
        "kvpress, window = the answer's own queries": (KVPRESS, length, length + answer - 1),
    }


def window_scores(settings: dict, k: Tensor, q: Tensor, first: int, end: int, length: int) -> Tensor:
    """SnapKV's scores [H_kv, or H per query head, length] of the prompt's keys, observed by the queries in columns
    first..end: the window's own keys and the prompt's keys after it score inf (SnapKV keeps the window; the later
    ones are the prompt's tail, which a window at the end would hold)."""
    kk, qq = k[:, :, : end + 1], q[:, :, : end + 1]
    if settings["gqa"] == "query":
        kk = kk.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = SnapKV(**{**settings, "window": end - first + 1})(torch.arange(end + 1)[None], kk, kk, qq)[0, :, :length]
    return torch.cat([scores, scores.new_full((scores.shape[0], length - scores.shape[1]), float("inf"))], dim=-1)


def kept_shares(scores: Tensor, parts: dict[str, list[int]], keep: int) -> dict[str, tuple[float, float]]:
    """Per part: the share of heads keeping every one of its columns among their top `keep`, and its columns' mean
    percentile in each head's ranking."""
    order = scores.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order))
    out = {}
    for name, columns in parts.items():
        r = rank[:, columns]
        out[name] = (
            (r < keep).all(dim=-1).float().mean().item(),
            (100 * (1 - r.float() / scores.shape[-1])).mean().item(),
        )
    return out


def trace(model, tokenizer, example, ratio: float) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """variant -> part -> one (share kept whole, mean percentile) per layer, for one example. One prefill of the whole
    prompt followed by its answer: causal, so the prompt's columns are those of the prompt alone, and the answer's
    queries are those that decode it."""
    length = len(example.input_ids) - 1  # query-aware: the prompt but its last token is compressed
    answer = [example.input_ids[-1], *tokenizer.encode(" " + example.answers[0])]
    ids = example.input_ids[:-1] + answer
    question = (example.question_start, token_position(tokenizer, ids, "<|im_end|>", last=True) - 1)
    parts = needle_parts(tokenizer, example)
    recorded = RecordedPrefill()
    recorded.record(model, torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([[len(ids) - 1]]))
    keep = int((1 - ratio) * length)
    out = {}
    for name, (settings, first, end) in variants(question, length, len(answer) - 1).items():
        per_layer = [
            kept_shares(window_scores(settings, k, q, first, end, length), parts, keep)
            for k, _, q in recorded.recorder.layers
        ]
        out[name] = {part: [layer[part] for layer in per_layer] for part in parts}
    return out


def summary(traces: list[dict], n_layer: int) -> dict[str, dict[str, float]]:
    """variant -> {"<part> kept" (share of (layer, head) pairs keeping the whole part), "<part> percentile", and the
    value kept in layers 0-9, 10-19, 20-29}, over the examples."""
    out = {}
    for name in traces[0]:
        row = {}
        for part in traces[0][name]:
            shares = torch.tensor([t[name][part] for t in traces])  # [examples, layers, 2]
            row[f"{part} kept"] = 100 * shares[..., 0].mean().item()
            row[f"{part} percentile"] = shares[..., 1].mean().item()
        thirds = torch.tensor([t[name]["value"] for t in traces])[..., 0].reshape(len(traces), 3, -1)
        for i in range(3):
            layers = f"{i * n_layer // 3}-{(i + 1) * n_layer // 3 - 1}"
            row[f"value kept, layers {layers}"] = 100 * thirds[:, i].mean().item()
        out[name] = row
    return out


def markdown(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    columns = list(next(iter(rows.values())))
    lines = [
        f"# Where SnapKV loses the needle ({args.task}, {args.context_length} tokens, {args.num_samples} examples, "
        f"ratio {args.ratio}, query-aware)",
        "",
        "Share of (layer, KV head) pairs (per query head for the paper's form) keeping every token of the needle's key "
        "and value, and their mean percentile in each head's ranking (100: best scored); `scripts/snapkv_trace.py`.",
        "",
        "| variant | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    lines += [f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |" for name, row in rows.items()]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    torch.set_grad_enabled(False)
    model, tokenizer, _ = load_checkpoint(default_checkpoint(), torch.device("cpu"), torch.float32, False)
    (task,) = resolve_tasks([args.task])
    examples = task.examples(tokenizer, args.num_samples, context_length=args.context_length)
    traces = []
    for i, example in enumerate(examples):
        traces.append(trace(model, tokenizer, example, args.ratio))
        print(f"example {i + 1}/{len(examples)} traced", flush=True)
    rows = summary(traces, model.config.n_layer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows, args))
    record = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(markdown(rows, args))


def main() -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_2", help="a RULER needle task (default: niah_single_2)")
    p.add_argument("--context_length", type=positive_int, default=2048, help="tokens per prompt (default: 2048)")
    p.add_argument("--num_samples", type=positive_int, default=8, help="examples (default: 8)")
    p.add_argument("--ratio", type=float, default=0.5, help="share of the prompt removed (default: 0.5)")
    p.add_argument(
        "--out", type=Path, default=ROOT / "docs/sweeps/snapkv_trace/niah_single_2_2k.md", help="the table's file"
    )
    run_cli(run, p.parse_args())


if __name__ == "__main__":
    main()

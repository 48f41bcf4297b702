"""Prompt scores that need the model to run again. KVzip scores each prompt key by the attention it
receives while the model repeats the prompt; the oracle by the attention it receives from the tokens
a full cache run goes on to decode. Both feed chosen query tokens after the recorded prompt through
probes holding that prompt's keys and values (`prompt_attention_from`); the engine runs them before
the recorded prefill is replayed into the caches (`engine.generate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.attention import attention_mask, grouped_attention, prefill_attention
from kvlab.model import Transformer
from kvlab.options import choice, integer
from kvlab.prompt_compression import PromptCompressor
from kvlab.scores import chunk_attention, merged_attention
from kvlab.tokenizer import Tokenizer

KVZIP_PROMPT = "\n\nRepeat the previous context exactly."
KVZIP_LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
KVZIP_HINT = 8  # a later chunk's request ends with the previous chunk's last tokens
KVZIP_SINKS = 4  # the first prompt tokens, in every pass's softmax (and always kept by the cache's global_tokens)
ORACLE_ANSWERS = ("generated", "reference")


@dataclass(frozen=True)
class RepeatRequest:
    """How KVzip asks the model to repeat the context, as its official code and kvpress do: the request ends the
    user's turn and the repeat is the assistant's answer (`header`: the chat template's end of turn and answer
    header; "\n" without a template). The chat template's tokens before the user's text (`prefix`) are not
    repeated; a later chunk's request quotes the previous chunk's last KVZIP_HINT tokens."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    header: tuple[int, ...]
    prefix: tuple[int, ...]

    @property
    def instruction(self) -> tuple[int, ...]:
        """What precedes the first chunk's repeat (and every chunk's, between prefill chunks)."""
        return self.first + self.header

    @property
    def longest(self) -> int:
        """Tokens of the longest request with its header: what a pass adds before its chunk."""
        return max(len(self.first), len(self.later) + KVZIP_HINT) + len(self.header)

    def context_start(self, prompt: list[int]) -> int:
        """Where the prompt's context begins: after the chat template's prefix when the prompt starts with it."""
        return len(self.prefix) if self.prefix and tuple(prompt[: len(self.prefix)]) == self.prefix else 0


def repeat_request(tokenizer: Tokenizer | None) -> RepeatRequest:
    """The request in this tokenizer's chat template: its prefix and header are what a user turn's text sits between.
    Without a tokenizer (token ids alone, as in tests on random models) the repeat is the context alone."""
    if tokenizer is None:
        return RepeatRequest((), (), (), ())
    if tokenizer.chat_template is None:
        return RepeatRequest(
            tuple(tokenizer.encode(KVZIP_PROMPT)),
            tuple(tokenizer.encode(KVZIP_LATER_PROMPT)),
            tuple(tokenizer.encode("\n")),
            (),
        )
    empty, text = (tokenizer.encode_chat([{"role": "user", "content": c}]) for c in ("", "dummy context"))
    prefix = next(i for i, (a, b) in enumerate(zip(empty, text, strict=False)) if a != b)
    header = next(i for i, (a, b) in enumerate(zip(empty[::-1], text[::-1], strict=False)) if a != b)
    first = tuple(tokenizer.encode(KVZIP_PROMPT))
    return RepeatRequest(
        first, tuple(tokenizer.encode(KVZIP_LATER_PROMPT)), tuple(empty[len(empty) - header :]), tuple(empty[:prefix])
    )


class ModelScored(PromptCompressor):
    """A compressor whose scores come from a further pass of the model: the engine computes them
    (`queries`), so calling it directly is an error."""

    needs_model = True
    needs_reference = False  # True: `queries` reads the continuation of a full cache run
    needs_reference_answers = False  # True: `queries` reads the prompt's reference answer (the caller's)
    reduce = "max"  # how the attention of the queries to a key is combined: "max" or "sum"

    def queries(self, prompt: list[int], continuation: list[int], request: RepeatRequest | None) -> list[Pass]:
        """The query passes for one sequence."""
        raise NotImplementedError

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        raise RuntimeError(
            f"{type(self).__name__} scores come from a pass of the model; run it through kvlab.engine.generate"
        )


@dataclass(frozen=True)
class Pass:
    """Query tokens run after the prompt: the attention of all but the first `skip` is counted; with `window`
    (start, end), only prompt keys start..end are scored, each by its attention renormalised over the first
    KVZIP_SINKS keys, keys start..end and the pass's own keys (KVzip's softmax scope)."""

    ids: list[int]
    skip: int = 0
    window: tuple[int, int] | None = None


class KVzip(ModelScored):
    """KVzip (Kim et al., 2025, arXiv 2505.23416), as its official code and kvpress's KVzipPress: query-agnostic.
    The model is asked to repeat the context (the prompt after its chat template's prefix), in chunks of `chunk`
    tokens: each pass is the request, the answer header, then the chunk again, run after the whole prompt. A key
    of the chunk scores the largest attention any token of the pass pays it (over the query heads of its KV
    head), in a softmax over the first 4 keys, the chunk's and the pass's own. The prefix scores 0."""

    options = (
        integer(
            "kvzip_chunk",
            2048,
            "kvzip: tokens of the context repeated per pass (with --prefill_chunk: each chunk, repeated whole); "
            "shortened, with a note, to what fits the context after a long prompt",
            param="chunk",
        ),
    )

    def __init__(self, chunk: int = 2048) -> None:
        self.options[0].validate(chunk)
        self.chunk = chunk

    def queries(self, prompt: list[int], continuation: list[int], request: RepeatRequest | None) -> list[Pass]:
        if request is None:
            raise ValueError("KVzip needs its repeat request: build the CacheSpec with the tokenizer")
        start = request.context_start(prompt)
        passes = []
        for s in range(start, len(prompt), self.chunk):
            asked = request.first if s == start else (*request.later, *prompt[max(s - KVZIP_HINT, s - self.chunk) : s])
            passes.append(
                Pass([*asked, *request.header, *prompt[s : s + self.chunk]], 0, (s, min(s + self.chunk, len(prompt))))
            )
        return passes

    def score_chunk(self, key_pos: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, q: Tensor, own_from: int) -> Tensor:
        """Between prefill chunks the chunk itself is repeated, after the instruction, in the same forward pass
        (`EvictionCache.prefill_chunk`'s probe): k [B, H_kv, S, D] at key_pos [B, H_kv, S] are the held keys (in
        position order: the sinks first), then from column `own_from` the chunk's and the repeat's own; q [B, H, N, D]
        at query_pos [B, N] the repeating tokens. A chunk key's score: the largest attention one of them pays it in
        KVzip's scope, a softmax over the sinks, the chunk and the repeat's own keys (only these are computed); a held
        key scores 0 (it keeps what its own chunk's repeat paid it)."""
        sinks = min(KVZIP_SINKS, own_from)
        sink_pos = key_pos[..., :sinks]
        scope_pos = torch.cat([sink_pos.masked_fill(sink_pos >= KVZIP_SINKS, -1), key_pos[..., own_from:]], dim=-1)
        scope_k = torch.cat([k[:, :, :sinks], k[:, :, own_from:]], dim=2)
        scores = chunk_attention(scope_pos, scope_k, query_pos, q, None).amax(dim=3).amax(dim=2)
        return F.pad(scores[..., sinks:], (own_from, 0))


class Oracle(ModelScored):
    """An upper bound for research, not a method: a key's score is the attention it receives, summed,
    from every token after the prefill: the rest of the prompt, then an answer: the full cache's greedy one
    (`oracle_answer` generated: the engine runs a full cache first), which bounds how closely a method can follow
    the full cache, or the reference answer an evaluation gives (reference: eval.py's gold answers), which
    bounds the task's score: the keys the right answer reads."""

    reduce = "sum"
    options = (
        choice(
            "oracle_answer",
            ORACLE_ANSWERS,
            "generated",
            "oracle: whose answer's attention scores the prompt: the full cache's greedy one (generated), or each "
            "example's reference answer (reference: eval.py gives them)",
            param="answer",
        ),
    )

    def __init__(self, answer: str = "generated") -> None:
        self.options[0].validate(answer)
        self.answer = answer
        self.needs_reference, self.needs_reference_answers = answer == "generated", answer == "reference"

    def queries(self, prompt: list[int], continuation: list[int], request: RepeatRequest | None) -> list[Pass]:
        return [Pass(continuation)] if continuation else []  # nothing decoded after the prompt: every score stays 0


def with_reference_answers(continuations: list[list[int]], answers: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """Each prompt's tokens after its prefill, then its reference answer: what the oracle steered by the right
    answer (oracle_answer reference) scores the prompt by."""
    if answers is None or len(answers) != len(continuations):
        raise ValueError(
            "oracle_answer reference scores the prompt by each prompt's reference answer, which eval.py gives and "
            "generate.py has not; use oracle_answer generated"
        )
    return [c + list(a) for c, a in zip(continuations, answers, strict=True)]


class AttentionProbe(nn.Module):
    """Stands in for a layer's cache: holds one sequence's prompt keys/values [1, H_kv, T, D], appends each
    pass's own as its parts run, and keeps the attention each prompt key receives (max or sum over the passes).
    It attends itself: where kvlab's native prefill attention runs, that gives the output and each query's
    log-sum-exp, and only the scores a score reads are formed from them (KVzip's: the sinks' and the window's,
    its own keys' share from the kernel's log-sum-exp over them; the oracle's: the prompt's probabilities), never
    the whole [heads, queries, keys] softmax; elsewhere torch's explicit softmax is observed whole."""

    needs_attention, needs_tokens, attends_itself = True, False, True

    def __init__(self, k: Tensor, v: Tensor, reduce: str) -> None:
        super().__init__()
        self.k, self.v, self.reduce = k, v, reduce
        self.scores = torch.zeros(k.shape[:3], device=k.device)
        self.start(Pass([]))

    def start(self, counted: Pass) -> None:
        """A new pass: none of its keys held yet, its next query the first."""
        self.counted, self.first = counted, 0
        self.own_k, self.own_v = self.k[:, :, :0], self.v[:, :, :0]
        self.key_pos = torch.arange(self.k.shape[2], device=self.k.device)[None]

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.append(input_pos, k, v)
        return torch.cat([self.k, self.own_k], dim=2), torch.cat([self.v, self.own_v], dim=2), self.key_pos

    def append(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """A part's keys and values after the pass's earlier ones, its positions after every key's so far."""
        self.own_k, self.own_v = torch.cat([self.own_k, k], dim=2), torch.cat([self.own_v, v], dim=2)
        self.key_pos = torch.cat([self.key_pos, input_pos], dim=1)

    def attend(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        if not kernels.takes_prefill_attention(q, self.k, self.v):
            keys, values, key_pos = self.update(input_pos, k, v, q)
            y, probs = grouped_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attention_mask(key_pos, input_pos), True
            )
            self.observe(probs)
            return y
        y, lse, own_lse = self.split_attention(input_pos, k, v, q)
        skip = self.first_counted(q.shape[2])
        if skip is None:
            return y
        q, lse, own_lse = q[:, :, skip:], lse[:, :, skip:], own_lse[:, :, skip:]
        if self.counted.window is None:
            self.receive(key_probabilities(q, self.k, lse))
        else:
            self.receive_window(q, own_lse)
        return y

    def split_attention(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The output and log-sum-exps of the queries over the prompt (every key seen) and the pass's own keys
        (causal), by the native kernel over each, merged by their log-sum-exps; and the log-sum-exps over the own
        keys alone. The prompt's keys are read in place, never copied beside the pass's (a long document's every
        layer, every part)."""
        self.append(input_pos, k, v)
        T = self.k.shape[2]
        prompt = prefill_attention(q, self.k, self.v, self.key_pos[:, :T], input_pos)
        own = prefill_attention(q, self.own_k, self.own_v, self.key_pos[:, T:], input_pos)
        y, lse = merged_attention(*prompt, *own)
        return y.to(q.dtype), lse, own[1]

    def receive_window(self, q: Tensor, own_lse: Tensor) -> None:
        """KVzip's scope from the native kernel's log-sum-exps: a window key receives e^(s - L) from each counted
        query of q [1, H, n, D], L the query's log-sum-exp over the sinks, the window and the pass's own keys
        (own_lse [1, H, n], the kernel's: the own keys' probabilities are never formed). With reduce max, e^x
        increasing, the largest s - L is found first and only [H_kv, window] exponentials are taken."""
        start, end = self.counted.window
        sinks, window = (key_logits(q, self.k[:, :, a:b]) for a, b in ((0, min(KVZIP_SINKS, start)), (start, end)))
        scope = torch.stack([sinks.logsumexp(-1), window.logsumexp(-1), own_lse.view_as(window[..., 0])]).logsumexp(0)
        scaled = window.sub_(scope[..., None])
        if self.reduce == "max":
            self.receive_largest(scaled.amax(dim=3).amax(dim=2).exp_(), start, end)
        else:
            self.receive(scaled.exp_(), start, end)

    def observe(self, probs: Tensor) -> None:
        """A part's probabilities [1, H_kv, group, queries, T + own keys], torch's."""
        skip = self.first_counted(probs.shape[3])
        if skip is None:
            return
        probs, T = probs[:, :, :, skip:], self.k.shape[2]
        if self.counted.window is None:
            self.receive(probs[..., :T])
            return
        start, end = self.counted.window
        self.receive_in_scope(probs[..., : min(KVZIP_SINKS, start)], probs[..., start:end], probs[..., T:])

    def first_counted(self, queries: int) -> int | None:
        """The first counted query of a part of `queries` next ones (None: the part counts none), the part then run."""
        skip = max(self.counted.skip - self.first, 0)
        self.first += queries
        return None if skip >= queries else skip

    def receive_in_scope(self, sinks: Tensor, window: Tensor, own: Tensor) -> None:
        """KVzip's scope: the window's probabilities renormalised over the sinks, the window and the pass's own keys."""
        start, end = self.counted.window
        in_scope = sinks.sum(-1) + window.sum(-1) + own.sum(-1)
        self.receive(window.div_(in_scope[..., None]), start, end)

    def receive(self, probs: Tensor, start: int = 0, end: int | None = None) -> None:
        """Prompt keys start..end received probs [1, H_kv, group, counted queries, end - start]."""
        if self.reduce == "max":  # in turn: 8x faster than dim=(2, 3) on CPU
            self.receive_largest(probs.amax(dim=3).amax(dim=2), start, end)
        else:
            self.scores[..., start:end] += probs.sum(dim=(2, 3))

    def receive_largest(self, largest: Tensor, start: int, end: int | None) -> None:
        """Prompt keys start..end received at most largest [1, H_kv, end - start] from this part's queries."""
        self.scores[..., start:end] = torch.maximum(self.scores[..., start:end], largest)


def key_probabilities(q: Tensor, k: Tensor, lse: Tensor) -> Tensor:
    """[B, H_kv, group, n, S]: the attention queries q [B, H, n, D] pay keys k [B, H_kv, S, D] (all before them) in a
    softmax whose log-sum-exp is lse [B, H, n] (float32): exp(q.k / sqrt(D) - lse)."""
    logits = key_logits(q, k)
    return logits.sub_(lse.view_as(logits[..., 0])[..., None]).exp_()


def key_logits(q: Tensor, k: Tensor) -> Tensor:
    """[B, H_kv, group, n, S] float32: the scaled scores q.k / sqrt(D) of queries q [B, H, n, D] for keys k
    [B, H_kv, S, D], the query heads grouped by the KV head they share."""
    B, H, n, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    logits = (q.float() * (1.0 / math.sqrt(D))).reshape(B, n_kv, H // n_kv * n, D) @ k.float().transpose(-1, -2)
    return logits.view(B, n_kv, H // n_kv, n, S)


PROBS_BYTES = 2**27  # a pass runs in parts whose attention probabilities take at most this (128 MB) per layer


def part_length(model: Transformer, keys: int) -> int:
    """Queries of a pass run at once: as many as keep their float32 probabilities over `keys` keys within
    PROBS_BYTES (a long document's 2K-token repeat in parts of ~400, never [heads, repeat, context] whole)."""
    return max(1, PROBS_BYTES // (4 * model.config.n_head * keys))


@torch.no_grad()
def prompt_attention_from(
    model: Transformer, layers: list[tuple[Tensor, Tensor]], passes: list[Pass], reduce: str
) -> list[Tensor]:
    """Per layer, [H_kv, T]: the attention one sequence's prompt keys (`layers`: each layer's [1, H_kv,
    T, D] keys and values) receive from the query tokens of each pass, placed right after the prompt, each pass
    run in parts (`part_length`). The model's caches are put back afterwards."""
    saved = [layer.attention.kv_cache for layer in model.layers]
    probes = [AttentionProbe(k, v, reduce) for k, v in layers]
    model.setup_caches(probes)
    try:
        n, device = layers[0][0].shape[2], layers[0][0].device
        for counted in passes:
            for probe in probes:
                probe.start(counted)
            part = part_length(model, n + len(counted.ids))
            for s in range(0, len(counted.ids), part):
                ids = counted.ids[s : s + part]
                # the attention is what counts, not the logits
                no_logits = torch.zeros(1, 1, dtype=torch.long, device=device)
                model(
                    torch.tensor([ids], device=device),
                    n + s + torch.arange(len(ids), device=device)[None],
                    logits_at=no_logits,
                )
    finally:
        model.setup_caches(saved)
    return [p.scores[0] for p in probes]

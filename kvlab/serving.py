"""Continuous batching over the paged KV-Compress cache: requests of different lengths and budgets
decode together in a fixed number of batch rows; a new request is admitted into a free row as soon as
the block pool can hold its prompt, so the number of sequences in flight is set by KV memory, not by a
fixed batch. This is where compression turns into throughput: a sequence compressed 4x leaves room for
about four times as many in the same pool (KV-Compress, Rehg 2024, reports up to 5.18x in vLLM).

Admission is conservative: the prompt (stored whole until the prefill compresses it) and a block per
head for the next token must be free now, and every sequence's reservation (its budget in blocks plus
a growing block per head) must fit the pool together. If the pool still runs out, the newest sequence
is preempted: its blocks are freed and it starts again later (greedy decoding regenerates the same
tokens)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.build import cache_slots, setup_caches
from kvlab.config import CacheSpec
from kvlab.engine import GREEDY, Sampling, decode_one_token, sample, sync
from kvlab.model import Transformer
from kvlab.paged import PagedKV
from kvlab.pool import PoolExhausted
from kvlab.strategies import CACHE_STRATEGIES


@dataclass
class ServeResult:
    tokens: list[list[int]]  # generated ids per request, up to (not including) a stop token
    finished: list[bool]  # True where a stop token ended the request
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    rows_in_flight: list[int]  # sequences decoding at each step
    preemptions: int
    peak_blocks: int  # most blocks in use at once (after each step's compression)
    pool_blocks: int
    block_bytes: int

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


@torch.no_grad()
def serve(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    max_batch: int,
    spec: CacheSpec,
    stop_ids: Sequence[int] = (),
    sampling: Sampling = GREEDY,
    decode_step: Callable[..., Tensor] = decode_one_token,
    max_seq_length: int | None = None,
    on_finish: Callable[[int, list[int]], None] | None = None,
) -> ServeResult:
    """Generate for every prompt with at most `max_batch` sequences decoding at once and a KV-Compress
    cache (`spec`: every layer kvcompress; its kvc_* options, kvc_pool_blocks the KV memory). The spec's
    cache length is each sequence's budget per layer and KV head: a slot count or a fraction of its own
    prompt + max_new_tokens. `on_finish(index, tokens)` is called as each request completes."""
    if not all(CACHE_STRATEGIES[s].shares_pool for s in spec.strategies) or len(set(spec.lengths)) != 1:
        raise ValueError(f"serving needs a paged cache (kvcompress) with one cache length on every layer; got {', '.join(dict.fromkeys(spec.strategies))}")
    cache_length = spec.lengths[0]
    temperature, top_k = sampling.temperature, sampling.top_k
    if max_new_tokens < 1 or max_batch < 1 or not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError(
            f"serve needs prompts of >= 1 token, max_new_tokens >= 1 and max_batch >= 1; got max_new_tokens={max_new_tokens}, max_batch={max_batch}"
        )
    cfg, device = model.config, model.tok_embeddings.weight.device
    longest = max(map(len, prompts)) + max_new_tokens
    max_seq_length = max_seq_length or longest
    if not longest <= max_seq_length <= cfg.block_size:
        raise ValueError(
            f"max_seq_length={max_seq_length} must lie between the longest prompt + max_new_tokens ({longest}) and the context length ({cfg.block_size})"
        )
    caches = setup_caches(model, spec, max_batch, [max_seq_length] * cfg.n_layer, max_seq_length)
    paged: PagedKV = caches[0].paged
    if paged.auto_pool:  # no kvc_pool_blocks: room for every row's sequence uncompressed
        paged.release_all()
        paged.pool.resize(paged.full_pool)
    heads, bs = cfg.n_layer * cfg.n_local_heads, paged.block_size

    def reservation(i: int) -> int:  # blocks a sequence holds once compressed plus a growing block per head, or its whole length
        own = len(prompts[i]) + max_new_tokens
        return min(cache_slots(cache_length, own) * heads // bs + heads, heads * -(-own // bs))

    queue, row_of = deque(range(len(prompts))), [-1] * max_batch  # request in each row
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stop = set(stop_ids)
    rows_in_flight, preemptions, peak = [], 0, 0
    prefill_seconds = decode_seconds = 0.0

    def finish(row: int, stopped: bool) -> None:
        i = row_of[row]
        finished[i] = stopped
        paged.release_row(row)
        row_of[row] = -1
        if on_finish is not None:
            on_finish(i, out[i])

    while queue or any(i >= 0 for i in row_of):
        while queue and -1 in row_of:  # admit
            i, running = queue[0], [j for j in row_of if j >= 0]
            prompt_blocks = heads * -(-(len(prompts[i]) + 1) // bs)  # the whole prompt until its prefill compresses it, and the next token
            if paged.pool.free_blocks() < prompt_blocks or sum(map(reservation, running)) + reservation(i) > paged.pool.n_blocks:
                if not running:
                    raise ValueError(
                        f"request {i} ({len(prompts[i])} prompt tokens) needs {max(prompt_blocks, reservation(i))} blocks; the pool has "
                        f"{paged.pool.n_blocks} (raise kvc_pool_blocks or compress more)"
                    )
                break
            queue.popleft()
            row = row_of.index(-1)
            row_of[row], out[i] = i, []
            t0 = time.perf_counter()
            paged.budget[row] = cache_slots(cache_length, len(prompts[i]) + max_new_tokens)
            paged.prefill_rows = torch.tensor([row], device=device)
            n = len(prompts[i])
            logits = model(
                torch.tensor([prompts[i]], device=device), torch.arange(n, device=device)[None], prefill=True, logits_at=torch.tensor([[n - 1]], device=device)
            )
            paged.prefill_rows = None
            first = int(sample(logits[:, -1], temperature, top_k))
            prefill_seconds += time.perf_counter() - t0
            if first in stop:
                finish(row, True)
            else:
                out[i].append(first)
                if max_new_tokens == 1:
                    finish(row, False)
        active = [row for row in range(max_batch) if row_of[row] >= 0]
        if not active:
            continue
        rows = min(max_batch, 1 << max(active).bit_length())  # run the first rows up to the highest busy one (a power of 2: few shapes)
        token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        input_pos = torch.full((rows, 1), -1, dtype=torch.long, device=device)
        for row in active:
            i = row_of[row]
            token[row, 0], input_pos[row, 0] = out[i][-1], len(prompts[i]) + len(out[i]) - 1
        t0 = time.perf_counter()
        next_token = decode_step(model, token, input_pos, temperature, top_k)
        try:
            paged.maintain()
        except PoolExhausted:
            while True:  # preempt the newest sequences until the others fit; they start again later
                newest = max(active, key=lambda row: row_of[row])
                queue.appendleft(row_of[newest])
                paged.release_row(newest)
                row_of[newest] = -1
                active.remove(newest)
                preemptions += 1
                try:
                    paged.make_room()
                    break
                except PoolExhausted:
                    continue
        sync(device)
        decode_seconds += time.perf_counter() - t0
        rows_in_flight.append(len(active))
        peak = max(peak, paged.blocks_in_use())
        for row, t in zip(active, next_token[active].tolist(), strict=True):
            i = row_of[row]
            if t in stop:
                finish(row, True)
                continue
            out[i].append(t)
            if len(out[i]) == max_new_tokens:
                finish(row, False)
    return ServeResult(
        out, finished, prefill_seconds, decode_seconds, len(rows_in_flight), rows_in_flight, preemptions, peak, paged.pool.n_blocks, paged.pool.block_bytes()
    )

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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvlab.build import setup_caches
from kvlab.config import CacheSpec
from kvlab.engine import decode_one_token, sync
from kvlab.model import Transformer
from kvlab.paged import PagedKV
from kvlab.pool import PoolExhausted
from kvlab.sampling import GREEDY, Sampling, sample
from kvlab.slot_counts import cache_slots
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


@dataclass
class Rows:
    """The state of one serve() call: the request each batch row decodes, what each request generated,
    and the pool that holds their KV."""

    model: Transformer
    prompts: Sequence[Sequence[int]]
    max_new_tokens: int
    max_batch: int
    paged: PagedKV
    cache_length: float
    sampling: Sampling
    stop: set[int]
    on_finish: Callable[[int, list[int]], None] | None
    queue: deque[int] = field(init=False)
    row_of: list[int] = field(init=False)  # request in each row, -1 where the row is free
    out: list[list[int]] = field(init=False)
    finished: list[bool] = field(init=False)
    rows_in_flight: list[int] = field(default_factory=list)
    preemptions: int = 0
    peak: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.queue = deque(range(len(self.prompts)))
        self.row_of = [-1] * self.max_batch
        self.out = [[] for _ in self.prompts]
        self.finished = [False] * len(self.prompts)
        cfg = self.model.config
        self.heads, self.device = cfg.n_layer * cfg.n_local_heads, self.model.tok_embeddings.weight.device

    def busy(self) -> bool:
        return bool(self.queue) or any(i >= 0 for i in self.row_of)

    def reservation(self, i: int) -> int:
        """Blocks request i holds once compressed plus a growing block per head, or its whole length."""
        own, bs = len(self.prompts[i]) + self.max_new_tokens, self.paged.block_size
        return min(cache_slots(self.cache_length, own) * self.heads // bs + self.heads, self.heads * -(-own // bs))

    def fits(self, i: int) -> bool:
        """Whether request i can start now: its whole prompt (until its prefill compresses it) and the next
        token are free, and every running request's reservation fits the pool with its own."""
        running = [j for j in self.row_of if j >= 0]
        prompt_blocks = self.heads * -(-(len(self.prompts[i]) + 1) // self.paged.block_size)
        pool = self.paged.pool
        if (
            pool.free_blocks() >= prompt_blocks
            and sum(map(self.reservation, running)) + self.reservation(i) <= pool.n_blocks
        ):
            return True
        if not running:
            raise ValueError(
                f"request {i} ({len(self.prompts[i])} prompt tokens) needs "
                f"{max(prompt_blocks, self.reservation(i))} blocks; the pool has {pool.n_blocks} (raise "
                "kvc_pool_blocks or compress more)"
            )
        return False

    def admit(self) -> None:
        """Start queued requests in free rows while the pool can hold them."""
        while self.queue and -1 in self.row_of and self.fits(self.queue[0]):
            self.prefill(self.queue.popleft(), self.row_of.index(-1))

    def prefill(self, i: int, row: int) -> None:
        """Prefill request i into `row` (the cache compresses it to the request's budget) and sample its first token."""
        t0, n, device = time.perf_counter(), len(self.prompts[i]), self.device
        self.row_of[row], self.out[i] = i, []
        self.paged.budget[row] = cache_slots(self.cache_length, n + self.max_new_tokens)
        self.paged.prefill_rows = torch.tensor([row], device=device)
        tokens, positions = torch.tensor([self.prompts[i]], device=device), torch.arange(n, device=device)[None]
        logits = self.model(tokens, positions, prefill=True, logits_at=torch.tensor([[n - 1]], device=device))
        self.paged.prefill_rows = None
        first = int(sample(logits[:, -1], self.sampling.temperature, self.sampling.top_k))
        self.prefill_seconds += time.perf_counter() - t0
        self.take(row, first)

    def decode(self, decode_step: Callable[..., Tensor]) -> None:
        """One decode step for every busy row: the first rows up to the highest busy one run (a power of 2: few
        shapes)."""
        active = [row for row, i in enumerate(self.row_of) if i >= 0]
        if not active:
            return
        rows = min(len(self.row_of), 1 << max(active).bit_length())
        token = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        input_pos = torch.full((rows, 1), -1, dtype=torch.long, device=self.device)
        for row in active:
            i = self.row_of[row]
            token[row, 0], input_pos[row, 0] = self.out[i][-1], len(self.prompts[i]) + len(self.out[i]) - 1
        t0 = time.perf_counter()
        next_token = decode_step(self.model, token, input_pos, self.sampling.temperature, self.sampling.top_k)
        try:
            self.paged.maintain()
        except PoolExhausted:
            self.preempt(active)
        sync(self.device)
        self.decode_seconds += time.perf_counter() - t0
        self.rows_in_flight.append(len(active))
        self.peak = max(self.peak, self.paged.blocks_in_use())
        for row, t in zip(active, next_token[active].tolist(), strict=True):
            self.take(row, t)

    def preempt(self, active: list[int]) -> None:
        """Free the newest sequences until the others fit the pool; they go back to the queue's front and
        start again later (greedy decoding regenerates the same tokens)."""
        while True:
            newest = max(active, key=lambda row: self.row_of[row])
            self.queue.appendleft(self.row_of[newest])
            self.paged.release_row(newest)
            self.row_of[newest] = -1
            active.remove(newest)
            self.preemptions += 1
            try:
                self.paged.make_room()
                return
            except PoolExhausted:
                continue

    def take(self, row: int, token: int) -> None:
        """Append a generated token to the row's request, or finish it on a stop token or at max_new_tokens."""
        i = self.row_of[row]
        if token in self.stop:
            self.finish(row, True)
            return
        self.out[i].append(token)
        if len(self.out[i]) == self.max_new_tokens:
            self.finish(row, False)

    def finish(self, row: int, stopped: bool) -> None:
        i = self.row_of[row]
        self.finished[i] = stopped
        self.paged.release_row(row)
        self.row_of[row] = -1
        if self.on_finish is not None:
            self.on_finish(i, self.out[i])

    def result(self) -> ServeResult:
        pool = self.paged.pool
        steps = len(self.rows_in_flight)
        return ServeResult(
            self.out,
            self.finished,
            self.prefill_seconds,
            self.decode_seconds,
            steps,
            self.rows_in_flight,
            self.preemptions,
            self.peak,
            pool.n_blocks,
            pool.block_bytes(),
        )


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
        raise ValueError(
            "serving needs a paged cache (kvcompress) with one cache length on every layer; got "
            f"{', '.join(dict.fromkeys(spec.strategies))}"
        )
    if max_new_tokens < 1 or max_batch < 1 or not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError(
            "serve needs prompts of >= 1 token, max_new_tokens >= 1 and max_batch >= 1; got "
            f"max_new_tokens={max_new_tokens}, max_batch={max_batch}"
        )
    longest, cfg = max(map(len, prompts)) + max_new_tokens, model.config
    max_seq_length = max_seq_length or longest
    if not longest <= max_seq_length <= cfg.block_size:
        raise ValueError(
            f"max_seq_length={max_seq_length} must lie between the longest prompt + max_new_tokens ({longest}) "
            f"and the context length ({cfg.block_size})"
        )
    caches = setup_caches(model, spec, max_batch, [max_seq_length] * cfg.n_layer, max_seq_length)
    paged: PagedKV = caches[0].paged
    if paged.auto_pool:  # no kvc_pool_blocks: room for every row's sequence uncompressed
        paged.release_all()
        paged.pool.resize(paged.full_pool)
    rows = Rows(model, prompts, max_new_tokens, max_batch, paged, spec.lengths[0], sampling, set(stop_ids), on_finish)
    while rows.busy():
        rows.admit()
        rows.decode(decode_step)
    return rows.result()

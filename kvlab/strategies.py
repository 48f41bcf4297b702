"""The registry: every cache strategy and prompt compressor by name. Evicting strategies are a score
each (scores.py) on the bases in eviction.py; the other families live in hybrid.py (FastGen),
recall.py (ClusterKV, Quest) and paged.py (KV-Compress)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.cache import FullCache, KVCache
from kvlab.clusterkv import ClusterKVCache
from kvlab.duo import DuoAttentionCache
from kvlab.eviction import EvictionCache
from kvlab.expected_attention import ExpectedAttention
from kvlab.hybrid import HybridCache
from kvlab.kvcompress import KVCompressCache
from kvlab.options import Option, integer
from kvlab.prompt_compression import RKV, AttentionScores, KeepAll, LagKV, PromptCompressor, SnapKV
from kvlab.quest import QuestCache
from kvlab.reconstruction import KVzip, Oracle
from kvlab.scored_caches import AttentionScoredCache, KeyScoredCache
from kvlab.scores import (
    attention_mass,
    chunk_attention,
    expected_logits,
    keydiff,
    l2_norm,
    lagkv,
    pool_keys,
    position_order,
    random_score,
    recency,
    rkv,
    unrotate,
    value_weighted,
    window_attention,
)


class WindowCache(KeyScoredCache):
    """Sliding window: keep the most recent tokens (Beltagy et al., Longformer, 2020)."""

    default_global_tokens = 0
    key_score = staticmethod(recency)


class RecentGlobalCache(WindowCache):
    """StreamingLLM: attention sinks (the first tokens) + the most recent tokens (Xiao et al., 2023)."""

    default_global_tokens = 4


class RandomCache(KeyScoredCache):
    """Evict a random unprotected token: the baseline every importance score must beat."""

    key_score = staticmethod(random_score)


class L2Cache(KeyScoredCache):
    """Keep keys with a low L2 norm, which draw high attention (Devoto et al., 2024)."""

    key_score = staticmethod(l2_norm)


class KeyDiffCache(KeyScoredCache):
    """KeyDiff (Park et al., 2025): keep the keys least similar to their head's mean key."""

    key_score = staticmethod(keydiff)


class HeavyHitterCache(AttentionScoredCache):
    """H2O: keep the tokens with the largest attention accumulated over all queries so far (Zhang et al., 2023).
    Scores are summed over the query heads sharing a KV head.

    Scissorhands options (Liu et al., 2023): `history_window` m counts only the last m decode steps (a ring
    of per-step contributions, so old attention is subtracted exactly; the prompt's scores stay as a
    prior), and `count_threshold` t counts the steps in which a token's attention reached t / (tokens
    held), i.e. t times uniform attention, instead of summing probabilities (t=1: "above average")."""

    options = (
        *AttentionScoredCache.options,
        integer(
            "history_window",
            None,
            "heavy_hitter (Scissorhands): count attention over the last N decode steps only",
            default_help="all steps",
        ),
        Option(
            "count_threshold",
            (int, float),
            "a number > 0",
            "heavy_hitter (Scissorhands): count the steps where a token's attention reaches this multiple of "
            "uniform attention, instead of summing it",
            check=lambda v: v > 0,
            default_help="sum",
        ),
    )

    def __init__(
        self, *args, history_window: int | None = None, count_threshold: float | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        if history_window is not None and history_window < 1 or count_threshold is not None and count_threshold <= 0:
            raise ValueError(
                f"heavy_hitter: history_window must be >= 1 and count_threshold > 0, got {history_window} and "
                f"{count_threshold}"
            )
        self.count_threshold = count_threshold
        self.history_window = history_window
        if history_window is not None:
            self.register_buffer(
                "history", torch.zeros(*self.pos.shape, history_window, device=self.pos.device), persistent=False
            )
            self.register_buffer("step", torch.zeros(1, dtype=torch.long, device=self.pos.device), persistent=False)

    def reset(self) -> None:
        super().reset()
        if self.history_window is not None:
            self.history.zero_()
            self.step.zero_()

    def observe(self, probs: Tensor) -> None:
        if self.count_threshold is None:
            contribution = attention_mass(probs)
        else:
            held = (self.pos >= 0).sum(dim=-1)[:, :, None, None, None]
            contribution = attention_mass(probs * held >= self.count_threshold).float()
        if self.history_window is not None:  # the ring's oldest step leaves the window
            column = self.step % self.history_window
            expired = self.history.index_select(3, column).squeeze(3)
            self.history.index_copy_(3, column, contribution[..., None])
            self.step += 1
            contribution = contribution - expired
        self.scores += contribution

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        super()._on_insert(slots, scores)
        if self.history_window is not None:
            self.history.scatter_(2, slots[..., None].expand(*slots.shape, self.history_window), 0.0)


class TOVACache(AttentionScoredCache):
    """TOVA: evict the token the current query attends to least, averaged over the layer's query heads, so
    every head keeps the same tokens (Oren et al., 2024; kvpress's TOVAPress)."""

    observed_queries = 1
    accumulate = False
    shared_heads = True


class TOVAPerHeadCache(TOVACache):
    """TOVA scored per KV head: the last query's attention summed over each KV head's query group, so each head
    keeps its own tokens (kvlab's variant, as H2O and SnapKV score GQA heads)."""

    shared_heads = False


class ExpectedAttentionCache(EvictionCache):
    """Expected Attention (Devoto et al., 2025, arXiv 2510.00636) at prefill and while decoding. At prefill the
    future queries' Gaussian is fitted as the `expected_attention` compressor fits it (with its settings when
    it is the prompt compressor) and kept, with the log-normaliser of its attention over the held keys; each
    key is scored once, as it enters (the held prompt keys at prefill), by its expected attention averaged
    over the query group, x ||v|| with value_weight norm (the default), so decoded keys are ranked exactly
    as the prompt's were. The Gaussian and its RoPE frame stay those of the prompt (kvpress's decoding mode
    refits them every 512 steps from buffered hidden states: refitting would re-score every held key)."""

    default_value_weight = "norm"
    fitted = ("q_mean", "q_cov", "frame_cos", "frame_sin", "log_norm")

    def __init__(self, *args, rope: tuple[Tensor, Tensor] | None = None, **kwargs) -> None:
        super().__init__(*args, rope=rope, **kwargs)
        own = self.prompt_compressor
        self.expected = own if isinstance(own, ExpectedAttention) else ExpectedAttention().with_rope(rope)
        self.register_buffer("scores", torch.zeros(self.pos.shape, device=self.pos.device), persistent=False)
        for name in self.fitted:  # sized at the first prefill, when the query group is known
            self.register_buffer(name, torch.zeros(0, device=self.pos.device), persistent=False)

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        return ExpectedAttention()

    def reset(self) -> None:
        super().reset()
        self.scores.zero_()

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> None:
        super().prefill(input_pos, k, v, q, lse)
        self._after_chunk(input_pos, q)

    def _after_chunk(self, input_pos: Tensor, q: Tensor) -> None:
        """Fit the Gaussian to the prompt's queries (a chunked prefill: to the latest chunk's) and score the held
        keys."""
        mean, cov, cos, sin = self.expected.fit(input_pos, q)
        logits = expected_logits(unrotate(self.storage.read()[0].float(), cos, sin), mean, cov)
        log_norm = logits.masked_fill(self.pos[:, :, None] < 0, float("-inf")).logsumexp(dim=-1).flatten(1)  # [B, H]
        # Per query head, with a 1 at dim 2: never mistaken for a slot axis (build.mark_slots_dynamic).
        for name, value in zip(
            self.fitted, (mean[:, :, None], cov[:, :, None], cos, sin, log_norm[:, :, None, None]), strict=True
        ):
            # later prompts refill the same buffers (CUDA graphs keep their addresses)
            if getattr(self, name).shape == value.shape:
                getattr(self, name).copy_(value)
            else:
                setattr(self, name, value)
        self.scores.copy_(self._expected_attention(*self.storage.read()))

    def _expected_attention(self, k: Tensor, v: Tensor) -> Tensor:
        """[B, H_kv, S] keys and values -> their expected attention under the prompt's Gaussian and normaliser."""
        logits = expected_logits(
            unrotate(k.float(), self.frame_cos, self.frame_sin), self.q_mean[:, :, 0], self.q_cov[:, :, 0]
        )
        scores = (logits - self.log_norm.view(*logits.shape[:3], 1)).exp().mean(dim=2)
        norms = self.value_norms(v)
        return scores if norms is None else value_weighted(scores, norms, self.value_epsilon)

    def _insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        EvictionCache._insert(self, input_pos, k, v)  # by name, not super(): see KVCache
        incoming = self._expected_attention(self._repeat(k), self._repeat(v))  # [B, H_kv, 1]
        self.scores.copy_(torch.where(self.pos == input_pos[:, :, None], incoming, self.scores))

    def _token_importances(self) -> Tensor:
        return self.scores


class LagKVCache(EvictionCache):
    """LagKV (Liang et al., 2025, arXiv 2504.04704) at prefill and while decoding: every step re-scores the held
    tokens, in position order, with the same `lagkv` score (the `lagkv` compressor's partition size when it
    is the prompt compressor), as KeyDiff re-scores its keys; the lowest unprotected token goes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        own = self.prompt_compressor
        self.lagkv = own if isinstance(own, LagKV) else LagKV()

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        return LagKV()

    def _token_importances(self) -> Tensor:
        return lagkv(*self.storage.read(), self.pos, self.lagkv.lag, self.lagkv.sinks)


class RKVCache(EvictionCache):
    """R-KV (Cai et al., 2025, arXiv 2505.24133), decode-time eviction for long generations. `recent` holds the
    attention each slot received from each of the last `rkv_window` queries (a ring, group-averaged), filled at
    prefill from the prompt's last queries and then by every decoded one (`observe`); each step the incoming
    token replaces the lowest `rkv` score: the mean of that attention, max-pooled along the held tokens in
    position order, against the redundancy of the key among its head's keys, with the `rkv` compressor's
    settings when it is the prompt compressor. The reference evicts in bursts (down to the budget every 128
    decoded tokens); here one token goes per step, so the S x S key similarities are recomputed each step."""

    needs_attention = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        own = self.prompt_compressor
        self.rkv = own if isinstance(own, RKV) else RKV()
        self.register_buffer(
            "recent", torch.zeros(*self.pos.shape, self.rkv.window, device=self.pos.device), persistent=False
        )
        self.register_buffer("step", torch.zeros(1, dtype=torch.long, device=self.pos.device), persistent=False)

    @classmethod
    def own_prompt_compressor(cls) -> PromptCompressor:
        return RKV()

    def reset(self) -> None:
        super().reset()
        self.recent.zero_()
        self.step.zero_()

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, lse: Tensor | None = None) -> None:
        super().prefill(input_pos, k, v, q, lse)
        # [B, H, T, w]
        per_query = window_attention(input_pos, self._repeat(k), q, self.rkv.window).mean(dim=2).transpose(-1, -2)
        held = (
            per_query.gather(2, self.pos.clamp(min=0)[..., None].expand(-1, -1, -1, per_query.shape[-1]))
            * (self.pos >= 0)[..., None]
        )
        self._remember(held)

    def _after_chunk(self, input_pos: Tensor, q: Tensor) -> None:
        """The ring holds the attention of the chunk's last queries over the tokens kept."""
        self._remember(
            chunk_attention(self.pos, self.storage.read()[0], input_pos, q, self.rkv.window)
            .mean(dim=2)
            .transpose(-1, -2)
        )

    def _remember(self, held: Tensor) -> None:
        """The ring starts from the prompt's last queries' attention to the held slots, [B, H, S, w] (fewer columns:
        fewer queries)."""
        self.recent.zero_()
        self.recent[..., : held.shape[-1]] = held  # fewer columns when the prompt is shorter than the window
        self.step.fill_(held.shape[-1])

    def observe(self, probs: Tensor) -> None:
        self.recent.index_copy_(3, self.step % self.rkv.window, probs.mean(dim=2).transpose(-1, -2))
        self.step += 1

    def _on_insert(self, slots: Tensor, scores: Tensor | None) -> None:
        self.recent.scatter_(2, slots[..., None].expand(*slots.shape, self.rkv.window), 0.0)

    def _token_importances(self) -> Tensor:
        order = position_order(self.pos)
        pooled = pool_keys((self.recent.sum(dim=-1) / self.rkv.window).gather(2, order), self.rkv.kernel)
        return rkv(torch.empty_like(pooled).scatter_(2, order, pooled), self.storage.read()[0], self.pos, self.rkv.mix)


CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "window": WindowCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "keydiff": KeyDiffCache,
    "heavy_hitter": HeavyHitterCache,
    "tova": TOVACache,
    "tova_per_head": TOVAPerHeadCache,
    "expected_attention": ExpectedAttentionCache,
    "lagkv": LagKVCache,
    "rkv": RKVCache,
    "hybrid": HybridCache,
    "clusterkv": ClusterKVCache,
    "quest": QuestCache,
    "kvcompress": KVCompressCache,
    "duo_attention": DuoAttentionCache,
}

# Every scored strategy's own score is also a prompt compressor of the same name.
PROMPT_COMPRESSORS: dict[str, PromptCompressor] = {
    "full": KeepAll(),
    **{
        name: cls.own_prompt_compressor()
        for name, cls in CACHE_STRATEGIES.items()
        if cls.takes_prompt_compressor and name != "window"  # window's is recent_global's
    },
    "heavy_hitter_mean": AttentionScores(per_query=True),
    "snapkv": SnapKV(),
    "kvzip": KVzip(),
    "oracle": Oracle(),
}
# option -> the compressor taking it
COMPRESSOR_OPTIONS = {o.name: name for name, c in PROMPT_COMPRESSORS.items() for o in c.options}


def make_prompt_compressor(name: str, **options) -> PromptCompressor:
    """A prompt compressor by name, with its options (flag names, e.g. snapkv_window=32)."""
    if name not in PROMPT_COMPRESSORS:
        raise ValueError(f"unknown prompt compression strategy {name!r}; choose from: {', '.join(PROMPT_COMPRESSORS)}")
    compressor = PROMPT_COMPRESSORS[name]
    foreign = sorted(set(options) - {o.name for o in compressor.options})
    if foreign:
        takes = (
            f"takes only {', '.join(o.name for o in compressor.options)}" if compressor.options else "takes no options"
        )
        raise ValueError(
            f"prompt compression strategy {name!r} {takes}; got {foreign} (they apply to "
            f"{', '.join({COMPRESSOR_OPTIONS[o] for o in foreign})})"
        )
    if not options:
        return compressor
    return type(compressor)(**{o.keyword: options[o.name] for o in compressor.options if o.name in options})

"""The registry: every cache strategy and prompt compressor by name. Evicting strategies are a score
each (scores.py) on the bases in cache.py; the other families live in hybrid.py (FastGen),
recall.py (ClusterKV, Quest) and paged.py (KV-Compress)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.cache import AttentionScoredCache, FullCache, KeyScoredCache, KVCache
from kvlab.hybrid import HybridCache
from kvlab.options import Option, integer
from kvlab.paged import KVCompressCache
from kvlab.prompt_compression import AttentionScores, KeepAll, PromptCompressor, SnapKV
from kvlab.recall import ClusterKVCache, QuestCache
from kvlab.scores import attention_mass, keydiff, l2_norm, random_score, recency


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
        integer("history_window", None, "heavy_hitter (Scissorhands): count attention over the last N decode steps only", default_help="all steps"),
        Option(
            "count_threshold",
            (int, float),
            "a number > 0",
            "heavy_hitter (Scissorhands): count the steps where a token's attention reaches this multiple of uniform attention, instead of summing it",
            check=lambda v: v > 0,
            default_help="sum",
        ),
    )

    def __init__(self, *args, history_window: int | None = None, count_threshold: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if history_window is not None and history_window < 1 or count_threshold is not None and count_threshold <= 0:
            raise ValueError(f"heavy_hitter: history_window must be >= 1 and count_threshold > 0, got {history_window} and {count_threshold}")
        self.count_threshold = count_threshold
        self.history_window = history_window
        if history_window is not None:
            self.register_buffer("history", torch.zeros(*self.pos.shape, history_window, device=self.pos.device), persistent=False)
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
    """TOVA: evict the token the current query attends to least (Oren et al., 2024)."""

    observed_queries = 1
    accumulate = False


CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "window": WindowCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "keydiff": KeyDiffCache,
    "heavy_hitter": HeavyHitterCache,
    "tova": TOVACache,
    "hybrid": HybridCache,
    "clusterkv": ClusterKVCache,
    "quest": QuestCache,
    "kvcompress": KVCompressCache,
}

# Every scored strategy's own score is also a prompt compressor of the same name.
PROMPT_COMPRESSORS: dict[str, PromptCompressor] = {
    "full": KeepAll(),
    **{
        name: cls.own_prompt_compressor()
        for name, cls in CACHE_STRATEGIES.items()
        if cls.takes_prompt_compressor and issubclass(cls, (KeyScoredCache, AttentionScoredCache)) and name != "window"  # window's is recent_global's
    },
    "heavy_hitter_mean": AttentionScores(per_query=True),
    "snapkv": SnapKV(),
}
COMPRESSOR_OPTIONS = {o.name: name for name, c in PROMPT_COMPRESSORS.items() for o in c.options}  # option -> the compressor taking it


def make_prompt_compressor(name: str, **options) -> PromptCompressor:
    """A prompt compressor by name, with its options (flag names, e.g. snapkv_window=32)."""
    if name not in PROMPT_COMPRESSORS:
        raise ValueError(f"unknown prompt compression strategy {name!r}; choose from: {', '.join(PROMPT_COMPRESSORS)}")
    compressor = PROMPT_COMPRESSORS[name]
    foreign = sorted(set(options) - {o.name for o in compressor.options})
    if foreign:
        takes = f"takes only {', '.join(o.name for o in compressor.options)}" if compressor.options else "takes no options"
        raise ValueError(f"prompt compression strategy {name!r} {takes}; got {foreign} (they apply to {', '.join({COMPRESSOR_OPTIONS[o] for o in foreign})})")
    if not options:
        return compressor
    return type(compressor)(**{o.keyword: options[o.name] for o in compressor.options if o.name in options})

"""Quest (Tang et al., 2024), a recallable cache (recall.py): pages of consecutive tokens scored by the largest q.k
any key inside each page's per-channel min/max box could give."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlab.options import integer
from kvlab.recall import RecallableCache


class QuestCache(RecallableCache):
    """Quest: pages of `page_size` consecutive tokens; a page's score for a query is the largest q . k
    any key inside the page's per-channel [min, max] box could give, sum over channels of
    max(q_d min_d, q_d max_d). Page bounds widen as tokens arrive; the unfinished page is attended whole
    (its tokens are the "recent" ones), like ClusterKV's unclustered tokens."""

    options = (*RecallableCache.options, integer("page_size", 16, "quest: tokens per page"))

    def __init__(self, *args, page_size: int = 16, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if page_size < 1:
            raise ValueError(f"quest: page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        B, H, S, D = self.storage.k.shape
        pages = math.ceil(S / page_size)
        self.register_buffer(
            "page_min", torch.full((B, H, pages, D), float("inf"), device=self.pos.device), persistent=False
        )
        self.register_buffer(
            "page_max", torch.full((B, H, pages, D), float("-inf"), device=self.pos.device), persistent=False
        )

    def _index_keys(self, positions: Tensor, k: Tensor) -> None:
        """Widen the bounds of the pages of keys k [B, H_kv, N, D] at positions [B, N] (-1: none)."""
        page = (positions.clamp(min=0) // self.page_size)[:, None, :, None].expand(k.shape)
        real = (positions >= 0)[:, None, :, None]
        self.page_min.scatter_reduce_(2, page, k.float().masked_fill(~real, float("inf")), "amin")
        self.page_max.scatter_reduce_(2, page, k.float().masked_fill(~real, float("-inf")), "amax")

    def _index_prompt(self, input_pos: Tensor, k: Tensor) -> None:
        self.page_min.fill_(float("inf"))
        self.page_max.fill_(float("-inf"))
        self._index_keys(input_pos, k)
        # the unfinished page is attended whole
        self.indexed_upto.copy_(self.indexed_upto // self.page_size * self.page_size)

    def _index_token(self, input_pos: Tensor, k: Tensor) -> None:
        self._index_keys(input_pos, k)
        self.indexed_upto.copy_((input_pos // self.page_size * self.page_size)[:, :, None])

    def _scores(self, q: Tensor) -> Tensor:
        B, H, _, D = q.shape
        n_kv = self.page_min.shape[1]
        query = q[:, :, -1].float().view(B, n_kv, H // n_kv, 1, D)
        # empty pages: infinite bounds
        low, high = (torch.where(b.isfinite(), b, 0.0)[:, :, None] for b in (self.page_min, self.page_max))
        per_page = self._per_selection_head(torch.maximum(query * low, query * high).sum(dim=-1))  # [B, H_sel, pages]
        return per_page.repeat_interleave(self.page_size, dim=-1)[..., : self.capacity]

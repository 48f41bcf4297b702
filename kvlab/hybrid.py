"""FastGen (Ge et al., 2024, "Model Tells You What to Discard"): a policy per KV head, profiled once per prompt."""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.cache import KVCache
from kvlab.eviction import PROTECTED_OPTIONS
from kvlab.options import fraction
from kvlab.scored_caches import AttentionScoredCache
from kvlab.scores import attention_mass, window_attention


class HybridCache(AttentionScoredCache):
    """FastGen (Ge et al., 2024, "Model Tells You What to Discard"): each KV head gets its own policy,
    chosen once per prompt: the cheapest of

        special  <  special+punct  <  special+punct+heavy  <  special+punct+heavy+window  <  full

    whose kept tokens receive at least `min_recovery_frac` of the attention of the prompt's last
    `profile_queries` queries. special = special tokens (and the sinks), punct = punctuation tokens,
    heavy = the `heavy_hitter_frac` of the sequence with the most accumulated attention, window = the
    newest `window_frac` of the sequence. During decoding every head drops what its policy no longer
    covers (the incoming token is always attended once), so heads differ in how many tokens they hold. Decoded
    tokens accumulate the attention they receive like H2O (AttentionScoredCache.observe), so "heavy"
    ranks prompt and decoded tokens alike.
    Buffers keep static shapes: a head's unused slots are empty, not freed (held tokens are reported)."""

    needs_tokens = True
    takes_prompt_compressor = False  # the policies choose the prompt tokens
    prefills_in_chunks = False  # its policies are chosen once, on the whole prompt
    default_recent_window = 1
    default_cache_length = 1.0  # the policies, not a length, set the compression
    policies = ("special", "special+punct", "special+punct+heavy", "special+punct+heavy+window", "full")
    profile_queries = 32
    options = (
        *KVCache.options,
        *PROTECTED_OPTIONS,
        fraction("min_recovery_frac", 0.9, "hybrid (FastGen): attention a head's policy must recover at prefill"),
        fraction("heavy_hitter_frac", 0.3, "hybrid: share of the sequence a heavy-hitter policy keeps"),
        fraction("window_frac", 0.3, "hybrid: share of the sequence a window policy keeps"),
    )

    def __init__(
        self,
        *args,
        min_recovery_frac: float = 0.9,
        heavy_hitter_frac: float = 0.3,
        window_frac: float = 0.3,
        special_ids: tuple[int, ...] = (),
        punctuation_ids: tuple[int, ...] = (),
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not all(0 < f <= 1 for f in (min_recovery_frac, heavy_hitter_frac, window_frac)):
            raise ValueError(
                "hybrid: min_recovery_frac, heavy_hitter_frac and window_frac must lie in (0, 1], got "
                f"{min_recovery_frac}, {heavy_hitter_frac}, {window_frac}"
            )
        self.min_recovery_frac, self.heavy_hitter_frac, self.window_frac = (
            min_recovery_frac,
            heavy_hitter_frac,
            window_frac,
        )
        device = self.pos.device
        self.register_buffer("special_ids", torch.tensor(special_ids or [-1], device=device), persistent=False)
        self.register_buffer("punctuation_ids", torch.tensor(punctuation_ids or [-1], device=device), persistent=False)
        self.register_buffer(
            "policy", torch.zeros(self.pos.shape[:2], dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer(
            "token_class", torch.zeros(self.pos.shape, dtype=torch.uint8, device=device), persistent=False
        )

    def _classes(self, tokens: Tensor) -> Tensor:
        """1 for special tokens, 2 for punctuation, 0 otherwise; [B, T] -> [B, 1, T]."""
        special, punct = torch.isin(tokens, self.special_ids), torch.isin(tokens, self.punctuation_ids)
        return torch.where(special, 1, torch.where(punct, 2, 0)).to(torch.uint8)[:, None, :]

    def _covered(self, policy: Tensor, pos: Tensor, classes: Tensor, scores: Tensor, n: Tensor) -> Tensor:
        """Which tokens a policy [B, H, 1] keeps among tokens at `pos` [B, H, S] (-1 = none), given their
        classes and accumulated attention `scores`, once the sequence has n [B, 1, 1] tokens."""
        filled = pos >= 0
        special = (classes == 1) | (pos < self.global_tokens)
        punct = (classes == 2) & (policy >= 1)
        window = (policy >= 3) & (pos >= n - (self.window_frac * n).floor())
        fixed = filled & (special | punct | window | (policy == len(self.policies) - 1))
        candidates = filled & ~fixed & (policy >= 2)
        rank = scores.float().masked_fill(~candidates, float("-inf")).argsort(dim=-1, descending=True).argsort(dim=-1)
        return fixed | (candidates & (rank < (self.heavy_hitter_frac * n).floor()))

    def _expire(self, n: Tensor) -> None:
        """Empty the slots the policy no longer covers at sequence length n [B, 1, 1]."""
        self.pos.masked_fill_(~self._covered(self.policy[..., None], self.pos, self.token_class, self.scores, n), -1)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, tokens: Tensor) -> None:
        B, H, T, _ = k.shape
        last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
        w = min(self.profile_queries, T)
        observed = (last - w + 1 + torch.arange(w, device=k.device)) >= 0  # rows shorter than w: fewer observed queries
        probs = window_attention(input_pos, k, q, self.profile_queries)  # [B, H_kv, group, w, T]
        scores = attention_mass(probs)
        pos, classes, n = input_pos[:, None, :].expand(B, H, T), self._classes(tokens), (last + 1)[:, :, None]
        policy = torch.full((B, H, 1), len(self.policies) - 1, device=k.device)
        for p in reversed(range(len(self.policies) - 1)):  # the cheapest policy that recovers enough attention wins
            kept = self._covered(torch.full_like(policy, p), pos, classes.expand(B, H, T), scores, n)
            recovered = (probs * kept[:, :, None, None, :]).sum(dim=(2, 3, 4)) / (
                probs.shape[2] * observed.sum(dim=-1, keepdim=True)
            )
            policy = torch.where(recovered[..., None] >= self.min_recovery_frac, p, policy)
        self.policy.copy_(policy[..., 0])
        covered = self._covered(policy, pos, classes.expand(B, H, T), scores, n)
        self._store_prompt(pos, k, v, scores.masked_fill(~covered, -1.0))  # covered tokens first
        self.token_class.copy_(classes.expand(B, H, T).gather(2, self.pos.clamp(min=0)))
        self._expire(n)

    def update(
        self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        self._expire(input_pos[:, :, None])
        keys, values, pos = AttentionScoredCache.update(self, input_pos, k, v, q)  # by name, not super(): see KVCache
        slot = (pos == input_pos[:, :, None]).to(torch.uint8).argmax(dim=-1, keepdim=True)
        self.token_class.scatter_(2, slot, self._classes(tokens).expand_as(slot))
        return keys, values, pos

    def stats(self) -> dict[str, int]:
        counts = torch.bincount(self.policy.flatten(), minlength=len(self.policies)).tolist()
        return {f"heads {name}": c for name, c in zip(self.policies, counts, strict=True)}

"""ClusterKV (Liu et al., 2024), a recallable cache (recall.py): per KV head, k-means over post-RoPE keys (cosine
distance); a step attends the clusters whose centroids score best against its query."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import parallel
from kvlab.options import integer
from kvlab.recall import RecallableCache


def cosine_kmeans(
    x: Tensor,
    valid: Tensor,
    k: int,
    iterations: int = 20,
    seed: int = 0,
    used: Tensor | None = None,
    first_row: int = 0,
) -> tuple[Tensor, Tensor]:
    """Batched k-means with cosine distance: x [..., N, D] points, valid [..., N] which points count,
    `used` [..., 1] how many of the k clusters each row uses (default all: rows of a batch may need fewer).
    Centroids start at k distinct valid points drawn pseudo-randomly from `seed` (a hash of each point's
    index and row, so a sequence clusters the same alone or in a batch; rows count from `first_row`, a
    rank's first KV head under tensor parallelism); each iteration assigns every
    point to its most cosine-similar centroid and moves each centroid to the mean of its members (an
    empty cluster keeps its centroid). Returns centroids [..., k, D] (means of the raw points, so q . c
    is the members' mean q . k) and labels [..., N] (-1 for invalid points), from a final assignment."""
    x = x.float()
    draw = _hash_uniform(valid.shape, seed, x.device, first_row).masked_fill(~valid, -1.0)
    start = draw.topk(k, dim=-1).indices  # k distinct points; rows with fewer valid points repeat invalid ones
    centroids = x.gather(-2, start[..., None].expand(*start.shape, x.shape[-1]))
    unit = F.normalize(x, dim=-1)
    usable = (
        torch.ones(k, dtype=torch.bool, device=x.device) if used is None else torch.arange(k, device=x.device) < used
    )
    for _ in range(iterations):
        labels = _assign(unit, centroids, valid, usable)
        members = F.one_hot(labels.clamp(min=0), k).to(x.dtype) * valid[..., None]  # [..., N, k]
        counts = members.sum(dim=-2)[..., None]  # [..., k, 1]
        means = members.transpose(-1, -2) @ x / counts.clamp(min=1)
        centroids = torch.where(counts > 0, means, centroids)
    return centroids, _assign(unit, centroids, valid, usable)


def _hash_uniform(shape: torch.Size, seed: int, device: torch.device, first_row: int = 0) -> Tensor:
    """Deterministic values in [0, 1) for each index of the last axis and each row of the second-to-last
    (heads, numbered from `first_row`), the same whatever the leading (batch) size."""
    point = torch.arange(shape[-1], device=device, dtype=torch.float64)
    row = (
        torch.arange(first_row, first_row + shape[-2], device=device, dtype=torch.float64)[:, None]
        if len(shape) > 1
        else 0.0
    )
    return (torch.sin(point * 12.9898 + row * 78.233 + seed * 37.719) * 43758.5453).frac().abs().float().expand(shape)


def _assign(unit: Tensor, centroids: Tensor, valid: Tensor, usable: Tensor) -> Tensor:
    similarity = unit @ F.normalize(centroids, dim=-1).transpose(-1, -2)  # [..., N, k]
    labels = similarity.masked_fill(~usable[..., None, :], float("-inf")).argmax(dim=-1)
    return labels.masked_fill(~valid, -1)


class ClusterKVCache(RecallableCache):
    """ClusterKV: tokens recalled by semantic cluster. The prompt (sinks excluded) is clustered into
    prompt_length / `tokens_per_cluster` clusters per KV head; every `cluster_every` decode steps the
    tokens decoded since are clustered into `new_clusters` more (`maintain`, between decode steps)."""

    options = (
        *RecallableCache.options,
        integer("tokens_per_cluster", 80, "clusterkv: prompt tokens per cluster, C0 = prompt / N clusters per KV head"),
        integer("cluster_every", 320, "clusterkv: cluster the decoded tokens every N steps"),
        integer("new_clusters", 8, "clusterkv: clusters made from each cluster_every decoded tokens"),
        integer("kmeans_iterations", 20, "clusterkv: k-means iterations", maximum=1000),
    )

    def __init__(
        self,
        *args,
        tokens_per_cluster: int = 80,
        cluster_every: int = 320,
        new_clusters: int = 8,
        kmeans_iterations: int = 20,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if min(tokens_per_cluster, cluster_every, new_clusters, kmeans_iterations) < 1:
            raise ValueError(
                f"clusterkv: tokens_per_cluster, cluster_every, new_clusters and kmeans_iterations must be >= 1; "
                f"got {tokens_per_cluster}, {cluster_every}, {new_clusters}, {kmeans_iterations}"
            )
        self.tokens_per_cluster, self.cluster_every, self.new_clusters, self.kmeans_iterations = (
            tokens_per_cluster,
            cluster_every,
            new_clusters,
            kmeans_iterations,
        )
        B, H, S, D = self.storage.k.shape
        most = math.ceil(S / tokens_per_cluster) + (S // cluster_every) * new_clusters
        self.register_buffer("centroids", torch.zeros(B, H, most, D, device=self.pos.device), persistent=False)
        self.register_buffer("labels", torch.zeros(B, H, S, dtype=torch.long, device=self.pos.device), persistent=False)
        self.n_clusters = 0  # host-side: cluster ids handed out so far (the same for every row)
        self.rounds = self.unclustered_steps = 0

    def _cluster(self, positions: Tensor, valid: Tensor, k: int, used: Tensor | None = None) -> None:
        """Cluster the keys at positions [B, N] (valid [B, N]) into k new clusters per KV head (N at most;
        `used` [B] of them per sequence)."""
        k = min(k, positions.shape[1])
        keys = self._history_keys(positions)
        valid = valid[:, None, :].expand(keys.shape[:3])
        used = None if used is None else used[:, None, None]
        centroids, labels = cosine_kmeans(
            keys, valid, k, self.kmeans_iterations, seed=self.rounds, used=used, first_row=parallel.first_head()
        )
        first = self.n_clusters
        self.centroids[:, :, first : first + k] = centroids
        self.labels.scatter_(2, positions[:, None, :].expand(labels.shape), torch.where(valid, labels + first, 0))
        self.n_clusters += k
        self.rounds += 1

    def _index_prompt(self, input_pos: Tensor, k: Tensor) -> None:
        self.n_clusters = self.rounds = self.unclustered_steps = 0
        self.labels.zero_()
        valid = input_pos >= self.sink_tokens
        points = valid.sum(dim=-1)
        # each sequence's own C0
        used = ((points + self.tokens_per_cluster - 1) // self.tokens_per_cluster).clamp(min=1)
        self._cluster(input_pos.clamp(min=0), valid, int(used.max()), used)

    def maintain(self) -> None:
        self.unclustered_steps += 1
        if self.unclustered_steps == self.cluster_every:
            positions = self.indexed_upto[:, 0] + torch.arange(self.cluster_every, device=self.pos.device)
            self._cluster(positions, torch.ones_like(positions, dtype=torch.bool), self.new_clusters)
            self.indexed_upto += self.cluster_every
            self.unclustered_steps = 0

    def _scores(self, q: Tensor) -> Tensor:
        B, H, _, D = q.shape
        n_kv = self.centroids.shape[1]
        per_cluster = self._per_selection_head(
            q[:, :, -1].float().view(B, n_kv, H // n_kv, D) @ self.centroids.transpose(-1, -2)
        )
        labels = self.labels.repeat_interleave(per_cluster.shape[1] // n_kv, dim=1)
        return per_cluster.gather(-1, labels)

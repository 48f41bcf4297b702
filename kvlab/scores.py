"""Every importance score, written once. A score is higher for a token worth keeping; the caches apply
the same function to the prompt (prefill) and to the running cache (decode), see `cache.py`.

    key scores        f(keys [B, H, S, D], positions [B, H, S]) -> [B, H, S], from the keys alone
    attention scores  attention probabilities [B, H_kv, group, t, S] of observed queries, summed
                      over the query group and the queries (`attention_mass`); which queries are
                      observed is the strategy's choice (all, the last one, a window of the last w)
    expected scores   `expected_logits`: the attention a Gaussian of future queries pays each key
    key/value scores  `lagkv`: keys and values against their neighbours', no queries
    score wrappers    `value_weighted`, `value_norms`, `two_stage` (CriticalKV), `chunk_mean` (ChunkKV): any
                      prompt score, transformed
    importance and redundancy  `rkv` (R-KV): pooled attention minus the keys' similarity to each other
    channel scores    `key_channels` (ThinK): which channels of a KV head's keys to store, [B, H_kv, D]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import parallel


def recency(k: Tensor, pos: Tensor) -> Tensor:
    """Newer tokens first: a sliding window (with sinks: StreamingLLM)."""
    return pos.float()


def random_score(k: Tensor, pos: Tensor) -> Tensor:
    """No information: the baseline every score must beat."""
    return torch.rand(pos.shape, device=pos.device)


def l2_norm(k: Tensor, pos: Tensor) -> Tensor:
    """Low-norm keys draw high attention (Devoto et al., 2024)."""
    return -k.float().norm(dim=-1)


def keydiff(k: Tensor, pos: Tensor) -> Tensor:
    """Keys least like the head's anchor, the mean of its unit-length keys, are the most distinctive (KeyDiff,
    Park et al., 2025; kvpress's KeyDiffPress)."""
    held = (pos >= 0)[..., None].float()
    anchor = (F.normalize(k.float(), dim=-1) * held).sum(dim=2, keepdim=True) / held.sum(dim=2, keepdim=True).clamp(
        min=1
    )
    return -F.cosine_similarity(k.float(), anchor, dim=-1)


def attention_mass(probs: Tensor) -> Tensor:
    """[B, H_kv, group, t, S] -> [B, H_kv, S]: the attention each key received, summed over the query
    heads of its group and the observed queries (H2O accumulates it, TOVA keeps the last query's)."""
    return probs.sum(dim=(2, 3))


def layer_attention_mass(probs: Tensor) -> Tensor:
    """[B, H_kv, group, t, S] -> [B, H_kv, S]: the attention each key received, averaged over every query head
    of the layer (on every rank under tensor parallelism) and summed over the observed queries, the same in each
    KV head (TOVA's paper and kvpress), so every head keeps the same tokens. The slots must hold the same position
    in every head."""
    B, H, group, _, S = probs.shape
    mean = parallel.sum_over_ranks(probs.sum(dim=(1, 2, 3))) / (parallel.all_heads(H) * group)
    return mean[:, None, :].expand(B, H, S)


def causal_softmax(q: Tensor, k: Tensor, key_pos: Tensor, query_pos: Tensor, masked_from: int = 0) -> Tensor:
    """Causal attention probabilities of queries q [B, H, t, D] over keys k [B, H_kv, T, D], [B, H_kv,
    group, t, T] in float32, every row finite: a padding query (position -1) attends to every real key,
    and dropping its row is the caller's (so no pass over the result to clear NaNs). Keys before column
    `masked_from` are the caller's promise: real and visible to every query, so only the rest is masked.
    One matmul with the query group folded into its rows, then masked and normalised in place: every pass
    over [t, T] is a large share of the cost."""
    B, H, t, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    scores = (q.reshape(B, n_kv, H // n_kv * t, D) * D**-0.5) @ k.transpose(-1, -2)
    scores = scores.float().view(B, n_kv, H // n_kv, t, T)
    keys, queries = key_pos[:, None, masked_from:], query_pos[:, :, None]
    hidden = (keys < 0) | ((keys > queries) & (queries >= 0))  # [B, t, T - masked_from]
    scores[..., masked_from:].masked_fill_(hidden[:, None, None], float("-inf"))
    return scores.softmax(dim=-1)


def merged_attention(y_a: Tensor, lse_a: Tensor, y_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention outputs [B, H, N, D] of the same queries over two sets of keys, with their log-sum-exps [B, H, N],
    merged into the one softmax over both sets: the output (float32) and its log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    return y_a * (lse_a - lse).exp()[..., None] + y_b * (lse_b - lse).exp()[..., None], lse


def prompt_attention(q: Tensor, k: Tensor, key_pos: Tensor, query_pos: Tensor, chunk: int = 512) -> Tensor:
    """Causal attention probabilities of prompt queries q [B, H, t, D] over prompt keys k [B, H_kv, T, D],
    as [B, H_kv, group, t, T]; padding (position -1) neither attends nor is attended. Computed in query
    chunks so the float32 scores never hold more than `chunk` rows at once."""
    rows = []
    for start in range(0, q.shape[2], chunk):
        qpos = query_pos[:, start : start + chunk]
        rows.append(
            causal_softmax(q[:, :, start : start + chunk], k, key_pos, qpos).mul_((qpos >= 0)[:, None, None, :, None])
        )
    return torch.cat(rows, dim=3)


def received_attention(
    q: Tensor,
    k: Tensor,
    input_pos: Tensor,
    per_chunk: Callable[[Tensor, Tensor], Tensor] | None = None,
    chunk: int = 128,
    lse: Tensor | None = None,
) -> Tensor:
    """What every prompt key receives from every prompt query, [B, H_kv, T]: `per_chunk(probs, query_pos)`
    ([B, H_kv, group, c, e] -> [B, H_kv, e]; default `attention_mass`) summed over chunks of `chunk`
    queries, so [T, T] probabilities never exist (H2O's prompt scores, KV-Compress's full metric). The
    chunk of queries ending at column e sees only the first e keys (prefill columns are positions), so
    only those are computed: about half the work of the whole matrix. The default sum is one batched
    matrix-vector product over each chunk's rows, weighted 0 for padding queries. Given `lse` [B, H, T],
    each query's log-sum-exp over the keys it sees (the prefill's flash attention returns it), the default
    sum skips the softmax (`received_from_lse`), for right-padded rows."""
    right_padded = bool(((input_pos[:, 1:] >= 0) <= (input_pos[:, :-1] >= 0)).all())
    if lse is not None and per_chunk is None and right_padded:
        return received_from_lse(q, k, input_pos, lse, chunk)
    total = torch.zeros(k.shape[:3], device=k.device)
    for start in range(0, k.shape[2], chunk):
        end = min(start + chunk, k.shape[2])
        query_pos = input_pos[:, start:end]
        if per_chunk is None:
            holes = bool((input_pos[:, :start] < 0).any())  # padding inside a row, not only at its end
            probs = causal_softmax(
                q[:, :, start:end], k[:, :, :end], input_pos[:, :end], query_pos, 0 if holes else start
            )
            real = (query_pos >= 0).to(probs.dtype)[:, None, None, None, :]  # [B, 1, 1, 1, c]
            total[..., :end] += (real @ probs).sum(dim=(2, 3))
        else:
            total[..., :end] += per_chunk(
                prompt_attention(q[:, :, start:end], k[:, :, :end], input_pos[:, :end], query_pos, chunk), query_pos
            )
    return total


def received_from_lse(q: Tensor, k: Tensor, input_pos: Tensor, lse: Tensor, chunk: int = 128) -> Tensor:
    """`received_attention` of right-padded rows from each query's log-sum-exp: a probability is
    exp(q.k / sqrt(d) - lse), so a chunk costs one matmul (the -lse rides in as an extra column of q
    against a column of ones in k) and one exp in place, with no max or normalising passes; padding
    queries get lse = +inf and so add nothing. In float32 whatever the model's dtype: the subtraction
    must not round."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    lse = torch.where(input_pos[:, None] >= 0, lse.float(), float("inf"))
    q = torch.cat([q.float() * D**-0.5, -lse[..., None]], dim=-1).view(B, n_kv, H // n_kv, T, D + 1)
    k = torch.cat([k.float(), torch.ones_like(k[..., :1], dtype=torch.float32)], dim=-1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    total = torch.zeros(k.shape[:3], device=k.device)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        c = end - start
        probs = (q[:, :, :, start:end].reshape(B, n_kv, -1, D + 1) @ k[:, :, :end].transpose(-1, -2)).exp_()
        probs.view(B, n_kv, -1, c, end)[..., start:].masked_fill_(future[:c, :c], 0.0)
        total[..., :end] += probs.sum(dim=2)
    return total


def window_attention(input_pos: Tensor, k: Tensor, q: Tensor, window: int | None) -> Tensor:
    """The prompt attention of each sequence's last `window` queries (every query for None), [B, H_kv,
    group, w, T]: the observation window of SnapKV, TOVA (w = 1), FastGen's profile and KV-Compress.
    A sequence shorter than the window observes fewer queries (the missing rows are zero)."""
    if window is None:
        return prompt_attention(q, k, input_pos, input_pos)
    w = min(window, k.shape[2])
    last = input_pos.max(dim=-1, keepdim=True).values  # [B, 1]
    query_pos = last - w + 1 + torch.arange(w, device=k.device)
    query_pos = torch.where(query_pos >= 0, query_pos, -1)  # right padding: a real token's column is its position
    q_obs = q.gather(2, query_pos.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
    return prompt_attention(q_obs, k, input_pos, query_pos)


def last_real_queries(query_pos: Tensor, w: int) -> tuple[Tensor, Tensor]:
    """The columns [B, w] of the last w real queries of right-padded query_pos [B, N], and their positions (-1 where a
    row has fewer): the queries `chunk_attention` observes, in its order."""
    columns = (query_pos >= 0).sum(dim=1, keepdim=True) - w + torch.arange(w, device=query_pos.device)
    return columns, torch.where(columns >= 0, query_pos.gather(1, columns.clamp(min=0)), -1)


def chunk_attention(key_pos: Tensor, k: Tensor, query_pos: Tensor, q: Tensor, window: int | None) -> Tensor:
    """The attention that a prefill chunk's last `window` real queries (every one for None), q [B, H, N, D] at
    positions query_pos [B, N] (right-padded with -1), pay to the held and chunk keys k [B, H_kv, S, D], whose
    positions key_pos [B, H_kv, S] (-1 empty) differ between heads: [B, H_kv, group, w, S], causal by position.
    Each KV head is computed as its own row, with its own positions; a row with fewer real queries than the
    window observes fewer (the missing rows are zero)."""
    B, H, N, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    w = N if window is None else min(window, N)
    columns, observed = last_real_queries(query_pos, w)
    q_obs = q.gather(2, columns.clamp(min=0)[:, None, :, None].expand(B, H, w, D))
    flat = prompt_attention(
        q_obs.reshape(B * n_kv, H // n_kv, w, D),
        k.reshape(B * n_kv, 1, S, D),
        key_pos.reshape(B * n_kv, S),
        observed.repeat_interleave(n_kv, dim=0),
    )
    return flat.view(B, n_kv, H // n_kv, w, S)


def pool_keys(scores: Tensor, kernel: int, kind: str = "max") -> Tensor:
    """Pool [B, H, T] scores along the keys (stride 1, same length), so neighbours of an important token
    score high too (SnapKV, KV-Compress)."""
    B, H, T = scores.shape
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    return pool(scores.reshape(B * H, 1, T), kernel, stride=1, padding=kernel // 2).view(B, H, T)


def unrotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R^T x for the rotate-half RoPE matrix R = diag(cos) + P diag(sin) of the model's `apply_rope`:
    undoes a rotation, and also applies the transpose of an average of rotations (Expected Attention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], -x[..., :half]], dim=-1) * sin


def query_statistics(x: Tensor, observed: Tensor) -> tuple[Tensor, Tensor]:
    """Mean [B, H, D] and covariance [B, H, D, D] (divided by n, as the reference) of queries x [B, H, T, D]
    over the observed columns [B, T]."""
    weight = observed[:, None, :, None].float()
    n = weight.sum(dim=2, keepdim=True).clamp(min=1)
    mean = (x * weight).sum(dim=2, keepdim=True) / n
    centred = (x - mean) * weight
    return mean[:, :, 0], centred.transpose(-1, -2) @ centred / n


def expected_logits(k: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    """log E[exp(q.k / sqrt(d))] for q ~ N(mean, cov), i.e. mu.k / sqrt(d) + k^T Sigma k / (2d) (Expected
    Attention, Devoto et al., 2025, arXiv 2510.00636): keys [B, H_kv, S, D] (in the queries' RoPE frame),
    a Gaussian per query head (mean [B, H, D], cov [B, H, D, D]) -> [B, H_kv, group, S]."""
    B, n_kv, S, D = k.shape
    mean, cov = mean.unflatten(1, (n_kv, -1)), cov.unflatten(1, (n_kv, -1))
    linear = torch.einsum("bhsd,bhgd->bhgs", k, mean) / D**0.5
    return linear + ((k[:, :, None] @ cov) * k[:, :, None]).sum(dim=-1) / (2 * D)


def value_weighted(scores: Tensor, norms: Tensor, epsilon: float) -> Tensor:
    """(scores + epsilon) x norms: a token moves the output by its attention times its value (CriticalKV, Feng
    et al., 2025, arXiv 2502.03805; Expected Attention's value rescaling), norms [B, H_kv, T] those of each
    token's value (`value_norms`). For non-negative, attention-like scores; protected (+inf) and padding
    (-inf) scores stay as they are."""
    return torch.where(scores.isinf(), scores, (scores + epsilon) * norms)


def value_norms(v: Tensor, output_weight: Tensor | None = None) -> Tensor:
    """[B, H_kv, T]: each value's L2 norm ||v||, or with the attention's output projection `output_weight`
    [dim, H x D] (this rank's heads), CriticalKV's ||W_o^h v||_1 averaged over each KV head's query group h
    (kvpress's CriticalKVPress). One query head at a time, so the memory is one [B, T, dim] product."""
    if output_weight is None:
        return v.float().norm(dim=-1)
    B, H_kv, T, D = v.shape
    heads = output_weight.shape[1] // D
    per_head = output_weight.float().view(-1, heads, D)  # [dim, H, D]
    norms = [(v[:, h // (heads // H_kv)].float() @ per_head[:, h].T).abs().sum(dim=-1) for h in range(heads)]
    return torch.stack(norms, dim=1).view(B, H_kv, heads // H_kv, T).mean(dim=2)


def two_stage(scores: Tensor, weighted: Tensor, first: Tensor) -> Tensor:
    """CriticalKV's two-stage selection: each head's `first` [B, H, 1] best `scores` [B, H, T] are kept before
    the rest are ranked by their `weighted` scores (their value-weighted form): those come first (+inf)."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return weighted.masked_fill(rank < first, float("inf"))


def position_order(pos: Tensor) -> Tensor:
    """The slots of positions pos [..., S] (-1 empty) in position order, the empty ones last: an argsort along S."""
    return torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)


def chunk_mean(scores: Tensor, pos: Tensor, size: int) -> Tensor:
    """ChunkKV (Liu et al., 2025, arXiv 2502.00299): every held token [B, H, S] gets the mean score of the held
    tokens in its chunk of `size` consecutive positions (position // size), so a top-k keeps whole chunks.
    Positions pos [B, S] or [B, H, S] ascending along each row, -1 (empty or padding, counting for nothing)
    only after the held ones: a prompt's columns, or the held and chunk tokens of a chunked prefill."""
    held = pos >= 0
    if pos.dim() == 2:
        held, pos = held[:, None], pos[:, None]
    bucket = torch.where(held, pos.div(size, rounding_mode="floor"), -1)
    # runs of one chunk
    segment = F.pad((bucket[..., 1:] != bucket[..., :-1]).long().cumsum(dim=-1), (1, 0)).expand(scores.shape)
    kept = torch.where(held, scores, 0.0)
    total = torch.zeros_like(kept).scatter_add_(-1, segment, kept)
    count = torch.zeros_like(kept).scatter_add_(-1, segment, held.expand(scores.shape).float()).clamp(min=1)
    return (total / count).gather(-1, segment)


def lagkv(k: Tensor, v: Tensor, pos: Tensor, lag: int, sinks: int) -> Tensor:
    """LagKV (Liang et al., 2025, arXiv 2504.04704): the held tokens in position order, after `sinks`, form
    partitions of `lag`; a token's keys and values are min-max normalised per channel by the range of the
    *next* partition, and its score is the standard deviation over channels, softmaxed over its partition,
    keys' and values' averaged. As the reference keeps the same share of every partition, a token scores
    its rank in its partition plus that score (in [0, lag]); the last complete partition and the rest
    (no successor: kept) score lag + recency in [0, 1), the sinks lag + 1. Any slot order: [B, H, S]."""
    B, H, S, D = k.shape
    order = position_order(pos)
    n_held = (pos >= 0).sum(dim=-1, keepdim=True)
    n = max(-(-(S - sinks) // lag), 1)  # partitions, the last one possibly partial
    rank = torch.arange(S, device=k.device)
    partition = (rank - sinks).div(lag, rounding_mode="floor")
    scored = (rank >= sinks) & (sinks + (partition + 2) * lag <= n_held)  # [B, H, S]: a complete successor

    def normalised_spread(x: Tensor) -> Tensor:
        x = x.float().gather(2, order[..., None].expand(B, H, S, D))[:, :, sinks:]
        x = F.pad(x, (0, 0, 0, n * lag - x.shape[2])).view(B, H, n, lag, D)
        low, high = x.amin(dim=3, keepdim=True), x.amax(dim=3, keepdim=True)
        low, high = F.pad(low[:, :, 1:], (0, 0, 0, 0, 0, 1)), F.pad(high[:, :, 1:], (0, 0, 0, 0, 0, 1))
        # eps: repeated tokens' values
        spread = ((x - low) / (high - low).clamp(min=torch.finfo(x.dtype).eps)).std(dim=-1).softmax(dim=-1)
        return F.pad(spread.flatten(2), (sinks, 0))[..., :S]

    score = (normalised_spread(k) + normalised_spread(v)) / 2
    within = score.masked_fill(~scored, 0.0)[:, :, sinks:]
    within = F.pad(within, (0, n * lag - within.shape[2])).view(B, H, n, lag).argsort(dim=-1).argsort(dim=-1)
    score = F.pad(within.flatten(2), (sinks, 0))[..., :S] + score
    kept = torch.where(rank < sinks, lag + 1.0, lag + rank / S)
    return torch.empty_like(score).scatter_(2, order, torch.where(scored, score, kept))


def rkv(importance: Tensor, k: Tensor, pos: Tensor, mix: float, threshold: float = 0.5) -> Tensor:
    """R-KV (Cai et al., 2025, arXiv 2505.24133): mix x importance - (1 - mix) x redundancy for held keys
    [B, H, S, D] (positions [B, H, S], -1 empty; any slot order), importance [B, H, S] the attention recent
    queries paid them. A key's redundancy is its mean cosine similarity to the other held keys of its head,
    softmaxed over them; as in the reference, each key's similarity to the newest other key it resembles (cosine
    > threshold) is left out of that look-alike's mean, so of near-duplicates the newest is least redundant."""
    held = pos >= 0
    unit = F.normalize(k.float(), dim=-1)
    others = held[..., :, None] & held[..., None, :] & ~torch.eye(k.shape[2], dtype=torch.bool, device=k.device)
    similarity = (unit @ unit.transpose(-1, -2)).masked_fill(~others, 0.0)  # [B, H, S (key i), S (key j)]
    similar = similarity > threshold
    newest = torch.where(similar, pos[..., None, :], -1).amax(dim=-1, keepdim=True)  # each key's newest look-alike
    similarity = similarity.masked_fill(similar & (pos[..., None, :] == newest), 0.0)
    mean = similarity.sum(dim=-2) / held.sum(dim=-1, keepdim=True).clamp(min=1)
    return mix * importance - (1 - mix) * mean.masked_fill(~held, float("-inf")).softmax(dim=-1)


def key_channels(input_pos: Tensor, k: Tensor, q: Tensor, window: int) -> Tensor:
    """ThinK (Xu et al., 2024, arXiv 2407.21018): the importance of each key channel c of a KV head, [B, H_kv, D],
    ||q[:, c]|| x ||k[:, c]||, the Frobenius norm of the channel's share q[:, c] k[:, c]^T of the attention
    logits, over the last `window` prompt queries of each query head of its group (summed) and every prompt
    key (padding, position -1, counts for nothing). Prompt queries q [B, H, T, D], keys k [B, H_kv, T, D]."""
    B, H, T, D = k.shape
    last = input_pos.max(dim=-1, keepdim=True).values
    observed = (input_pos > last - window) & (input_pos >= 0)
    query_norm = (q.float() * observed[:, None, :, None]).norm(dim=2).view(B, H, -1, D).sum(dim=2)
    return query_norm * (k.float() * (input_pos >= 0)[:, None, :, None]).norm(dim=2)

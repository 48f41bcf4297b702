"""Several processes on torch.distributed (launched by torchrun: gloo on CPU, NCCL on GPU).

Two uses: tensor parallelism (`shard_model`: every rank holds a slice of each layer's attention heads
and FFN columns, GPT-Fast style, with one all-reduce after attention and one after the FFN), and eval
sweeps whose jobs are shared out over the ranks (evaluate.py). Without torchrun every function here
is the single-process identity, so callers need no branches of their own.

KV heads are split as evenly as they divide (SmolLM2's 3 KV heads on 2 ranks: 2 + 1); a rank's query
heads are those of its KV heads. Decisions that rank KVs across heads (Ada-KV's split of a layer's
budget, KV-Compress's ranking of blocks over heads and layers) gather every head's scores with
`gather_heads`, decide as one process would, and keep their own heads' part (`local_heads`), so a
sharded run keeps exactly what a single process keeps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch import Tensor


@dataclass(frozen=True)
class HeadShard:
    """This rank's share of the KV heads under tensor parallelism."""

    rank: int
    sizes: tuple[int, ...]  # KV heads per rank

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]


_shard: HeadShard | None = None  # set by shard_model


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def launched() -> bool:
    """Started by torchrun (or any launcher that sets WORLD_SIZE) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device, timeout: timedelta = timedelta(minutes=30)) -> torch.device:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); returns this rank's
    device (cuda:LOCAL_RANK on a GPU). A no-op outside torchrun. `timeout` bounds every wait for the
    other ranks (a sweep's ranks wait for the slowest at its end: give those hours)."""
    if not launched() or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return device


def quiet_other_ranks() -> None:
    """Only rank 0 talks: every rank runs the same program and would print the same lines."""
    if rank() > 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # for the life of the process


def cpu_threads() -> int:
    """This process's share of the cores it may run on (Slurm's and taskset's limits included), split
    between the ranks torchrun started on this machine (it leaves each one thread by default)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def split(n: int, parts: int) -> tuple[int, ...]:
    """n items over `parts` ranks, the first ranks taking one more when it does not divide."""
    return tuple(n // parts + (r < n % parts) for r in range(parts))


def shard_model(model: nn.Module) -> None:
    """Keep this rank's slice of every layer (in place; on the meta device too, before loading a shard):
    its KV heads' q/k/v rows and output columns, an equal slice of the FFN's hidden units (`shard_slices`);
    embeddings, norms and the LM head stay whole. The outputs of attention and FFN are partial sums,
    all-reduced by forward hooks (traced by torch.compile)."""
    global _shard
    world = world_size()
    if world == 1:
        return
    cfg = model.config
    if cfg.n_local_heads < world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs at least {world} KV heads; the model has "
            f"{cfg.n_local_heads}: run fewer ranks"
        )
    _shard = HeadShard(rank(), split(cfg.n_local_heads, world))
    slices = shard_slices(cfg)
    for layer in model.layers:
        for name, (dim, ranges) in slices.items():
            module_name, attr = name.rsplit(".", 1)
            module = layer.get_submodule(module_name)
            if getattr(module, attr) is not None:
                setattr(module, attr, nn.Parameter(take(getattr(module, attr), dim, ranges), requires_grad=False))
        attention = layer.attention
        attention.n_head = attention.n_head * _shard.sizes[_shard.rank] // attention.n_local_heads
        attention.n_local_heads = _shard.sizes[_shard.rank]
        attention.register_forward_hook(_all_reduce_output)
        layer.feed_forward.register_forward_hook(_all_reduce_output)


def shard_slices(cfg: Any) -> dict[str, tuple[int, list[slice]]]:
    """For each sharded parameter of a layer (by its name in the layer): the axis it is cut along and the
    ranges this rank keeps, so a checkpoint reader can load only those (`take`)."""
    head_dim, group = cfg.head_dim, cfg.n_head // cfg.n_local_heads
    kv = slice(_shard.start * head_dim, _shard.stop * head_dim)
    q = slice(kv.start * group, kv.stop * group)
    q_rows, kv_rows = cfg.n_head * head_dim, cfg.n_local_heads * head_dim
    qkv = [
        q,
        slice(q_rows + kv.start, q_rows + kv.stop),
        slice(q_rows + kv_rows + kv.start, q_rows + kv_rows + kv.stop),
    ]
    hidden = split(cfg.intermediate_size, len(_shard.sizes))
    ffn = [slice(sum(hidden[: _shard.rank]), sum(hidden[: _shard.rank + 1]))]
    return {
        "attention.wqkv.weight": (0, qkv),
        "attention.wqkv.bias": (0, qkv),
        "attention.wo.weight": (1, [q]),
        "feed_forward.w1.weight": (0, ffn),
        "feed_forward.w3.weight": (0, ffn),
        "feed_forward.w2.weight": (1, ffn),
    }


def take(x: Any, dim: int, ranges: list[slice]) -> Tensor:
    """The `ranges` of `x` along `dim` (0 or 1), concatenated: `x` a tensor, or a safetensors slice, which
    reads only these ranges from the file."""
    parts = [x[r] if dim == 0 else x[:, r] for r in ranges]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)


def _all_reduce_output(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def _per_rank(local: int) -> tuple[int, ...]:
    """Entries per rank along a head axis holding `local` entries here (KV heads, or query heads: a
    whole number of entries per KV head)."""
    per_kv_head = local // _shard.sizes[_shard.rank]
    return tuple(n * per_kv_head for n in _shard.sizes)


def all_heads(local: int) -> int:
    """The length of a head axis over every rank, from this rank's `local` length."""
    return local if _shard is None else sum(_per_rank(local))


def sum_over_ranks(x: Tensor) -> Tensor:
    """`x` summed over the ranks (a sum over heads that each rank holds part of); `x` itself unsharded."""
    return x if _shard is None else funcol.all_reduce(x, "sum", dist.group.WORLD)


def gather_heads(x: Tensor, dim: int = 1) -> Tensor:
    """Every rank's heads of `x` (this rank's heads along `dim`), in head order; `x` itself unsharded."""
    if _shard is None:
        return x
    sizes = _per_rank(x.shape[dim])
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()  # all_gather takes equal shapes
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


def local_heads(x: Tensor, dim: int = 1) -> Tensor:
    """This rank's heads of an all-heads tensor (the inverse of `gather_heads`)."""
    if _shard is None:
        return x
    sizes = _per_rank(x.shape[dim] * _shard.sizes[_shard.rank] // sum(_shard.sizes))
    return x.narrow(dim, sum(sizes[: _shard.rank]), sizes[_shard.rank])


def first_head() -> int:
    """The global index of this rank's first KV head (0 unsharded)."""
    return 0 if _shard is None else _shard.start


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (so host-side branches stay in step)."""
    if _shard is None:
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def same_tokens(tokens: Tensor) -> Tensor:
    """Rank 0's sampled tokens on every rank: ranks may draw different random numbers (a random score
    sized by their own heads), and every rank must feed the same tokens."""
    if _shard is None:
        return tokens
    return funcol.broadcast(tokens, 0, dist.group.WORLD)

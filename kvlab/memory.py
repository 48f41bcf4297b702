"""Memory a size needs against what the device has free: refused before allocating, with the flag to lower
and the largest value that fits; and a process's own peak."""

from __future__ import annotations

import os

import torch


def free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on the device: the GPU's free memory, or Linux's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(flag: str, value: int, bytes_each: int, device: torch.device) -> None:
    """Refuse, before allocating, a size whose memory (value x bytes_each) is more than the device has free,
    naming the largest value that fits."""
    free = free_memory(device)
    if value * bytes_each > free:
        raise ValueError(
            f"{flag} {value} needs about {value * bytes_each / 2**30:.1f} GiB for its KV cache, more than the {free / 2**30:.1f} GiB free "
            f"here; lower it (at most {max(free // bytes_each, 1)} fits)"
        )


def high_water_bytes(pid: int | str = "self") -> int | None:
    """A live process's peak resident memory so far (Linux's VmHWM); None where it cannot be read (another OS, a
    process that has gone). Unlike ru_maxrss, which starts from the parent's resident memory when a large process
    launched it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None

"""What every kvlab command line shares: bad input is reported as one `error: ...` line and a
non-zero exit, never a traceback (set KVLAB_DEBUG=1 to get the traceback); device and dtype names."""

from __future__ import annotations

import argparse
import os
import resource
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from kvlab.checkpoint import CheckpointError
from kvlab.memory import high_water_bytes
from kvlab.model import ConfigError

USER_ERRORS = (CheckpointError, ConfigError, ValueError, FileNotFoundError)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line instead of usage + error."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def run_cli(
    fn: Callable[[argparse.Namespace], None], args: argparse.Namespace, interrupted: str = "interrupted (Ctrl-C)"
) -> None:
    """Run a command's body: a user error or Ctrl-C ends with one line (status 1, or 130 for SIGINT)."""
    try:
        fn(args)
    except (*USER_ERRORS, KeyboardInterrupt, MemoryError, RuntimeError) as e:
        if os.environ.get("KVLAB_DEBUG"):
            raise
        if isinstance(e, KeyboardInterrupt):
            exit_interrupted(interrupted)
        if out_of_memory(e):
            exit_with_error(
                f"error: out of memory ({str(e).splitlines()[0] if str(e) else type(e).__name__}); lower {MEMORY_FLAGS}"
            )
        if not isinstance(e, USER_ERRORS):  # any other RuntimeError is a bug: its traceback helps
            raise
        exit_with_error(f"error: {e}")


MEMORY_FLAGS = (
    "--batch_size, the cache's size (--max_cache_length, --kvc_pool_blocks) or the sizes given to the "
    "strategy's options"
)


def out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, torch's CPU allocator or CUDA running out."""
    return isinstance(e, MemoryError | torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def exit_interrupted(message: str) -> NoReturn:
    """Exit 130 after `message`. A tensor-parallel rank exits at once: stopped inside a collective, its process
    group's teardown would print c10d's warning about unwaited collectives after the line."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(130)
    exit_with_error(message, code=130)


def exit_with_error(message: str, code: int = 1) -> NoReturn:
    """Exit 1 after `message` as one line in one write: torchrun's ranks share stderr, and sys.exit(message)
    writes the newline apart, so two ranks' lines could run together. The SystemExit still carries the
    message for callers that catch it."""
    sys.stderr.write(message + "\n")
    stop = SystemExit(message)
    stop.code = code
    raise stop


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def resolve_device_dtype(device_name: str, dtype_name: str) -> tuple[torch.device, torch.dtype]:
    """`auto` means cuda when available (bfloat16 there), else cpu (float32)."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_name)
    except RuntimeError:
        raise ValueError(f"unknown device {device_name!r}; choose from: auto, cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device_name!r}; choose from: auto, cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA GPU is available")
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from: auto, {', '.join(DTYPES)}")
    return device, DTYPES[dtype_name]


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """The peak of what the run holds: GPU memory allocated, or the process's resident memory. On Linux the process's
    own high-water mark (VmHWM): ru_maxrss starts from the parent's resident memory when a large process launched
    this one."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU memory allocated"
    peak = high_water_bytes()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak), "process RSS"

"""kvlab: KV-cache compression for Llama-family LLMs, in plain PyTorch.

Data flow: config (YAML + flags) -> `config.CacheSpec` -> `build.build_caches` (one cache per layer,
layer budgets planned per prompt) -> `engine.generate`. The model is `model.py`; what a strategy is,
`cache.py` (evicting ones: `eviction.py`); each score, `scores.py`; the registry, `strategies.py`.
"""

import hashlib
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__version__ = "0.2.0"


# torch.compile's graphs persist between processes, so a second run skips most of the first compile:
# in $KVLAB_COMPILE_CACHE, else a TORCHINDUCTOR_CACHE_DIR the user set, else ~/.cache/kvlab/inductor.
# Set on import, before torch settles on its default (a temporary directory). kvlab's own directories hold
# one folder per version of the native kernels' sources: the generated code calls their ops by their
# schemas, and Inductor's cache key does not see a schema change.
def files_digest(paths: Iterable[Path], length: int) -> str:
    """A digest of files by their content, in path order, `length` hex digits."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in sorted(paths))).hexdigest()[:length]


def kernel_sources_digest() -> str:
    """A digest of the native kernels' sources (csrc/), by content: what their builds and the compiled
    graphs that call them are keyed by, whichever checkout they are in."""
    return files_digest((Path(__file__).parent / "kernels" / "csrc").glob("*"), 12)


if "KVLAB_COMPILE_CACHE" in os.environ or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _cache_root = (
        os.environ.get("KVLAB_COMPILE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab" / "inductor"
    )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(_cache_root) / f"kernels-{kernel_sources_digest()}")


def _exit_interrupted(signum: int, frame: object) -> None:
    sys.stderr.write("interrupted (Ctrl-C)\n")  # one write: torchrun's ranks share stderr
    os._exit(130)


@contextmanager
def interrupts_quietly() -> Iterator[None]:
    """Ctrl-C inside the block ends the process with one line and status 130, as `cli.run_cli` does once a command
    runs: a command's start-up (importing torch takes seconds) is wrapped in it, and it imports nothing heavy itself.
    The handler exits at once rather than raising KeyboardInterrupt, which an extension module's import (numpy's,
    inside torch's) can turn into an ImportError traceback."""
    previous = signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

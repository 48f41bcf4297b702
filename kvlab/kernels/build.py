"""Where the native kernels' library comes from: built once per machine, found by what it is built from.

A build is keyed by the sources' content, the compiler flags and torch's version (and Python's, whose ABI
the library links against), never by the checkout's path, so every checkout and worktree of the same
sources on one machine shares one build. A build runs in a scratch directory beside the cache and moves
into place when complete, under a lock file, so processes started together build once and the others wait
for it; a failed build leaves nothing behind. An unwritable cache directory falls back to a private one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kvlab import kernel_sources_digest

LIBRARY = "kvlab_kernels.so"
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def build_key() -> str:
    """The cache entry's name: torch's version and a digest of the sources, flags and Python version."""
    versions = repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2], sys.platform)).encode()
    digest = hashlib.sha256(kernel_sources_digest().encode() + versions).hexdigest()[:16]
    return f"torch-{torch.__version__}-{digest}"


def cache_root() -> Path:
    """KVLAB_KERNELS_DIR, else ~/.cache/kvlab/kernels (XDG_CACHE_HOME respected)."""
    if os.environ.get("KVLAB_KERNELS_DIR"):
        return Path(os.environ["KVLAB_KERNELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab" / "kernels"


def writable(root: Path) -> bool:
    """Whether `root` exists (made here if not) and this process may create files in it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK | os.X_OK)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the block: one builder at a time."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_library(sources: Sequence[Path], root: Path | None = None) -> Path:
    """Register the kernels' ops in this process from the cached library, building it first if no process
    has; returns the library's path."""
    root = cache_root() if root is None else root
    key = build_key()
    library = root / key / LIBRARY
    if not library.exists():
        if not writable(root):
            private = Path(tempfile.mkdtemp(prefix="kvlab-kernels-"))
            print(
                f"kvlab: the kernel cache {root} is not writable; building in {private} for this process",
                file=sys.stderr,
            )
            root, library = private, private / key / LIBRARY
        with locked(root / f"{key}.lock"):
            if not library.exists():
                build(sources, library)
                return library  # loaded by the build itself
    torch.ops.load_library(str(library))
    return library


def build(sources: Sequence[Path], library: Path) -> None:
    """Compile `sources` in a scratch directory beside `library`, load the result, and move it into place."""
    from torch.utils import cpp_extension

    print(
        f"kvlab: building the native kernels for this machine (once, about a minute) into {library.parent}",
        file=sys.stderr,
    )
    scratch = Path(tempfile.mkdtemp(prefix=f".{library.parent.name}-", dir=library.parent.parent))
    try:
        cpp_extension.load(
            LIBRARY.removesuffix(".so"),
            [str(s) for s in sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(scratch),
            is_python_module=False,
        )
        library.parent.mkdir(exist_ok=True)
        os.replace(scratch / LIBRARY, library)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

"""The native kernels' build: one per machine, keyed by the sources' content (not the checkout's path), built
aside and moved into place, once when processes start together, nothing left by a failed build, and a private
directory where the cache cannot be written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from kvlab.kernels import SOURCES
from kvlab.kernels import build as kernel_build

LOAD = "from kvlab import kernels; print(kernels.load(), kernels.__file__)"
BUILDING = "kvlab: building the native kernels"


def checkout(where: Path) -> Path:
    """A copy of kvlab's package at `where` (as a second clone or worktree holds it)."""
    shutil.copytree(ROOT / "kvlab", where / "kvlab", ignore=shutil.ignore_patterns("__pycache__"))
    return where


def start(code: str, tree: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "KVLAB_KERNELS_DIR": str(cache)}
    env.pop("KVLAB_KERNELS", None)
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, err


def test_the_build_key_follows_the_sources_not_the_checkout(tmp_path):
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    key = "from kvlab.kernels.build import build_key; print(build_key())"
    keys = [finish(start(key, tree, tmp_path / "cache"))[0] for tree in (a, b)]
    assert keys[0] == keys[1] == kernel_build.build_key() + "\n"
    with open(b / "kvlab" / "kernels" / "csrc" / "attention.cpp", "a") as f:
        f.write("// changed\n")
    assert finish(start(key, b, tmp_path / "cache"))[0] != keys[0]


@pytest.mark.slow
def test_two_checkouts_started_together_build_once_and_share_it(tmp_path):
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    cache = tmp_path / "cache"
    results = [finish(p) for p in [start(LOAD, a, cache), start(LOAD, b, cache)]]
    assert [out.split()[0] for out, _ in results] == ["True", "True"]
    assert [out.split()[1].startswith(str(tree)) for (out, _), tree in zip(results, (a, b), strict=True)] == [
        True,
        True,
    ]
    assert sum(err.count(BUILDING) for _, err in results) == 1
    assert sorted(p.name for p in cache.iterdir()) == [kernel_build.build_key(), kernel_build.build_key() + ".lock"]
    out, err = finish(start(LOAD, b, cache))  # a later process of either checkout loads the build as it is
    assert out.startswith("True") and BUILDING not in err


def test_an_unwritable_cache_builds_in_a_private_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a directory")
    built = []
    monkeypatch.setattr(kernel_build, "build", lambda sources, library: built.append(library))
    library = kernel_build.load_library(SOURCES, root=tmp_path / "file" / "kernels")
    assert built == [library] and not library.is_relative_to(tmp_path)
    assert library.parent.name == kernel_build.build_key() and library.name == kernel_build.LIBRARY
    unwritable, private = tmp_path / "file" / "kernels", library.parent.parent
    assert capsys.readouterr().err == (
        f"kvlab: the kernel cache {unwritable} is not writable; building in {private} for this process\n"
    )
    shutil.rmtree(library.parent.parent)


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    def fail(name, sources, build_directory, **kw):
        Path(build_directory, "half.o").write_text("")
        raise RuntimeError("Error building extension 'kvlab_kernels'")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(RuntimeError, match="Error building extension"):
        kernel_build.load_library(SOURCES, root=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [kernel_build.build_key() + ".lock"]

"""Compiled decode steps saved whole between processes: Dynamo's trace, its guards and Inductor's code in one file,
so that a later process loads the step in about a second instead of tracing it again (5-8 s for SmolLM2 on 2
cores), for every prompt length the step's dynamic slot axis serves.

    steps = SavedSteps(compile_cache_dir() / "steps" / step_key(spec, model.config), wrap)
    fn = steps.step_for(args, compile_step)   # a saved step whose guards pass, else compile_step()'s, saved

A saved step is valid where its guards pass and its key matches. Its guards check what Dynamo checks in the
process that compiled it (module types, tensor dtypes and static sizes, Python values the step read) but not object
identities or globals, which cannot be saved: the key covers those (kvlab's code, torch's version, the kernels, the
KVLAB_ environment, the cache spec, the model's architecture, the step's tensor arguments' shapes).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvlab import files_digest

# Dynamo's marks on a tensor's dimensions (maybe_mark_dynamic and the like)
MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
    "_has_dynamo_dim_marking",
)
MOST_SAVED = 8  # saved steps kept per key: beyond, the least recently used goes (each one tried costs its load)


@functools.cache
def python_sources_digest() -> str:
    """A digest of kvlab's Python sources, by content: a saved step is the code it traced."""
    return files_digest(Path(__file__).parent.rglob("*.py"), 16)


def step_key(*parts: object) -> str:
    """What a saved step is valid for beyond its guards: kvlab's code (its Python and native kernels, whose digest
    names the compile cache's folder), torch's version, the KVLAB_ environment (which kernels run, int4's x), and
    `parts` by their repr (the cache spec, the model's config, the step's argument shapes)."""
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("KVLAB_"))
    text = repr((python_sources_digest(), torch.__version__, environment, parts))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def tensors_in(args: tuple[Any, ...]) -> Iterator[torch.Tensor]:
    """The tensors a step's call reaches: its tensor arguments and its modules' parameters and buffers."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, torch.nn.Module):
            yield from a.parameters()
            yield from a.buffers()


@contextlib.contextmanager
def marks_hidden(args: tuple[Any, ...]) -> Iterator[None]:
    """The dimension marks of every tensor the call reaches, taken off inside the block and put back after. A saved
    step's guards were built on the fake tensors Dynamo traced, which carry no marks, so they refuse any marked
    tensor; the marks only steer a compile, which happens outside the block."""
    taken = []
    for t in tensors_in(args):
        marks = {name: getattr(t, name) for name in MARKS if hasattr(t, name)}
        if marks:
            taken.append((t, marks))
            for name in marks:
                delattr(t, name)
    try:
        yield
    finally:
        for t, marks in taken:
            for name, value in marks.items():
                setattr(t, name, value)


class SavedSteps:
    """The compiled steps saved under one key's directory, loaded on demand; one file each (a pickle of the
    step's own serialized form and its argument slots, `CompiledStep.compile_graph`'s replay map)."""

    def __init__(self, directory: Path, wrap: Callable[[Callable[..., Any], dict | None], Callable[..., Any]]) -> None:
        self.directory = directory
        self.wrap = wrap  # the graph -> the callable the step runs (CompiledStep records its calls for replay)
        self.loaded: list[Any] = []
        self.read: set[str] = set()

    def step_for(self, args: tuple[Any, ...], compile_step: Callable[[], Any]) -> Any:
        """A step whose guards pass for `args`: one loaded or compiled before in this process, else the newest saved
        one that does, else `compile_step()`'s, saved for later processes."""
        with marks_hidden(args):
            for fn in self.loaded:
                if fn.guard_check(*args):
                    return fn
            for path in self.unread():
                fn = self.load(path)
                if fn is not None and fn.guard_check(*args):
                    with contextlib.suppress(OSError):  # the most recently used are the last dropped
                        os.utime(path)
                    return fn
        fn = compile_step()
        fn.disable_guard_check()  # checked here, as the loaded ones are
        self.loaded.append(fn)
        self.save(fn)
        return fn

    def unread(self) -> list[Path]:
        """The saved files not read yet by this process, newest first."""
        if not self.directory.is_dir():
            return []
        files = [p for p in self.directory.glob("*.step") if p.name not in self.read]
        return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)

    def load(self, path: Path) -> Any:
        """A saved step, ready to call (its guards checked by `step_for`), or None with one line where it cannot be
        read (a file of another torch, cut short): it is compiled again then."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        self.read.add(path.name)
        try:
            saved = pickle.loads(path.read_bytes())
            fn = AOTCompiledFunction.deserialize(saved["step"])
        except Exception as e:  # whatever the cause, the step can still be compiled
            print(f"note: the saved compiled step {path} could not be read ({type(e).__name__}); compiling it again",
                  file=sys.stderr)  # fmt: skip
            return None
        artifacts = fn._artifacts
        graph = self.wrap(artifacts.compiled_fn, saved["arguments"])
        fn.fn = artifacts.runtime_env.forward_callable(artifacts.backend_id, graph, extra_globals=fn._extra_globals)
        fn.arguments = saved["arguments"]
        fn.disable_guard_check()  # step_for checks them, with the marks hidden
        self.loaded.append(fn)
        return fn

    def save(self, fn: Any) -> None:
        """`fn` written beside the others (whole or not at all), the oldest dropped beyond MOST_SAVED; one line and no
        file where the directory cannot be written."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        name = f"{uuid.uuid4().hex}.step"
        partial = self.directory / f".{name}.partial"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            data = pickle.dumps({"step": AOTCompiledFunction.serialize(fn).serialized_data, "arguments": fn.arguments})
            partial.write_bytes(data)
            os.replace(partial, self.directory / name)
        except OSError as e:
            with contextlib.suppress(OSError):  # nothing was written where the directory is not one
                partial.unlink(missing_ok=True)
            print(f"note: cannot save the compiled step in {self.directory} ({e.strerror}); later runs trace it again",
                  file=sys.stderr)  # fmt: skip
            return
        self.read.add(name)
        for old in sorted(self.directory.glob("*.step"), key=lambda p: p.stat().st_mtime)[:-MOST_SAVED]:
            old.unlink(missing_ok=True)

"""kvlab/saved_steps.py: a compiled step saved whole is loaded by a later step (another process in use) without
tracing, gives the same results, replays, serves another prompt length, and is compiled afresh where its guards or
its key do not hold, its file cannot be read, or its directory cannot be written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import spec_for
from kvlab import compiled
from kvlab.compiled import CompiledStep, compiled_step_options
from kvlab.engine import compile_decode_step, generate

CPU = torch.device("cpu")


class Toy(nn.Module):
    def __init__(self, rows: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4.0 * rows).reshape(rows, 4), requires_grad=False)
        self.register_buffer("total", torch.zeros(rows))


def accumulate(model: Toy, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A step that writes a buffer in place (as a cache write does) and returns a fresh tensor."""
    y = model.weight @ x * scale
    model.total.add_(y)
    return y + model.total


INPUTS = [(torch.randn(4, generator=torch.Generator().manual_seed(i)), torch.tensor(float(i + 1))) for i in range(4)]


def run_loop(step: CompiledStep, model: Toy) -> tuple[list[torch.Tensor], bool]:
    """The step over INPUTS in a replaying loop: its outputs, and whether the loop replayed its recorded graph."""
    with step.replaying() as call:
        outputs = [call(model, x, s) for x, s in INPUTS]
        replayed = step.recorded is not None and step.recorded.arguments is not None
    return outputs, replayed


def expected(rows: int = 3) -> list[torch.Tensor]:
    model = Toy(rows)
    return [accumulate(model, x, s) for x, s in INPUTS]


def saved_files(root) -> list:
    return sorted((root / "steps").rglob("*.step"))


def assert_outputs(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)  # float32 sums of 4 products, any order


@pytest.fixture
def step_dir(tmp_path, monkeypatch):
    """Saved steps (and Inductor's graphs) in a directory of the test's own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    return tmp_path


def test_a_saved_step_is_loaded_without_tracing_and_replays(step_dir):
    torch._dynamo.utils.counters.clear()
    first = CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy")
    got, replayed = run_loop(first, Toy())
    assert_outputs(got, expected())
    assert replayed and len(saved_files(step_dir)) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # traced once
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    second = CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy")
    got, replayed = run_loop(second, Toy())
    assert_outputs(got, expected())
    assert replayed and len(saved_files(step_dir)) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced


def test_failing_guards_and_another_key_compile_a_step_of_their_own(step_dir):
    run_loop(CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy"), Toy())
    torch._dynamo.reset()
    wider = CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy")
    got, _ = run_loop(wider, Toy(rows=5))  # the weight's shape fails the saved step's guards
    assert_outputs(got, expected(rows=5))
    assert len(saved_files(step_dir)) == 2
    other = CompiledStep(accumulate, compiled_step_options(CPU), saved_as="another spec")
    got, _ = run_loop(other, Toy())
    assert_outputs(got, expected())
    assert len(saved_files(step_dir)) == 3 and len({p.parent for p in saved_files(step_dir)}) == 2


def test_an_unreadable_file_or_directory_is_one_line_and_the_step_still_runs(step_dir, capsys, monkeypatch):
    run_loop(CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy"), Toy())
    (path,) = saved_files(step_dir)
    path.write_bytes(path.read_bytes()[:1000])  # cut short
    torch._dynamo.reset()
    got, _ = run_loop(CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy"), Toy())
    assert_outputs(got, expected())
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if line.startswith("note:")] == [
        f"note: the saved compiled step {path} could not be read (UnpicklingError); compiling it again"
    ]
    blocker = step_dir / "a file"
    blocker.write_text("")
    monkeypatch.setattr(compiled, "compile_cache_dir", lambda: blocker)  # steps/ cannot be made under a file
    torch._dynamo.reset()
    got, _ = run_loop(CompiledStep(accumulate, compiled_step_options(CPU), saved_as="toy"), Toy())
    assert_outputs(got, expected())
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(f"note: cannot save the compiled step in {blocker}")
    assert not list(step_dir.rglob("*.partial"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, length", [("full", None), ("tova", 0.5)])
def test_a_saved_decode_step_serves_another_prompt_length(tiny_model, step_dir, strategy, length):
    """generate with a saved step: the step serves two prompt lengths in the process that compiled it, and a second
    step object (as a later process has) loads it, traces nothing and gives eager's tokens for prompts of other
    lengths."""
    spec = spec_for(tiny_model, strategy, length, **({"recent_window": 4} if length else {}))
    g = torch.Generator().manual_seed(1)
    prompts = [[torch.randint(0, 64, (n,), generator=g).tolist()] for n in (40, 52, 67)]
    eager = [generate(tiny_model, p, 8, spec).tokens for p in prompts]
    first = compile_decode_step(CPU, saved_as=(strategy, spec))
    assert [generate(tiny_model, p, 8, spec, decode_step=first).tokens for p in prompts[:2]] == eager[:2]
    assert len(saved_files(step_dir)) == 1  # the step compiled here serves the second length too
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    second = compile_decode_step(CPU, saved_as=(strategy, spec))
    assert [generate(tiny_model, p, 8, spec, decode_step=second).tokens for p in prompts[1:]] == eager[1:]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert len(saved_files(step_dir)) == 1

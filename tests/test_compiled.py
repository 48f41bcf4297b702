"""kvlab/compiled.py: a decode loop calls Dynamo once and replays the compiled graph after that, with each
call's own arguments, and never replays what only Dynamo's code would get right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import spec_for
from kvlab.build import build_caches
from kvlab.compiled import CompiledStep, compiled_step_options
from kvlab.engine import compile_decode_step, decode_one_token, generate, replayed

CPU = torch.device("cpu")


class Counting(CompiledStep):
    """A compiled step that counts the calls that go through Dynamo."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dynamo_calls = 0

    def __call__(self, *args):
        self.dynamo_calls += 1
        return super().__call__(*args)


def test_a_decode_loop_goes_through_dynamo_once_and_replays_the_rest(tiny_model):
    """generate's decode loop: the first step through Dynamo, the other 11 replayed; eager's tokens, for a batch
    and for a second call with other prompts (which records afresh)."""
    batches = [[[1, 2, 3, 4, 5, 6], [7, 8, 9]], [[10, 11, 12], [13, 14, 15, 16, 17]]]
    eager = [generate(tiny_model, prompts, 12).tokens for prompts in batches]
    torch._dynamo.reset()
    step = Counting(decode_one_token, compiled_step_options(CPU))
    for i, prompts in enumerate(batches):
        assert generate(tiny_model, prompts, 12, decode_step=step).tokens == eager[i]
        assert step.dynamo_calls == i + 1
        assert step.recorded is None  # dropped after the loop: no cache kept alive


def test_one_graph_serves_every_max_new_tokens_and_replays(tiny_model):
    """The step's token is a column of the output buffer, whose row length is max_new_tokens: it is passed
    with standard strides, so another max_new_tokens neither recompiles nor leaves a graph that takes the
    stride as an input (which replay could not fill in)."""
    prompts = [[1, 2, 3, 4, 5, 6]]
    eager = {n: generate(tiny_model, prompts, n, max_seq_length=24).tokens for n in (4, 9)}
    torch._dynamo.reset()
    step = Counting(decode_one_token, compiled_step_options(CPU))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i, n in enumerate((4, 9)):
        assert generate(tiny_model, prompts, n, decode_step=step, max_seq_length=24).tokens == eager[n]
        assert step.dynamo_calls == i + 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_caches_upkept_between_steps_are_not_replayed(tiny_model):
    """ClusterKV clusters between steps (`maintain`), changing what the step reads: its loop goes through Dynamo
    every step (tests/test_recall.py checks its compiled tokens); a full cache's loop replays."""
    clustering = dict(sink_tokens=2, tokens_per_cluster=4, cluster_every=5, new_clusters=2)
    specs = {"full": spec_for(tiny_model, "full"), "clusterkv": spec_for(tiny_model, "clusterkv", 10, **clustering)}
    step = compile_decode_step(CPU)
    seen = {}
    for name, spec in specs.items():
        caches = build_caches(tiny_model, spec, [20], 8, 28)
        with replayed(step, caches) as call:
            seen[name] = (any(cache.upkept_between_steps for cache in caches), call is not step)
    assert seen == {"full": (False, True), "clusterkv": (True, False)}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(12.0).reshape(3, 4), requires_grad=False)
        self.register_buffer("total", torch.zeros(3))


def accumulate(model: Toy, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A step that mutates a buffer in place (as a cache write does) and returns a fresh tensor."""
    y = model.weight @ x * scale
    model.total.add_(y)
    return y + model.total


def rebind(model: Toy, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A step that rebinds a module attribute: a Python side effect that only Dynamo's code applies."""
    y = model.weight @ x * scale
    model.total = model.total + y
    return y


def test_replay_puts_each_calls_arguments_in_their_slots_and_keeps_in_place_writes():
    for step in (accumulate, rebind):
        eager_model, compiled_model = Toy(), Toy()
        inputs = [(torch.randn(4), torch.tensor(float(i + 1))) for i in range(5)]
        eager = [step(eager_model, x, s) for x, s in inputs]
        compiled = CompiledStep(step, compiled_step_options(CPU))
        with compiled.replaying() as call:
            got = [call(compiled_model, x, s) for x, s in inputs]
            replays = compiled.recorded is not None and compiled.recorded.arguments is not None
        assert replays == (step is accumulate)  # a rebinding graph returns the new tensor too: not replayable
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)  # float32 sums of 4 products, any order
        torch.testing.assert_close(compiled_model.total, eager_model.total, rtol=1e-6, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, length, settings",
    [("full", None, {}), ("tova", 0.5, {"recent_window": 4}), ("keydiff", 24, {"recent_window": 4, "cache_bits": 4})],
)
def test_one_graph_serves_every_prompt_length(tiny_model, strategy, length, settings):
    """Caches sized by each prompt (its length + max_new_tokens, the default) mark their slot axis dynamic: prompts
    of three lengths run one compiled graph, replayed, with eager's tokens."""
    spec = spec_for(tiny_model, strategy, length, **settings)
    g = torch.Generator().manual_seed(1)
    prompts = [[torch.randint(0, 64, (n,), generator=g).tolist()] for n in (40, 52, 67)]
    eager = [generate(tiny_model, p, 8, spec).tokens for p in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = Counting(decode_one_token, compiled_step_options(CPU))
    assert [generate(tiny_model, p, 8, spec, decode_step=step).tokens for p in prompts] == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 and step.dynamo_calls == 3

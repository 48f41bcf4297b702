"""Compiled decode steps: the Inductor settings of a step, where its graphs persist, steps saved whole for later
processes, and replay, which calls a step's compiled graph again without Dynamo's per-call work.

    step = CompiledStep(decode_one_token, compiled_step_options(device))
    with step.replaying() as call:  # in a decode loop: only the step's tensor arguments change
        for ...:
            token = call(model, token, input_pos, temperature, top_k)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvlab.saved_steps import SavedSteps, step_key


def compile_cache_dir() -> Path:
    """Where compiled graphs persist between processes (chosen when kvlab is imported: kvlab/__init__.py)."""
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compiled_step_options(device: torch.device) -> dict[str, Any]:
    """Inductor settings of the compiled decode step on `device` (bench/bench_decode_profile.py measures
    the alternatives). A GPU replays the step as a CUDA graph ("reduce-overhead"). A CPU step gets a C++
    wrapper: the ~5 native-op calls and ~3 fused kernels per layer are called from C++ rather than Python,
    0.2-0.45 ms of a 7 ms int4 step at 512 (4-5%). The wrapper's entry is compiled apart from its kernels, which
    keeps the first compile no slower than a Python wrapper's (a 30-layer step's entry at -O1 otherwise
    adds ~90 s). Inductor's size and stride checks on the graph's inputs are off: Dynamo's guards already
    check them, and at SmolLM2's size the 600 checks cost 0.5 ms of a 10 ms CPU step."""
    if device.type == "cuda":
        return {"size_asserts": False, "triton.cudagraphs": True}
    return {"size_asserts": False, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def trusted_vector_isa() -> dict[str, Any]:
    """Inductor's setting that takes the CPU's vector instructions from its flags instead of probing each one (a
    compile and a Python process per instruction set: 1.5 s of every process's first compiled step), where kvlab's
    native kernels were built and checked with this machine's compiler for them; else nothing."""
    from kvlab import kernels

    return {"cpp.vec_isa_ok": True} if kernels.NATIVE else {}


def patch_inductor(settings: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Inductor's config patched with `settings` inside the block."""
    import torch._inductor.config

    return torch._inductor.config.patch(settings)


def with_own_code(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`function` with a code object of its own. Dynamo keeps compiled graphs per code object and checks
    their guards in turn on every call, so a step compiled for one model would otherwise check the graphs
    of every other step compiled from the same function in the process (three int4 variants in one process:
    each ran 8-10% slower)."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


@dataclass
class GraphCall:
    """One call of a compiled graph: the graph, its inputs, and which of them are the step's own arguments
    (input slot -> the argument's position in the step's call); `arguments` is None when the graph cannot be
    called again without Dynamo (see `argument_slots`)."""

    graph: Callable[..., list[Tensor]]
    inputs: list[Any]
    arguments: dict[int, int] | None


def placeholder_source(node: torch.fx.Node) -> str:
    """The name of what a graph input is, as Dynamo's guards write it ("L['token']", "L['model']._modules[...]"):
    from the input's record where Dynamo keeps one; for a size under `aot_compile`, which keeps none, from the shape
    environment; else the input's name, Dynamo's spelling of the same ("L_token_")."""
    if "grapharg" in node.meta:
        return node.meta["grapharg"].source.name
    value = node.meta.get("example_value")
    if isinstance(value, torch.SymInt):
        sources = value.node.shape_env.var_to_sources.get(value.node.expr)
        if sources:
            return sources[0].name
    return str(node.target)


def argument_slots(gm: torch.fx.GraphModule, parameters: list[str]) -> dict[int, int] | None:
    """For a graph Dynamo captured from a step with these parameters: input slot -> position of the step
    argument it is; inputs under the first argument (the model: weights, buffers, their sizes) stay as recorded.
    None when the graph cannot be replayed: it returns more than the step's one tensor (the rest are Python
    side effects that only Dynamo's code applies), or an input derives from another argument (a size, a
    stride), which replay would not recompute."""
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    if not isinstance(outputs, tuple | list) or len(outputs) != 1:
        return None
    sources = [placeholder_source(node) for node in gm.graph.nodes if node.op == "placeholder"]
    direct = {f"L[{name!r}]": position for position, name in enumerate(parameters)}
    direct |= {f"L_{name}_": position for position, name in enumerate(parameters)}
    slots = {slot: direct[source] for slot, source in enumerate(sources) if source in direct}
    model = (f"L[{parameters[0]!r}]", f"L_{parameters[0]}_")
    derived = [
        s for s in sources if s not in direct and any(s.startswith(name) for name in direct) and not s.startswith(model)
    ]
    return None if derived else slots


class CompiledStep:
    """`step` compiled whole (fullgraph) by Inductor with `options`, its graphs persisting in
    `compile_cache_dir()`. A call goes through Dynamo: it checks the guards, gathers the graph's inputs
    (every parameter and buffer: 607 tensors for SmolLM2) from the module tree, and compiles again when a guard
    fails. Dynamo treats every module buffer as static-shape unless force_parameter_static_shapes is off;
    caches mark their slot axis dynamic (`build.mark_slots_dynamic`) so one compiled step serves every
    prompt length and plan. Guards skip the module trees whose attribute dicts are unchanged since the last call
    (recursive dict tags: a CPU decode step's guard check goes from 1.06 to 0.38 ms). Both settings apply to this
    step's calls only, not to the importing program. `replaying` skips the rest of that work in a decode loop.
    With `saved_as` (what the step is compiled for, part of its saved steps' key) a call takes a step saved whole by
    this or an earlier process whose guards pass, or compiles one with `aot_compile` and saves it
    (`saved_steps.py`): a later process loads it instead of tracing (2.5 s to SmolLM2's first step instead of 7.5)."""

    def __init__(self, step: Callable[..., Tensor], options: dict[str, Any], saved_as: object = None) -> None:
        self.options = options
        self.name = step.__name__
        self.parameters = list(inspect.signature(step).parameters)
        self.compiled = torch.compile(with_own_code(step), backend=self.compile_graph, fullgraph=True)
        self.recording = False
        self.recorded: GraphCall | None = None
        self.saved_as = saved_as
        self.saved: dict[tuple, SavedSteps] = {}  # by the tensor arguments' shapes and dtypes
        self.arguments: dict[int, int] | None = None

    def compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., list[Tensor]]:
        """Dynamo's backend: Inductor, with each call recorded while `recording` (and, for `saved_as`, the graph's
        own serialized form)."""
        from torch._inductor.compile_fx import compile_fx

        graph = compile_fx(gm, example_inputs, config_patches=self.options)
        self.arguments = argument_slots(gm, self.parameters)
        run = self.recorder(graph, self.arguments)
        run.serialize = getattr(graph, "serialize", None)
        return run

    def recorder(self, graph: Callable[..., list[Tensor]], arguments: dict[int, int] | None) -> Callable[..., Any]:
        """`graph`, recording each call while `recording`."""

        def run(*inputs: Any) -> list[Tensor]:
            if self.recording:
                self.recorded = GraphCall(graph, list(inputs), arguments)
            return graph(*inputs)

        return run

    def __call__(self, *args: Any) -> Tensor:
        with (
            torch._dynamo.config.patch(force_parameter_static_shapes=False, use_recursive_dict_tags_for_guards=True),
            patch_inductor(trusted_vector_isa()),  # Inductor picks the instructions when it compiles or loads a step
        ):
            if self.saved_as is None:
                return self.compiled(*args)
            return self.saved_step(args)(*args)

    def saved_step(self, args: tuple[Any, ...]) -> Callable[..., Tensor]:
        """The step saved for `saved_as` and these arguments' shapes whose guards pass (`saved_steps.py`), else one
        compiled now (`aot_compile`: Dynamo's trace with its guards, in a form a file holds) and saved."""
        shapes = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, Tensor))
        if shapes not in self.saved:
            key = step_key(self.saved_as, self.name, shapes)
            self.saved[shapes] = SavedSteps(compile_cache_dir() / "steps" / key, self.recorder)

        def compile_step() -> Any:
            fn = self.compiled.aot_compile((args, {}))
            fn.arguments = self.arguments
            return fn

        return self.saved[shapes].step_for(args, compile_step)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[Callable[..., Tensor]]:
        """The step for a loop in which only its tensor arguments change between calls: the model's
        parameters, buffers and Python state stay as they are, the other arguments too. Its first call goes
        through Dynamo (guards, compiling) and records the graph it ran and that graph's inputs; each later
        call runs that graph again on the recorded inputs with its own tensor arguments in their slots
        (an int4 SmolLM2 step at 512 tokens: 0.9 ms less Python of 7.5). The record is dropped on exit, so
        it keeps no cache alive."""
        self.recorded = None

        def call(*args: Any) -> Tensor:
            recorded = self.recorded
            if recorded is None or recorded.arguments is None:
                self.recording = True
                try:
                    return self(*args)
                finally:
                    self.recording = False
            for slot, position in recorded.arguments.items():
                recorded.inputs[slot] = args[position]
            return recorded.graph(*recorded.inputs)[0]

        try:
            yield call
        finally:
            self.recorded = None

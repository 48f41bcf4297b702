"""A sweep's plan: `Job`s (one task at one context length for one cache config and size), the cache spec each
runs with, and the settings (key) a run's results are kept under, refused when a resumed run's differ."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.cache import KVCache
from kvlab.cli import resolve_device_dtype
from kvlab.config import CacheSpec, cache_spec, check_value
from kvlab.config_files import config_path, load_cache_config
from kvlab.convert import default_checkpoint
from kvlab.results import FULL, RUNS, read_runs, write_runs
from kvlab.strategies import CACHE_STRATEGIES
from kvlab.tasks import GenerationTask, PerplexityTask
from kvlab.tokenizer import Tokenizer


@dataclass(frozen=True)
class Job:
    """One task at one context length for one (config, cache size): the unit of work and of resume."""

    config: str
    size: str  # "full", a fraction "0.25", a slot count "512" or a compression ratio "ratio0.5" (RATIO)
    task: str
    context_length: int
    prompt_tokens: int = 1  # perplexity tasks: tokens of each document prefilled as its prompt
    query_agnostic: bool = False  # the context is compressed before the question is seen (kvpress's default protocol)
    # prefill in chunks of N, compressing between them (chunked.py); None: as the config says
    prefill_chunk: int | None = None

    def config_dir(self, out_dir: Path, model_name: str) -> Path:
        """<out_dir>/<model>/<config>: the directory of the config's records.jsonl and runs.json (results.py)."""
        return out_dir / checked_model_name(model_name) / Path(self.config).stem

    def run(self) -> str:
        """The run's name, <size>, and <size>+query_agnostic for that protocol: the two never share results."""
        return (
            self.size
            + AGNOSTIC * self.query_agnostic
            + (f"{CHUNKED}{self.prefill_chunk}" if self.prefill_chunk else "")
        )

    def stem(self) -> str:
        """The job's name in its run: a prompt longer than one token makes it a different task (book+prompt512@2048)."""
        task = self.task if self.prompt_tokens == 1 else f"{self.task}+prompt{self.prompt_tokens}"
        return f"{task}@{self.context_length}"


RATIO = "ratio"  # a size "ratio0.5": kvpress's compression ratio, the share of the prefilled tokens removed
AGNOSTIC = "+query_agnostic"
# kvpress's protocols, by whether the context is compressed alone (before the question is seen)
PROTOCOLS = {"query_agnostic": True, "query_aware": False}
CHUNKED = "+prefill_chunk"  # a run's suffix, e.g. 0.5+prefill_chunk512

# What changes a run's results: a run holding results under another key is never resumed.
KEY_FIELDS = ("cache_config", "size", "model", "checkpoint", "dtype", "seed", "chat", "ppl_prompt_tokens")


def checked_model_name(name: Any) -> str:
    """The checkpoint config's name, which names a directory under --out_dir: one plain path component."""
    if not isinstance(name, str) or name in ("", ".", "..") or ".." in name or any(c in name for c in "/\\\0"):
        raise ValueError(
            f'checkpoint name {name!r} (config.json "name") must be a plain directory name: no path '
            "separators, no '..'"
        )
    return name


def checkpoint_dir(args: argparse.Namespace) -> Path:
    return Path(args.checkpoint_path or default_checkpoint()).resolve()


def run_key(job: Job, args: argparse.Namespace, model_name: str, checkpoint: Path) -> dict[str, Any]:
    """Everything that changes a run's results (stored in its config's runs.json)."""
    _, dtype = resolve_device_dtype(args.device, args.dtype)
    key = dict(
        cache_config=load_cache_config(job.config),
        size=job.size,
        model=model_name,
        checkpoint=checkpoint.name,  # the directory's name: committed records hold no machine's paths
        dtype=str(dtype).removeprefix("torch."),
        seed=args.seed,
        chat=not args.no_chat,
        ppl_prompt_tokens=args.ppl_prompt_tokens,
    )
    if job.query_agnostic:  # absent otherwise, so runs written before the protocol existed still resume
        key["query_agnostic"] = True
    if job.prefill_chunk:
        key["prefill_chunk"] = job.prefill_chunk
    return json.loads(json.dumps(key))  # as it reads back from runs.json


def check_key(config_dir: Path, run: str, key: dict[str, Any], records: dict[tuple[str, str], Any]) -> None:
    """Refuse a run whose settings in runs.json differ from `key` once it holds results (resuming it would mix
    results); `records`: the config's (`results.read_config_records`)."""
    saved = read_runs(config_dir).get(run, {}).get("args")
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise ValueError(
            f"{config_dir / RUNS}: run {run!r} has no settings object; remove the run from it, or choose "
            "another --out_dir"
        )
    if "key" in saved:
        old = saved["key"] if isinstance(saved["key"], dict) else {}
        fields = list(dict.fromkeys([*key, *old]))
    else:  # written before keys: compare the settings it recorded
        old, fields = saved, [k for k in KEY_FIELDS if k in saved]
    differ = [f"{k}: {old.get(k)!r} -> {key.get(k)!r}" for k in fields if old.get(k) != key.get(k)]
    # a run with no results yet (one that failed at once) is reused
    if differ and any(r == run and done for (r, _), done in records.items()):
        raise ValueError(
            f"{config_dir / run} holds results of other settings ({'; '.join(differ)}); choose another "
            f"--out_dir, or remove the run's records and its entry in {RUNS} to recompute"
        )


def write_run_args(config_dir: Path, job: Job, key: dict[str, Any], records: dict[tuple[str, str], Any]) -> None:
    """The run's settings into its config's runs.json, once checked against those it holds."""
    check_key(config_dir, job.run(), key, records)
    config_dir.mkdir(parents=True, exist_ok=True)
    runs = read_runs(config_dir)
    args = dict(
        config=job.config,
        cache_config=key["cache_config"],
        size=job.size,
        model=key["model"],
        seed=key["seed"],
        key=key,
    )
    runs[job.run()] = {**runs.get(job.run(), {}), "args": args}
    write_runs(config_dir, runs)


def parse_ratio(text: str) -> str:
    """A compression ratio as a size, "ratio0.5": checked like --compression_ratio."""
    try:
        check_value("compression_ratio", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a compression ratio is the share of the prompt removed, in [0, 1), got {text!r}"
        ) from None
    return f"{RATIO}{float(text):g}"


def parse_size(text: str) -> str:
    """A cache size (a fraction in (0, 1] or a slot count), checked like --max_cache_length, written one way
    (".5" and "0.50" are "0.5"): it names the run's directory."""
    try:
        size = check_value("max_cache_length", int(text) if text.isdigit() else float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a cache size is a slot count >= 1 or a fraction in (0, 1], got {text!r}"
        ) from None
    return str(size)


def jobs_for(
    configs: list[str],
    sizes: list[str] | None,
    tasks: list[GenerationTask | PerplexityTask],
    context_lengths: list[int],
    ppl_prompt_tokens: int = 1,
    query_agnostic: bool = False,
    prefill_chunk: int | None = None,
) -> list[Job]:
    """The full config runs once (it keeps every token, so both protocols are the same run); every other
    config once per size, or with None at its strategy's default size (0.5; 1.0 for duo_attention and
    hybrid, whose heads or policies set the compression)."""
    stems: dict[str, str] = {}
    for config in configs:
        stem = Path(config).stem
        if stem in stems:
            raise ValueError(
                f"--cache_config {stems[stem]!r} and {config!r} both write to {stem}/; give each config its own "
                "file name"
            )
        stems[stem] = config
    jobs = []
    for config in configs:
        strategy = load_cache_config(config).get("cache_strategy", FULL)
        # an unknown strategy: cache_spec names it later
        own = [str(float(CACHE_STRATEGIES.get(strategy, KVCache).default_cache_length))]
        for size in [FULL] if strategy == FULL else own if sizes is None else sizes:
            for task in tasks:
                prompt_tokens = ppl_prompt_tokens if isinstance(task, PerplexityTask) else 1
                agnostic = query_agnostic and strategy != FULL
                chunk = prefill_chunk if strategy != FULL else None
                jobs += [Job(config, size, task.name, ctx, prompt_tokens, agnostic, chunk) for ctx in context_lengths]
    return jobs


def job_spec(job: Job, n_layer: int, tokenizer: Tokenizer) -> CacheSpec:
    settings = load_cache_config(job.config)
    if job.size.startswith(RATIO):
        settings["compression_ratio"] = float(job.size.removeprefix(RATIO))
        settings.pop("max_cache_length", None)
        settings.pop("max_cache_length_pattern", None)
    elif job.size != FULL:
        settings["max_cache_length"] = int(job.size) if job.size.isdigit() else float(job.size)
        settings.pop("max_cache_length_pattern", None)
    settings["compress_first_token"] = True
    if job.prefill_chunk:
        settings["prefill_chunk"] = job.prefill_chunk
    return cache_spec(settings, n_layer, tokenizer, source=str(config_path(job.config)))

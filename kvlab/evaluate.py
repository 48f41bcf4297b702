"""The evaluation harness behind `eval.py`: a sweep of tasks x cache configs x cache sizes as `Job`s,
run by an `Evaluator` (one loaded model; generation tasks share each batch's prefill between configs),
in one process or in several launched by torchrun, each running its share of the batches. Every example
is decoded with compress_first_token, so even a one-token answer is computed from the compressed cache."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from kvlab import parallel
from kvlab.checkpoint import load_checkpoint, read_config
from kvlab.cli import USER_ERRORS, resolve_device_dtype
from kvlab.convert import default_checkpoint
from kvlab.engine import compile_decode_step, decode_one_token, generate
from kvlab.jobs import Job, check_key, checked_model_name, checkpoint_dir, job_spec, run_key, write_run_args
from kvlab.model import ModelArgs
from kvlab.perplexity import document_nll, rows_held, score_one_token
from kvlab.recording import RecordedPrefill
from kvlab.results import (
    append_record,
    locked_out_dir,
    rank_file,
    read_config_records,
    read_runs,
    rewrite_complete_lines,
    write_runs,
)
from kvlab.sweep_groups import Group, batch_width, summarize_job
from kvlab.tasks import GenerationTask, PerplexityTask, resolve_tasks
from kvlab.tasks.longbench import set_data_dir as set_longbench_dir
from kvlab.tasks.sizing import ContextTooShortError, minimum_context_length

SWEEP_TIMEOUT = timedelta(hours=48)  # ranks that finish early wait this long for the slowest


def open_out_dir(jobs: list[Job], args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """Rank 0's part before a sweep: check everything, then lock --out_dir for the sweep (held by `stack`).
    Returns the examples already done."""
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise ValueError(f"--out_dir {args.out_dir} is a file, not a directory; choose a directory")
    done = prepare_runs(jobs, args)
    stack.enter_context(locked_out_dir(args.out_dir))
    return done


def check_context_lengths(
    tasks: list[GenerationTask | PerplexityTask], context_lengths: list[int], ppl_prompt_tokens: int, model_context: int
) -> None:
    """Every --context_lengths value fits every task and the model (before anything is written)."""
    for ctx in context_lengths:
        if ctx > model_context:
            raise ValueError(f"--context_lengths {ctx} is over the model's context length of {model_context} tokens")
        for task in tasks:
            minimum = ppl_prompt_tokens + 1 if isinstance(task, PerplexityTask) else 1
            if ctx < minimum:
                raise ValueError(
                    f"--context_lengths {ctx} is below the {minimum} tokens {task.name} needs"
                    + (
                        f" (--ppl_prompt_tokens {ppl_prompt_tokens} plus one to predict)"
                        if isinstance(task, PerplexityTask)
                        else ""
                    )
                    + f"; valid: {minimum} to the model's context length of {model_context} tokens"
                )


def prepare_runs(jobs: list[Job], args: argparse.Namespace) -> int:
    """Check everything eval.py is about to do before it writes anything: the checkpoint's name, the
    context lengths, each run directory's key. Returns the examples already done (to be resumed)."""
    checkpoint = checkpoint_dir(args)
    config = read_config(checkpoint)
    model_name = checked_model_name(config.get("name"))
    check_context_lengths(
        resolve_tasks(args.tasks),
        args.context_lengths,
        args.ppl_prompt_tokens,
        ModelArgs.from_dict(config["model"]).block_size,
    )
    done, records = 0, {}
    for job in jobs:
        config_dir = job.config_dir(args.out_dir, model_name)
        records.setdefault(config_dir, read_config_records(config_dir))
        check_key(config_dir, job.run(), run_key(job, args, model_name, checkpoint), records[config_dir])
        done += len(records[config_dir].get((job.run(), job.stem()), {}))
    return done


T = TypeVar("T")


def on_rank0(fn: Callable[[], T]) -> T | None:
    """Run `fn` on rank 0 alone (the checks and writes one process must do) while the other ranks wait;
    its error is raised on every rank, so none waits for a sweep that will not start. Returns `fn`'s
    result on rank 0, None on the others."""

    def rank0_error(message: str | None) -> str | None:
        box = [message]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    if parallel.rank() == 0:
        try:
            result = fn()
        except USER_ERRORS as e:
            rank0_error(str(e))
            raise
        rank0_error(None)
        return result
    if (error := rank0_error(None)) is not None:
        raise ValueError(error)
    return None


class Evaluator:
    """A loaded model that runs jobs, one batch of a task's examples (for all its configs and sizes) at a
    time. `shard=(index, count)`: this evaluator runs batches index, index + count, ... of the sweep;
    under torchrun each rank passes (rank, world size). Every rank lists the same batches, the examples
    not yet done when the sweep starts, so a batch is run once whatever the number of ranks."""

    def __init__(
        self, args: argparse.Namespace, device_name: str, threads: int | None = None, shard: tuple[int, int] = (0, 1)
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        # one decode graph per cache config; the default 8 would fall back to eager
        torch._dynamo.config.cache_size_limit = 64
        device, dtype = resolve_device_dtype(device_name, args.dtype)
        self.args = args
        self.shard = shard
        # Several shards: each process appends to its own files; one shard run by every rank (tensor parallelism):
        # rank 0 alone.
        self.writes = shard[1] > 1 or parallel.rank() == 0
        tensor_parallel = args.tensor_parallel and parallel.launched()
        self.model, self.tokenizer, self.config = load_checkpoint(
            args.checkpoint_path or default_checkpoint(), device, dtype, tensor_parallel
        )
        self.tasks = {t.name: t for t in resolve_tasks(args.tasks)}
        if args.longbench_dir is not None:
            set_longbench_dir(args.longbench_dir)
        self.step = compile_decode_step(device) if args.compile else decode_one_token
        self.ppl_step = compile_decode_step(device, score_one_token) if args.compile else score_one_token

    def run(self, jobs: list[Job]) -> None:
        """Finish this evaluator's share of the jobs' missing examples; then rank 0 (re)writes each job's
        metrics over exactly the requested examples, from every rank's records."""
        by_task: dict[tuple[str, int], list[Job]] = defaultdict(list)
        for job in jobs:
            by_task[job.task, job.context_length].append(job)
        groups = [self.group(name, ctx, group) for (name, ctx), group in by_task.items()]
        lead = parallel.rank() == 0
        if lead:
            self.prepare([job for group in groups for job, _ in group.runs])
        parallel.barrier()  # the run directories exist, and every rank has read what was done, before any rank appends
        index, count = self.shard
        units = [(group, batch) for group in groups for batch in group.batches()]
        for group, batch in tqdm(units[index::count], desc="sweep", unit="batch", disable=not lead):
            if isinstance(group.task, PerplexityTask):
                self.score_documents(group, batch)
            else:
                self.generate(group, batch)
        parallel.barrier()  # every rank's records are on disk
        if lead:
            self.write_metrics(groups)

    def write_metrics(self, groups: list[Group]) -> None:
        """Each job's metrics over exactly the requested examples, from every rank's records, into its config's
        runs.json."""
        by_dir: dict[Path, list[tuple[Group, Job]]] = defaultdict(list)
        for group in groups:
            for job, _ in group.runs:
                by_dir[self.config_dir(job)].append((group, job))
        for config_dir, jobs in by_dir.items():
            records, runs = read_config_records(config_dir), read_runs(config_dir)
            for group, job in jobs:
                done = records[job.run(), job.stem()]
                runs[job.run()].setdefault("tasks", {})[job.stem()] = summarize_job(
                    group.task, [done[e.id] for e in group.examples]
                )
            write_runs(config_dir, runs)

    def config_dir(self, job: Job) -> Path:
        return job.config_dir(self.args.out_dir, self.config["name"])

    def group(self, name: str, ctx: int, jobs: list[Job]) -> Group:
        """A task's examples at one context length with its jobs' specs and records: built alike on every
        rank before any runs.json, so a bad setting fails on every rank and leaves nothing behind."""
        task = self.tasks[name]
        if isinstance(task, PerplexityTask):
            examples = task.documents(self.tokenizer, self.args.num_samples, ctx)
        else:
            try:
                examples = task.examples(
                    self.tokenizer, self.args.num_samples, self.args.seed, ctx, not self.args.no_chat
                )
            except ContextTooShortError:
                limit = self.model.config.block_size
                minimum = minimum_context_length(
                    task, self.tokenizer, self.args.num_samples, self.args.seed, not self.args.no_chat, ctx, limit
                )
                if minimum is None:
                    raise ValueError(
                        f"--context_lengths {ctx} is too short for {name}, and so is the model's context length "
                        f"of {limit} tokens"
                    ) from None
                raise ValueError(
                    f"--context_lengths {ctx} is below the {minimum} tokens {name} needs (prompt and answer); "
                    f"valid: {minimum} to the model's context length of {limit} tokens"
                ) from None
        runs = []
        for job in jobs:
            if job.query_agnostic and any(e.question_start is None for e in examples):
                raise ValueError(
                    f"--query_agnostic compresses the context before the question, but {name} has no "
                    "context/question split (RULER tasks have)"
                )
            spec = job_spec(job, self.model.config.n_layer, self.tokenizer)
            if isinstance(task, PerplexityTask) and spec.prefill_chunk:
                raise ValueError(
                    f"{job.config}: {task.name} prefills {job.prompt_tokens} prompt token(s) and decodes the "
                    "rest token by token, so --prefill_chunk has nothing to chunk; to stream a book through "
                    "chunks use kvlab.chunked.stream_losses (bench/bench_streaming.py)"
                )
            if isinstance(task, PerplexityTask) and spec.layer_budget != "uniform" and job.prompt_tokens == 1:
                raise ValueError(
                    f"{job.config}: --layer_budget {spec.layer_budget} plans from the prompt at prefill, but "
                    f"{task.name} decodes its documents from a one-token prompt; give the documents a prompt "
                    "with --ppl_prompt_tokens N"
                )
            runs.append((job, spec))
        config_dirs = {self.config_dir(job) for job, _ in runs}
        if self.writes:  # a torn last line of this process's own files goes before it appends
            for config_dir in config_dirs:
                rewrite_complete_lines(rank_file(config_dir, *self.shard))
        records = {d: read_config_records(d) for d in config_dirs}
        return Group(
            task,
            examples,
            runs,
            {job: dict(records[self.config_dir(job)].get((job.run(), job.stem()), {})) for job, _ in runs},
            batch_width(self.args.batch_size, len(examples), self.shard[1]),
        )

    def prepare(self, jobs: list[Job]) -> None:
        """Each job's config directory with its run's settings in the runs.json (each config's records read once)."""
        records: dict[Path, dict] = {}
        for job in jobs:
            config_dir = self.config_dir(job)
            records.setdefault(config_dir, read_config_records(config_dir))
            write_run_args(
                config_dir,
                job,
                run_key(job, self.args, self.config["name"], checkpoint_dir(self.args)),
                records[config_dir],
            )

    def keep(self, group: Group, job: Job, record: dict[str, Any]) -> None:
        """A finished example: appended to this process's records file of the job's config, and done."""
        if self.writes:
            append_record(rank_file(self.config_dir(job), *self.shard), {"run": job.run(), "job": job.stem(), **record})
        group.done[job][record["id"]] = record

    def generate(self, group: Group, batch: list[Any]) -> None:
        """Decode a batch of a generation task's examples for every run still missing one of them, from
        one prefill shared by all."""
        task, args = group.task, self.args
        max_new = max(e.max_new_tokens for e in group.examples)
        # Fixed for the task, so nothing recompiles between batches: the longest context + the longest question (decoded
        # one token at a time, query-agnostic; else the last prompt token) + the answer.
        agnostic = any(job.query_agnostic for job, _ in group.runs)
        contexts = [e.question_start if agnostic else len(e.input_ids) - 1 for e in group.examples]
        questions = [len(e.input_ids) - c for e, c in zip(group.examples, contexts, strict=True)]
        max_seq_length = min(max(contexts) + max(questions) + max_new, self.model.config.block_size)
        padded = group.padded(batch)
        # one prefill per protocol: the whole prompt, or the context alone
        shared = {False: RecordedPrefill(), True: RecordedPrefill()}
        for job, spec in group.pending(batch):
            t0 = time.perf_counter()
            result = generate(
                self.model,
                [e.input_ids for e in padded],
                max_new,
                dataclasses.replace(spec, compress_first_token=True),
                stop_ids=self.tokenizer.stop_ids,
                decode_step=self.step,
                max_seq_length=max_seq_length,
                recorded=shared[job.query_agnostic],
                attention_loss=args.attention_metrics,
                decoded_prompt_tokens=[len(e.input_ids) - e.question_start for e in padded]
                if job.query_agnostic
                else None,
                reference_answers=[self.tokenizer.encode(" " + ", ".join(e.answers)) for e in padded],
            )
            seconds = (time.perf_counter() - t0) / len(batch)
            held = rows_held(self.model).tolist()
            for i, example in enumerate(batch):
                if example.id in group.done[job]:
                    continue
                prediction = self.tokenizer.decode(result.tokens[i][: example.max_new_tokens])
                record = dict(
                    id=example.id,
                    score=task.score(prediction, example),
                    **task.extra_scores(prediction, example),
                    prediction=prediction,
                    answers=example.answers,
                    prompt_tokens=len(example.input_ids),
                    compression=(len(example.input_ids) + result.decode_steps) / held[i],
                    seconds=round(seconds, 3),
                )
                if result.attention_loss is not None:
                    record |= dict(
                        attention_loss=result.attention_loss["per_sequence"][i],
                        topb_recall=result.attention_loss["recall_per_sequence"][i],
                    )
                self.keep(group, job, record)

    def score_documents(self, group: Group, batch: list[Any]) -> None:
        """Score a batch of a perplexity task's documents for every run still missing one of them."""
        padded = group.padded(batch)
        for job, spec in group.pending(batch):
            t0 = time.perf_counter()
            losses, held = document_nll(
                self.model, [d.input_ids for d in padded], spec, self.ppl_step, job.prompt_tokens
            )
            seconds = (time.perf_counter() - t0) / len(batch)
            for i, doc in enumerate(batch):
                if doc.id in group.done[job]:
                    continue
                nll = losses[i].tolist()
                record = dict(
                    id=doc.id,
                    nll_sum=sum(nll),
                    tokens=len(nll),
                    perplexity=math.exp(sum(nll) / len(nll)),
                    checkpoints={str(c): math.exp(sum(nll[:c]) / c) for c in doc.checkpoints},
                    compression=len(doc.input_ids) / float(held[i]),
                    seconds=round(seconds, 3),
                )
                self.keep(group, job, record)

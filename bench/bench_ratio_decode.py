"""What a leaderboard batch costs with and without the eviction score under a compression ratio.

    python bench/bench_ratio_decode.py                          # lagkv keydiff heavy_hitter, ratio 0.75, query-agnostic
    OMP_NUM_THREADS=1 python bench/bench_ratio_decode.py --strategies lagkv --repeats 3

Under kvpress's ratio every decoded token has an empty slot (`build.ratio_caches`), so an evicting cache's
decode step skips its strategy's score (`EvictionCache._eviction_idx`). This times one batch of RULER
examples (prefill, question and answer, as `eval.py --query_agnostic` runs them) as shipped and with the
score forced on every step, as before, alternating the two; it checks that both generate the same tokens.
Writes bench/results/ratio_decode_<device>.md.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

from common import bench_parser, load_bench, machine, parse_bench_args, row, table, write_results
from kvlab.engine import generate
from kvlab.eviction import EvictionCache
from kvlab.tasks import resolve_tasks


@contextmanager
def scoring_every_step():
    """Every evicting cache computes its score each decode step, as before the skip."""
    limit_rows = EvictionCache.limit_rows

    def scoring(self, capacities, decode_room=None):
        limit_rows(self, capacities, decode_room)
        self.decode_evicts = True

    EvictionCache.limit_rows = scoring
    try:
        yield
    finally:
        EvictionCache.limit_rows = limit_rows


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument(
        "--strategies",
        nargs="+",
        default=["lagkv", "keydiff", "heavy_hitter"],
        help="evicting strategies (default: lagkv keydiff heavy_hitter)",
    )
    p.add_argument("--task", default="niah_single_1", help="RULER task (default: niah_single_1)")
    p.add_argument("--context_length", type=int, default=1024, help="RULER context length (default: 1024)")
    p.add_argument("--batch_size", type=int, default=8, help="examples in the batch (default: 8)")
    p.add_argument("--ratio", type=float, default=0.75, help="compression ratio (default: 0.75)")
    p.add_argument(
        "--repeats", type=int, default=2, help="timed runs of each variant; the fastest is reported (default: 2)"
    )
    args = parse_bench_args(p, "ratio_decode")
    bench = load_bench(args.device, args.dtype)
    (task,) = resolve_tasks([args.task])
    examples = task.examples(bench.tokenizer, args.batch_size, 0, args.context_length)
    prompts, questions = [e.input_ids for e in examples], [len(e.input_ids) - e.question_start for e in examples]
    rows = []
    for strategy in args.strategies:
        spec = bench.spec(strategy, compression_ratio=args.ratio)
        seconds, tokens = {"scored": [], "skipped": []}, {}
        for _ in range(args.repeats):
            for variant in seconds:
                bench.model.cache_key = None
                with scoring_every_step() if variant == "scored" else nullcontext():
                    t0 = time.perf_counter()
                    tokens[variant] = generate(
                        bench.model, prompts, task.max_new_tokens, spec, decoded_prompt_tokens=questions
                    ).tokens
                    seconds[variant].append(time.perf_counter() - t0)
        scored, skipped = min(seconds["scored"]), min(seconds["skipped"])
        rows.append(
            row(
                strategy,
                f"{scored:.1f}",
                f"{skipped:.1f}",
                f"{scored / skipped:.2f}x",
                tokens["scored"] == tokens["skipped"],
            )
        )
        print(rows[-1], flush=True)
    lines = [
        f"# A ratio batch with and without the eviction score: {bench.config['name']} on {bench.device.type} "
        f"({machine(bench.device)}), {bench.dtype_name}",
        "",
        f"RULER {args.task} at {args.context_length} tokens, {len(prompts)} examples in one batch, ratio "
        f"{args.ratio}, query-agnostic (context prefilled and compressed, question and answer decoded), eager; "
        f"fastest of {args.repeats} runs per variant, alternating.",
        "",
        *table("strategy | score every step (s) | score skipped (s) | speed-up | same tokens", rows),
    ]
    write_results(lines, args.out, "ratio_decode", bench.device)


if __name__ == "__main__":
    main()

"""Run under torchrun by test_parallel.py: generation with the model sharded over the ranks (tensor
parallelism, gloo on the CPU). Each rank writes what it saw to OUT/rank<r>.json: the greedy tokens of
each shipped config named on the command line (the prompts of tests/data/recorded_tokens.json), the
slots each of its KV heads holds per layer at the end, tokens sampled through the random strategy, and
the prefill logits of the first prompt.

    torchrun --nproc_per_node 2 tests/tp_worker.py OUT smollm full heavy_hitter ...
    torchrun --nproc_per_node 2 tests/tp_worker.py OUT tiny        # compiled decode on a tiny random model
    torchrun --nproc_per_node 2 tests/tp_worker.py OUT short full heavy_hitter ...   # 8 tokens after a 1-token prompt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_tiny_model  # noqa: E402 (puts the repository root on the path too)
from kvlab import parallel  # noqa: E402
from kvlab.checkpoint import load_checkpoint  # noqa: E402
from kvlab.config import cache_spec  # noqa: E402
from kvlab.config_files import load_cache_config  # noqa: E402
from kvlab.convert import default_checkpoint  # noqa: E402
from kvlab.engine import compile_decode_step, generate  # noqa: E402
from kvlab.model import Transformer  # noqa: E402
from kvlab.recording import RecordedPrefill  # noqa: E402
from kvlab.sampling import Sampling  # noqa: E402

RECORDED = json.loads((ROOT / "tests/data/recorded_tokens.json").read_text())
SHORT_PROMPT = "Hello"
TINY_SETTINGS = {
    "heavy_hitter": {"cache_strategy": "heavy_hitter", "max_cache_length": 0.5},
    "kvcompress": {"cache_strategy": "kvcompress", "max_cache_length": 0.5},
}


def per_head_slots(model: Transformer) -> list[list[list[int]]]:
    """Per layer, sequence and KV head of this rank: the tokens it holds (a paged head's length, the
    filled slots of a dense cache)."""
    slots = []
    for layer in model.layers:
        cache = layer.attention.kv_cache
        if cache.shares_pool:
            slots.append(cache.head_budgets().tolist())
            continue
        pos = cache.pos if cache.pos.dim() == 3 else cache.pos[:, None].expand(-1, layer.attention.n_local_heads, -1)
        slots.append(pos.ge(0).sum(dim=-1).tolist())
    return slots


@torch.no_grad()
def main() -> None:
    out, mode, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    parallel.init(torch.device("cpu"))
    seen: dict[str, dict] = {}
    if mode == "tiny":
        model = make_tiny_model()
        parallel.shard_model(model)
        prompts = [[(7 * i) % 64 for i in range(40)], [(3 * i + 1) % 64 for i in range(25)]]
        step = compile_decode_step(torch.device("cpu"))
        for name, settings in TINY_SETTINGS.items():
            spec = cache_spec(settings, model.config.n_layer)
            seen[name] = dict(
                eager=generate(model, prompts, 24, spec).tokens,
                compiled=generate(model, prompts, 24, spec, decode_step=step).tokens,
            )
    elif mode == "short":  # a 1-token prompt: each config's fractions raised to what its strategy protects
        model, tokenizer, _ = load_checkpoint(default_checkpoint(), "cpu", torch.float32, tensor_parallel=True)
        for name in names:
            torch.manual_seed(0)
            seen[name] = dict(
                tokens=generate(
                    model,
                    [tokenizer.encode(SHORT_PROMPT)],
                    8,
                    cache_spec(load_cache_config(name), model.config.n_layer, tokenizer),
                ).tokens
            )
    else:
        model, tokenizer, _ = load_checkpoint(default_checkpoint(), "cpu", torch.float32, tensor_parallel=True)
        prompts = [tokenizer.encode(p) for p in RECORDED["prompts"]]
        for name in names:
            spec = cache_spec(load_cache_config(name), model.config.n_layer, tokenizer)
            torch.manual_seed(0)
            result = generate(model, prompts, RECORDED["max_new_tokens"], spec)
            seen[name] = dict(tokens=result.tokens, slots=per_head_slots(model))
        torch.manual_seed(1)
        sampled = generate(
            model,
            prompts,
            12,
            cache_spec(load_cache_config("random"), model.config.n_layer, tokenizer),
            Sampling(temperature=1.0),
        )
        seen["sampled_random"] = sampled.tokens  # each rank draws random scores for its own heads
        recorded = RecordedPrefill()

        recorded.record(
            model,
            torch.tensor([prompts[0]]),
            torch.arange(len(prompts[0]))[None],
            torch.tensor([[len(prompts[0]) - 1]]),
        )
        seen["logits"] = recorded.logits[0, -1].tolist()
    (out / f"rank{parallel.rank()}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()

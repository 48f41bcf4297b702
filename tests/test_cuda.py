"""The CUDA path (bf16, compiled decode with CUDA graphs). Skipped where no GPU is present; the
figures from a GPU run are in bench/results/generate_cuda.md."""

from __future__ import annotations

import pytest
import torch

from conftest import spec_for
from kvlab.checkpoint import load_checkpoint
from kvlab.engine import compile_decode_step, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def cuda_smollm(request, smollm_dir):
    return load_checkpoint(smollm_dir, "cuda", request.param)


def test_chat_answer_on_cuda(cuda_smollm):
    model, tokenizer, _ = cuda_smollm
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = tokenizer.decode(generate(model, [prompt], 20, stop_ids=tokenizer.stop_ids).tokens[0])
    assert "Paris" in answer


def test_compiled_decode_step_logits_match_eager_on_cuda(cuda_smollm):
    """Teacher-forced through the same cache, the compiled step's logits equal eager's: to float32
    rounding in float32, to bfloat16 rounding in bfloat16 (where greedy ties may then break differently)."""
    model, tokenizer, _ = cuda_smollm
    ids = tokenizer.encode(
        "The three most important inventions of the nineteenth century were the telegraph, the railway and the "
        "camera, because"
    )
    n_prompt = 8
    generate(model, [ids[:n_prompt]], len(ids))  # sets up caches of the right capacity and prefills
    model(torch.tensor([ids[:n_prompt]], device="cuda"), torch.arange(n_prompt, device="cuda")[None], prefill=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, p: model(t, p), mode="reduce-overhead", fullgraph=True)
    diffs, agree = [], 0
    with torch.no_grad():
        for p in range(n_prompt, len(ids)):
            token, pos = torch.tensor([[ids[p]]], device="cuda"), torch.tensor([[p]], device="cuda")
            eager = model(token, pos)[0, -1].float()
            comp = compiled(token, pos)[0, -1].float().clone()
            diffs.append((eager - comp).abs().max().item() / eager.abs().max().item())
            agree += int(eager.argmax() == comp.argmax())
    tol = 1e-4 if model.tok_embeddings.weight.dtype == torch.float32 else 5e-2  # bf16: 8 mantissa bits, 30 layers
    assert max(diffs) <= tol
    assert agree >= len(diffs) - 1


def test_compiled_greedy_tokens_equal_eager_on_cuda_float32(smollm_dir):
    model, tokenizer, _ = load_checkpoint(smollm_dir, "cuda", torch.float32)
    prompts = [
        tokenizer.encode("The three most important inventions of the nineteenth century were"),
        tokenizer.encode("Water boils at"),
    ]
    eager = generate(model, prompts, 32).tokens
    torch._dynamo.reset()
    compiled = generate(model, prompts, 32, decode_step=compile_decode_step(torch.device("cuda"))).tokens
    assert compiled == eager


def test_recall_host_tier_is_pinned_and_decodes_like_the_device_tier_on_cuda(cuda_smollm):
    model, tokenizer, _ = cuda_smollm
    prompt = tokenizer.encode(
        " ".join(["The history of the printing press begins in Mainz, where Gutenberg worked."] * 30)
    )
    options = dict(tokens_per_cluster=16, sink_tokens=4)
    device = generate(model, [prompt], 24, spec_for(model, "clusterkv", 96, **options))
    host = generate(model, [prompt], 24, spec_for(model, "clusterkv", 96, **{**options, "slow_tier": "host"}))
    cache = model.layers[0].attention.kv_cache
    assert cache.storage.k.is_pinned() and cache.fast_k.is_cuda
    assert host.tokens == device.tokens and host.cache_stats["recall: copied from the host tier"] > 0


def test_kvcompress_compiled_equals_eager_on_cuda_float32(smollm_dir):
    model, tokenizer, _ = load_checkpoint(smollm_dir, "cuda", torch.float32)
    prompts = [
        tokenizer.encode(" ".join(["The three most important inventions of the nineteenth century were"] * 12)),
        tokenizer.encode("Water boils at"),
    ]
    spec = spec_for(model, "kvcompress", 0.25, kvc_block_size=16)
    eager = generate(model, prompts, 32, spec)
    torch._dynamo.reset()
    compiled = generate(model, prompts, 32, spec, decode_step=compile_decode_step(torch.device("cuda")))
    assert compiled.tokens == eager.tokens and eager.cache_stats["kvcompress: blocks freed"] > 0


def test_kvcompress_flex_attention_compiled_equals_the_gathered_path_on_cuda_float32(smollm_dir):
    model, tokenizer, _ = load_checkpoint(smollm_dir, "cuda", torch.float32)
    prompts = [
        tokenizer.encode(" ".join(["The three most important inventions of the nineteenth century were"] * 12)),
        tokenizer.encode("Water boils at"),
    ]
    options = dict(kvc_block_size=16, kvc_compress_every=0)
    gathered = generate(model, prompts, 32, spec_for(model, "kvcompress", 0.25, **options))
    torch._dynamo.reset()
    flex = generate(
        model,
        prompts,
        32,
        spec_for(model, "kvcompress", 0.25, kvc_attention="flex", **options),
        decode_step=compile_decode_step(torch.device("cuda")),
    )
    assert flex.tokens == gathered.tokens and gathered.cache_stats["kvcompress: blocks freed"] > 0

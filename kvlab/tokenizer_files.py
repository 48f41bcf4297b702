"""Reading a checkpoint's tokenizer files into `tokenizer.py`'s tokenizers, by the "tokenizer" section of its
config.json: a Hugging Face tokenizer.json byte-level BPE (as tiktoken ranks), Meta's tiktoken tokenizer.model,
or a SentencePiece model; and the chat format a Jinja chat template implies (`chat_config`)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import sentencepiece as spm

from kvlab.tokenizer import (
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    SMOLLM_PATTERN,
    ByteLevelTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)

KINDS = ("bpe", "sentencepiece", "tiktoken")

# Meta's Llama-3.1 tokenizer.model carries no special tokens; they follow the ranks in this order.
LLAMA3_SPECIAL_NAMES = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]

# bos/eos for a tokenizer.json whose config does not name them.
FALLBACK_BOS = ("<|begin_of_text|>", "<s>")
FALLBACK_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>")

_CHATML_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}<]+?)<\|im_end\|>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE token strings."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The single regex that reproduces a tokenizer.json pre_tokenizer (only the byte-level ones in use)."""
    steps = pre["pretokenizers"] if pre and pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") if s else None for s in steps]
    if types in (["ByteLevel"], ["Digits", "ByteLevel"], ["Split", "ByteLevel"]) and not steps[-1].get(
        "add_prefix_space", False
    ):
        first, use_regex = steps[0], steps[-1].get("use_regex", True)
        if types == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        if types == ["Digits", "ByteLevel"] and first.get("individual_digits") and use_regex:
            return SMOLLM_PATTERN
        if (
            types == ["Split", "ByteLevel"]
            and not use_regex
            and "Regex" in first.get("pattern", {})
            and first.get("behavior") == "Isolated"
            and not first.get("invert", False)
        ):
            return first["pattern"]["Regex"]
    raise ValueError(
        f"unsupported pre_tokenizer {json.dumps(pre)}; supported: ByteLevel(use_regex=True), "
        "Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], "
        "Sequence[Split(Regex, behavior=Isolated), ByteLevel(use_regex=False)], all with add_prefix_space=False"
    )


def _load_bpe(path: Path, config: dict) -> ByteLevelTokenizer:
    """A tokenizer.json byte-level BPE as tiktoken ranks: single bytes first, then merge results in merge order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model type {model.get('type')!r} is not supported; kind 'bpe' needs 'BPE'")
    normalizer = data.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise ValueError(f"{path}: unsupported normalizer {json.dumps(normalizer)}; supported: null, NFC")
    pattern = pattern_from_pre_tokenizer(data.get("pre_tokenizer"))

    specials = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab = model["vocab"]
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    id_to_bytes = [b""] * (max([*vocab.values(), *specials.values()]) + 1)
    for token, i in vocab.items():
        if token in specials:
            continue
        try:
            id_to_bytes[i] = bytes(byte_of[c] for c in token)
        except KeyError:
            raise ValueError(f"{path}: token {token!r} (id {i}) is not in byte-level form") from None
    for token, i in specials.items():
        id_to_bytes[i] = token.encode("utf-8")

    order = sorted(i for token, i in vocab.items() if token not in specials and len(id_to_bytes[i]) == 1)
    for merge in model["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if a + b not in vocab:
            raise ValueError(f"{path}: merge {a!r} + {b!r} gives {a + b!r}, which is not in the vocab")
        order.append(vocab[a + b])
    order = list(dict.fromkeys(order))
    if all(x < y for x, y in zip(order, order[1:], strict=False)):
        ranks, rank_to_id = {id_to_bytes[i]: i for i in order}, None
    else:
        ranks, rank_to_id = {id_to_bytes[i]: r for r, i in enumerate(order)}, order

    bos = config.get("bos_token") or next((t for t in FALLBACK_BOS if t in specials), None)
    eos = config.get("eos_token") or next((t for t in FALLBACK_EOS if t in specials), None)
    if eos is None or eos not in specials or (bos is not None and bos not in specials):
        raise ValueError(
            f"{path}: bos_token {bos!r} and eos_token {eos!r} must name added tokens (eos is required); have "
            f"{sorted(specials)[:20]}"
        )
    return ByteLevelTokenizer(
        "bpe",
        ranks,
        pattern,
        id_to_bytes,
        rank_to_id,
        specials,
        specials[bos] if bos is not None else None,
        specials[eos],
        config.get("chat_template"),
        config.get("default_system_prompt"),
        nfc=normalizer is not None,
    )


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    lines = path.read_text(encoding="ascii").splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


def _load_tiktoken(path: Path, config: dict) -> ByteLevelTokenizer:
    """Meta's Llama-3 tokenizer.model; the Llama-3.1 special tokens follow the ranks."""
    ranks = _read_tiktoken_ranks(path)
    specials = {name: len(ranks) + i for i, name in enumerate(LLAMA3_SPECIAL_NAMES)}
    id_to_bytes = [b""] * (len(ranks) + len(specials))
    for token, rank in ranks.items():
        id_to_bytes[rank] = token
    for name, i in specials.items():
        id_to_bytes[i] = name.encode("utf-8")
    return ByteLevelTokenizer(
        "tiktoken",
        ranks,
        LLAMA3_PATTERN,
        id_to_bytes,
        None,
        specials,
        specials["<|begin_of_text|>"],
        specials["<|end_of_text|>"],
        config.get("chat_template"),
        config.get("default_system_prompt"),
    )


def load_tokenizer(checkpoint_dir: Path, config: dict) -> Tokenizer:
    """The tokenizer described by the "tokenizer" section of a checkpoint's config.json."""
    kind = config.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {KINDS}")
    name = str(config.get("file", "tokenizer.json" if kind == "bpe" else "tokenizer.model"))
    path = Path(checkpoint_dir) / name
    if not path.resolve().is_relative_to(Path(checkpoint_dir).resolve()):
        raise ValueError(
            f"tokenizer file {name!r} lies outside {checkpoint_dir}; a checkpoint may only name files inside "
            "its own directory"
        )
    try:
        tokenizer = read_tokenizer(kind, path, config)
    # each library's own complaint about a damaged file
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a readable {kind} tokenizer file ({reason})") from None
    # Whether plain text starts with BOS (Llama 2/3 were trained so; SmolLM2 and Qwen2 were not).
    tokenizer.add_bos = bool(config.get("add_bos", kind != "bpe"))
    return tokenizer


def read_tokenizer(kind: str, path: Path, config: dict) -> Tokenizer:
    if kind == "bpe":
        return _load_bpe(path, config)
    if kind == "tiktoken":
        return _load_tiktoken(path, config)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    return SentencePieceTokenizer(sp, config.get("chat_template"), config.get("default_system_prompt"))


def chat_template_family(template: str | None) -> str | None:
    """Which of our chat formats a Jinja chat template writes (None when absent or unrecognised)."""
    if not template:
        return None
    if "<|im_start|>" in template:
        return "chatml"
    if "<|start_header_id|>" in template:
        return "llama3"
    if "[INST]" in template:
        return "llama2" if "<<SYS>>" in template else "mistral"
    return None


def chat_config(template: str | None) -> dict:
    family = chat_template_family(template)
    match = _CHATML_DEFAULT_SYSTEM.search(template) if family == "chatml" else None
    return {"chat_template": family, "default_system_prompt": match.group(1) if match else None}

"""Writing a checkpoint's tokenizer files at conversion: a tokenizer.json from a GGUF's vocabulary and merges (or its
SentencePiece model), or the files of a Hugging Face repository, with the config.json section that reads them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import sentencepiece as spm

from kvlab.tokenizer import GGUF_PRE_PATTERNS
from kvlab.tokenizer_files import chat_config, pattern_from_pre_tokenizer


def bpe_tokenizer_json(tokens: list[str], added: list[dict], merges: list[str], pattern: str) -> dict:
    """A tokenizer.json of a byte-level BPE: its vocabulary (token i has id i), merges, added special tokens and split
    regex."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def tokenizer_files_from_gguf(reader: gguf.GGUFReader, out_dir: Path) -> dict:
    """Write out_dir/tokenizer.json for a GGUF's byte-level BPE vocabulary; return the config's "tokenizer" section."""
    fields = reader.fields
    model = fields["tokenizer.ggml.model"].contents()
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer.ggml.model {model!r}; supported: 'gpt2' (byte-level BPE)")
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else "default"
    if pre not in GGUF_PRE_PATTERNS:
        raise ValueError(f"unknown GGUF tokenizer.ggml.pre {pre!r}; known: {sorted(GGUF_PRE_PATTERNS)}")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    special_types = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in special_types
    ]
    tokenizer_json = bpe_tokenizer_json(
        tokens, added, fields["tokenizer.ggml.merges"].contents(), GGUF_PRE_PATTERNS[pre]
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")

    def token(key: str) -> str | None:
        return tokens[fields[key].contents()] if key in fields else None

    template = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
    return {
        "kind": "bpe",
        "file": "tokenizer.json",
        **chat_config(template),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "add_bos": bool(fields["tokenizer.ggml.add_bos_token"].contents())
        if "tokenizer.ggml.add_bos_token" in fields
        else False,
    }


def _special_token_text(value: str | dict | None) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def hf_chat_template(hf_dir: Path, tok_config: dict) -> str | None:
    """The repository's chat template: tokenizer_config.json's (its "default" when it names several), else
    chat_template.jinja's; None without one."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def tokenizer_files_from_hf(hf_dir: Path, out_dir: Path) -> dict:
    """Copy a Hugging Face model directory's tokenizer into out_dir; return the config's "tokenizer" section.

    Prefers a byte-level BPE tokenizer.json; otherwise tokenizer.model, as SentencePiece or tiktoken. (Llama-2
    directories also hold a tokenizer.json, but not a byte-level one, so their SentencePiece model is used.)
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8")) if tok_config_path.exists() else {}
    chat = chat_config(hf_chat_template(hf_dir, tok_config))
    out_dir.mkdir(parents=True, exist_ok=True)

    json_path = hf_dir / "tokenizer.json"
    if json_path.exists():
        data = json.loads(json_path.read_text(encoding="utf-8"))
        if data["model"].get("type") == "BPE" and (data.get("decoder") or {}).get("type") == "ByteLevel":
            pattern_from_pre_tokenizer(data.get("pre_tokenizer"))
            shutil.copyfile(json_path, out_dir / "tokenizer.json")
            bos = _special_token_text(tok_config.get("bos_token"))
            eos = _special_token_text(tok_config.get("eos_token"))
            # Llama-3 adds BOS through the tokenizer.json post-processor rather than add_bos_token.
            add_bos = tok_config.get("add_bos_token", bos is not None and bos in json.dumps(data.get("post_processor")))
            return {
                "kind": "bpe",
                "file": "tokenizer.json",
                **chat,
                "bos_token": bos,
                "eos_token": eos,
                "add_bos": bool(add_bos),
            }

    model_path = hf_dir / "tokenizer.model"
    if model_path.exists():
        raw = model_path.read_bytes()
        if re.match(rb"[A-Za-z0-9+/]+=* \d+\r?\n", raw):
            kind = "tiktoken"
        else:
            try:
                spm.SentencePieceProcessor(model_proto=raw)
            except RuntimeError as e:
                raise ValueError(f"{model_path} is neither a SentencePiece model nor a tiktoken file ({e})") from None
            kind = "sentencepiece"
        shutil.copyfile(model_path, out_dir / "tokenizer.model")
        add_bos = bool(tok_config.get("add_bos_token", True))
        return {
            "kind": kind,
            "file": "tokenizer.model",
            **chat,
            "bos_token": None,
            "eos_token": None,
            "add_bos": add_bos,
        }

    raise ValueError(
        f"no usable tokenizer in {hf_dir}: looked for tokenizer.json (byte-level BPE) and tokenizer.model "
        "(SentencePiece or tiktoken)"
    )

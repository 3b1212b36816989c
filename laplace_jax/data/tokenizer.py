"""Tokenizers: a byte-level one (no files) and any Hugging Face ``tokenizer.json``.

Spec strings: ``"byte"`` or a path to a ``tokenizer.json`` (e.g. GPT-2's for the 3B config).
The byte tokenizer maps UTF-8 bytes to ids 0..255 and uses id 0 (NUL, never in text) as EOS.
"""

from __future__ import annotations

import json
import os
import re
from typing import Protocol

import numpy as np

from laplace_jax.errors import UserError

GPT2_HINT = (
    "download GPT-2's tokenizer.json (Hugging Face repository 'openai-community/gpt2', file tokenizer.json) "
    "on a machine with internet access and pass its local path"
)


class Tokenizer(Protocol):
    spec: str
    vocab_size: int
    eos_id: int
    eos_token: str  # the end token's text (the server's /tokenize recognises it in text)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def token_bytes(self) -> list[bytes | None]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; EOS = 0."""

    spec = "byte"
    vocab_size = 256
    eos_id = 0
    eos_token = "\0"

    def encode(self, text: str) -> list[int]:
        return list(text.replace("\0", "").encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.replace("\0", "").encode("utf-8"), np.uint8).astype(np.uint32) for t in texts]

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in generated text (None: EOS, which writes nothing)."""
        return [None] + [bytes([i]) for i in range(1, 256)]


class HFTokenizer:
    """A ``tokenizers`` JSON tokenizer. EOS: ``eos_token`` if given, else a known end token."""

    def __init__(self, path: str, eos_token: str | None = None):
        from tokenizers import Tokenizer as _Tok  # imported when used: byte-level runs never need it

        self.spec = os.path.abspath(path)
        self._tok = _Tok.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        candidates = [eos_token] if eos_token else ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
        ids = [self._tok.token_to_id(t) for t in candidates if t]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise ValueError(f"{path}: no EOS token found among {candidates}; pass eos_token")
        self.eos_id = ids[0]
        self.eos_token = self._tok.id_to_token(self.eos_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The Rust tokenizer's own batch call; each text is encoded alone (no special tokens)."""
        return [np.asarray(e.ids, np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in generated text (None: special tokens, which write nothing). Byte-level
        BPE (GPT-2's): each character of a token stands for one byte; SentencePiece-style
        ("▁" for a space, "<0xNN>" byte fallback) otherwise. Raises ``UserError`` for a decoder
        whose tokens are neither."""
        spec = json.loads(self._tok.to_str())
        decoder = spec.get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        out: list[bytes | None] = [None] * self.vocab_size
        if "ByteLevel" in kinds:
            to_byte = {c: b for b, c in _byte_level_chars().items()}
            read = lambda t: bytes(to_byte[c] for c in t) if all(c in to_byte for c in t) else None  # noqa: E731
        elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
            read = _sentencepiece_bytes
        else:
            raise UserError(
                f"{self.spec}: structured outputs need each token's bytes; decoder {sorted(k for k in kinds if k)} "
                "is neither byte-level BPE nor SentencePiece-style"
            )
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i not in special and i < self.vocab_size:
                out[i] = read(token)
        return out


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it (printable
    Latin-1 bytes stand for themselves, the others for 256 + n in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def _sentencepiece_bytes(token: str) -> bytes:
    m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
    return bytes([int(m.group(1), 16)]) if m else token.replace("▁", " ").encode("utf-8")


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` or a tokenizer.json path; a clear error says what to download when missing."""
    if spec == "byte":
        return ByteTokenizer()
    if spec in ("gpt2", "GPT-2") or not os.path.isfile(spec):
        raise FileNotFoundError(f"tokenizer {spec!r} not found: {GPT2_HINT}")
    return HFTokenizer(spec)


def encode_batch(spec: str, texts: list[str]) -> list[np.ndarray]:
    """Encode texts with the tokenizer ``spec`` (top-level so worker processes can run it)."""
    return _cached(spec).encode_batch(texts)


_CACHE: dict[str, Tokenizer] = {}


def _cached(spec: str) -> Tokenizer:
    if spec not in _CACHE:
        _CACHE[spec] = load_tokenizer(spec)
    return _CACHE[spec]

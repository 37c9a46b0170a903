"""Text to token ids and back, for ``--dataset text`` and ``python -m bundle.generate``.

Byte-level by default (256 tokens: every file reads, nothing to ship). ``--tokenizer DIR`` reads
a tokenizer saved on disk: a ``tokenizers`` ``tokenizer.json`` (what a fast ``transformers``
tokenizer's ``save_pretrained`` writes too; DIR may name the file itself), or else whatever
``transformers.AutoTokenizer`` reads from the directory (a SentencePiece model, vocab files).
Nothing is downloaded. Special tokens are not added: the text is one stream of windows.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from typing import Any, Protocol

from bundle.errors import DataError

BYTE_VOCAB = 256


class Tokenizer(Protocol):
    vocab: int  # token ids are 0 .. vocab - 1: the language model's classes

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Bytes:
    """UTF-8 bytes as tokens."""

    vocab = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        raw = bytes(t if 0 <= t < BYTE_VOCAB else ord("?") for t in ids)
        return raw.decode("utf-8", errors="replace")


class _Saved:
    """A ``tokenizers.Tokenizer`` (tokenizer.json)."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.vocab = tok, int(tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))


class _Auto:
    """A tokenizer ``transformers.AutoTokenizer`` reads from a directory."""

    def __init__(self, tok: Any) -> None:
        tok.model_max_length = 1 << 62  # a whole file is encoded at once: no length warning
        self.tok, self.vocab = tok, len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))


@functools.lru_cache(maxsize=4)
def load(path: str | None) -> Tokenizer:
    """Byte-level for None; else the tokenizer saved at ``path`` (a one-line error if none is)."""
    if not path:
        return Bytes()
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if os.path.isfile(file):
        try:
            from tokenizers import Tokenizer as Saved
        except ImportError:
            raise DataError(f"--tokenizer {path!r} needs the tokenizers package") from None
        try:
            return _Saved(Saved.from_file(file))
        except Exception as exc:  # noqa: BLE001 - the file is not a tokenizer: say which
            raise DataError(f"--tokenizer {path!r}: {file} is not a tokenizer ({exc})") from None
    if not os.path.isdir(path):
        raise DataError(f"--tokenizer {path!r}: no such directory or tokenizer.json file")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from bundle.models import hf

        raise DataError(
            f"--tokenizer {path!r} has no tokenizer.json; reading it needs transformers "
            f"({hf.install_command()})"
        ) from None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            # A tokenizer is data: its directory's own code (auto_map) is never run, nor asked for.
            auto = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
            return _Auto(auto)
    except Exception as exc:  # noqa: BLE001 - transformers' reasons are long: their first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"--tokenizer {path!r}: no tokenizer can be read there ({first})") from None


# The end-of-text tokens a tokenizer.json may name, the usual first: GPT-2's (and most BPEs'),
# Llama 3's, SentencePiece's, Gemma's.
_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def end_of_text(tok: Tokenizer) -> int | None:
    """The id that ends a document in a prepared corpus: byte 0 (NUL, which text does not hold)
    for bytes, a transformers tokenizer's ``eos_token_id``, else the first of ``_END_OF_TEXT``
    that a tokenizer.json has; None when there is none."""
    if isinstance(tok, Bytes):
        return 0
    if isinstance(tok, _Auto):
        eos = tok.tok.eos_token_id
        return eos if isinstance(eos, int) else None
    if isinstance(tok, _Saved):
        for name in _END_OF_TEXT:
            found = tok.tok.token_to_id(name)
            if found is not None:
                return int(found)
    return None

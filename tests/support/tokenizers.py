"""A tokenizer the tests train themselves (nothing can be downloaded): GPT-2's kind, small."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def byte_level_bpe(directory: Path, texts: Iterable[str], vocab: int = 300) -> str:
    """A byte-level BPE of ``vocab`` tokens, ``<|endoftext|>`` among them, trained on ``texts``
    and saved as ``directory/tokenizer.json``; returns the directory."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)

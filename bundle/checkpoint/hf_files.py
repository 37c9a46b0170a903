"""What ``transformers`` makes of a ``save_pretrained`` directory beyond its weights' bytes, read
as data (JSON and plain files, never code or a pickle):

- ``copy_tokenizer``: the run's tokenizer copied into an export, regular files of an exact list
  of names (``TOKENIZER_FILES``);
- ``generation_config``: a ``--pretrained`` directory's own ``generation_config.json`` (its eos,
  bos and pad ids, sampling defaults, lengths), which ``export --hf`` writes instead of the one
  made from the model's config.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from typing import Any

from bundle.errors import ConfigError

# What a tokenizer directory may hold, as transformers and tokenizers save it: copied, nothing else.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"
_GENERATION_BYTES = 1 << 20  # a generation config is a few hundred bytes: larger is not one
FLAG = "--pretrained"  # the run's: the directory the generation config is read from
NOTE = "python -m bundle.checkpoint: note:"


def copy_tokenizer(source: str, out: str) -> tuple[str, ...]:
    """Copy the tokenizer saved at ``source`` (a directory, or its ``tokenizer.json``) into
    ``out``: regular files of ``TOKENIZER_FILES`` only (no link, no directory); their names."""
    if os.path.isfile(source):
        files = {"tokenizer.json": source}
    elif os.path.isdir(source):
        files = {name: os.path.join(source, name) for name in TOKENIZER_FILES}
    else:
        raise ConfigError(
            "--tokenizer", source, "no such tokenizer (the run's): give --tokenizer DIR"
        )
    copied = []
    for name, file in files.items():
        try:
            if not stat.S_ISREG(os.lstat(file).st_mode):
                continue
        except FileNotFoundError:
            continue
        shutil.copyfile(file, os.path.join(out, name), follow_symlinks=False)
        copied.append(name)
    if not copied:
        raise ConfigError("--tokenizer", source, "holds no tokenizer file to copy")
    return tuple(copied)


def generation_config(directory: str) -> Any | None:
    """The ``transformers.GenerationConfig`` of ``directory`` (the run's ``--pretrained``), read
    from its ``generation_config.json`` as JSON data (a regular file, not a link, of at most
    1 MiB), for its own ``save_pretrained`` to write. None where the directory holds none, or is
    no longer there (said in one line on stderr: the export's is then the model config's). A file
    that cannot be read, or that ``GenerationConfig`` refuses, is one line."""
    if not os.path.isdir(directory):
        print(
            f"{NOTE} {directory} (the run's --pretrained) is gone: {GENERATION_CONFIG} is made "
            "from the model's config, not carried from it",
            file=sys.stderr,
        )
        return None
    path = os.path.join(directory, GENERATION_CONFIG)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise ConfigError(FLAG, path, "is no regular file (a link?): put the file itself there")
    try:
        data = _json_object(path)
    except (OSError, ValueError) as exc:
        why = f"cannot read it ({_first_line(exc)}): fix or remove it"
        raise ConfigError(FLAG, path, why) from None
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_dict(data)
        config.validate()
    except Exception as exc:  # noqa: BLE001 - the library refused it: one line
        why = f"GenerationConfig refuses it ({_first_line(exc)}): fix or remove it"
        raise ConfigError(FLAG, path, why) from None
    # Marked as from_pretrained marks a config it loaded: its save then checks it as published.
    config._original_object_hash = hash(config)
    return config


def _json_object(path: str) -> dict[str, Any]:
    """A JSON object from a regular file of at most ``_GENERATION_BYTES`` (a link is refused)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # no link swapped in since
    with os.fdopen(fd, "rb") as f:
        text = f.read(_GENERATION_BYTES + 1)
    if len(text) > _GENERATION_BYTES:
        raise ValueError(f"larger than {_GENERATION_BYTES} bytes")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__

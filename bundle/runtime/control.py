"""The store's control keys: what stops the job (its abort) or takes a bundle out (dead and
lost-node marks, a heal's incarnation), written sealed and read checked.

The job's store has no authorisation (c10d's TCPStore: whoever reaches its port reads and writes
every key), so a value that acts on the job is input like any other before it acts: text is
printable and bounded (a stranger's terminal escapes are not replayed on every rank), numbers are
numbers. With a job secret (``BUNDLE_JOB_SECRET``, or a file named by ``BUNDLE_JOB_SECRET_FILE``,
as Slurm and Kubernetes hand out secrets) each value carries an HMAC-SHA256 of its key and text
that only holders of the secret can make; one without it is ignored, and said once. What a secret
does not protect, docs/security.md says.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
from collections.abc import Mapping

import torch.distributed as dist

from bundle import log
from bundle.errors import ConfigError

SECRET_ENV = "BUNDLE_JOB_SECRET"
SECRET_FILE_ENV = "BUNDLE_JOB_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_TEXT = 2000  # characters of a control value kept (an abort's error message)
_TAG = "hmac-sha256:"
# Terminal escape sequences, then every other control character.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)?|\x1b.?")
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
_ignored: set[str] = set()


def clean(text: str) -> str:
    """``text`` as one printable line of at most ``MAX_TEXT`` characters."""
    text = _ESCAPES.sub("", text)
    text = _CONTROLS.sub(" ", text).strip()
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def read_secret(env: Mapping[str, str]) -> bytes | None:
    """The job secret from ``env`` (None: none set); refused in one line when unusable."""
    if env.get(SECRET_ENV):
        secret, where = env[SECRET_ENV].encode(), SECRET_ENV
    elif env.get(SECRET_FILE_ENV):
        where = env[SECRET_FILE_ENV]
        try:
            with open(where, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(SECRET_FILE_ENV, where, f"cannot read it ({exc.strerror})") from None
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            SECRET_ENV if where == SECRET_ENV else SECRET_FILE_ENV,
            f"<{len(secret)} bytes>",
            f"a job secret has at least {MIN_SECRET_BYTES} bytes (e.g. openssl rand -hex 32)",
        )
    return secret


@functools.cache
def _secret() -> bytes | None:
    return read_secret(os.environ)


def fingerprint() -> str | None:
    """What the nodes compare to find a node started with another secret (not the secret)."""
    secret = _secret()
    return None if secret is None else _mac(secret, "fingerprint", "")[:16]


def _mac(secret: bytes, key: str, text: str) -> str:
    return hmac.new(secret, f"{key}\0{text}".encode(), hashlib.sha256).hexdigest()


def seal(key: str, text: str) -> str:
    """The value to write at ``key``: ``text`` cleaned, with its HMAC where a secret is set."""
    text = clean(text)
    secret = _secret()
    return text if secret is None else f"{_TAG}{_mac(secret, key, text)}:{text}"


def unseal(key: str, raw: bytes | str) -> str | None:
    """The text of a value read at ``key``; None where it cannot act (empty, or not sealed with
    this job's secret)."""
    value = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    secret = _secret()
    if secret is None:
        text = value.split(":", 2)[2] if value.startswith(_TAG) and value.count(":") >= 2 else value
        return clean(text) or None
    mac, _, text = value.removeprefix(_TAG).partition(":")
    if value.startswith(_TAG) and hmac.compare_digest(mac, _mac(secret, key, text)):
        return clean(text) or None
    if key not in _ignored:
        _ignored.add(key)
        log.get().warning(f"ignored {key} in the job's store: it is not sealed with the job secret")
    return None


def read(store: dist.Store, key: str) -> str | None:
    """The checked text at ``key``, or None (not there, or not one that may act)."""
    return unseal(key, store.get(key)) if store.check([key]) else None


def read_int(store: dist.Store, key: str) -> int | None:
    """The checked non-negative integer at ``key``, or None."""
    text = read(store, key)
    return int(text) if text is not None and text.isdigit() and len(text) < 10 else None


def put(store: dist.Store, key: str, text: str) -> None:
    store.set(key, seal(key, text))


def put_first(store: dist.Store, key: str, text: str) -> str:
    """Write ``text`` at ``key`` unless a value that may act is there already (compare-and-set);
    returns the text that stands. A value that may not act (forged) is written over."""
    sealed = seal(key, text)
    got = store.compare_set(key, "", sealed).decode(errors="replace")
    if got in (sealed, ""):
        return clean(text)
    standing = unseal(key, got)
    if standing is not None:
        return standing
    store.set(key, sealed)
    return clean(text)

"""The cache of profiles: JSON files under one directory, named by a hash of what they depend on.

An entry measured on the clock carries the conditions it was measured under
(``bundle.plan.conditions``) and is kept only where they can be trusted; ``profile`` reads and
writes anatomies and timings through it, ``calibrate`` and ``shares`` their measurements.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from bundle.plan.conditions import Conditions

# The note of a profile measured under conditions that cannot be trusted (a busy machine, or
# repetitions that disagree): kept out of the cache. scripts/bench_hetero.py looks for it.
NOT_CACHED = "not cached, and plans made from it may be off"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bundle" / "profiles"


def slug(name: str, limit: int = 40) -> str:
    """``name`` as a file name's part: ``[A-Za-z0-9._-]``, no leading dot, no ``..``, at most
    ``limit`` characters. Only a reader's hint: the digest beside it tells entries apart
    (``--model ../x.py:build`` must not leave the cache directory)."""
    text = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", name))
    return text.lstrip(".")[:limit] or "model"


class ProfileCache:
    """JSON files under one directory, named by a hash of what they depend on; ``None``: off.

    A measured entry carries the conditions it was measured under (``bundle.plan.conditions``).
    ``get`` passes over one that cannot be trusted (so it is measured again), ``put`` keeps none,
    and ``refresh`` (``plan.py --reprofile``) measures everything afresh. ``notes`` says, for the
    plan's output, which entries were used (with their age and conditions) and which were not.
    """

    FORMAT = 2  # raised whenever what an entry holds changes: older entries are measured again

    def __init__(self, directory: str | Path | None, *, refresh: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.refresh = refresh
        self.notes: list[str] = []

    def _path(self, kind: str, key: dict) -> Path | None:
        if self.directory is None:
            return None
        key = {**key, "format": self.FORMAT}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{kind}-{slug(str(key.get('model', 'engine')))}-{digest}.json"

    def get(self, kind: str, key: dict, *, now: float | None = None) -> dict | None:
        path = self._path(kind, key)
        if path is None or not path.is_file():
            return None
        if self.refresh:
            self.notes.append(f"{kind} profile measured afresh (--reprofile), not read from {path}")
            return None
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # a damaged entry is measured again
        if doc.get("key") != key:
            return None
        if doc.get("conditions") is None:
            return doc.get("value")  # counted, not timed (an anatomy): nothing to judge
        seen = Conditions.from_json(doc["conditions"])
        if (trouble := seen.trouble()) is not None:
            self.notes.append(f"{kind} profile {path} not used: measured while {trouble}")
            return None
        self.notes.append(f"{kind} profile from the cache, {seen.describe(now)}: {path}")
        return doc.get("value")

    def put(self, kind: str, key: dict, value: dict, conditions: Conditions | None = None) -> None:
        """Keep ``value``, unless it was measured under ``conditions`` that cannot be trusted."""
        trouble = conditions.trouble() if conditions is not None else None
        if trouble is not None:
            self.notes.append(
                f"{kind} profile measured now while {trouble}: {NOT_CACHED}; plan on a quiet machine"
            )
            return
        path = self._path(kind, key)
        if path is None:
            return
        if conditions is not None:
            self.notes.append(
                f"{kind} profile measured now, {conditions.describe(age=False)}: {path}"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        doc = {"key": key, "value": value}
        if conditions is not None:
            doc["conditions"] = conditions.to_json()
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)

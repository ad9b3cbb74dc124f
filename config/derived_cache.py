"""A disk cache for what is slow to derive from a model file (GGUF metadata,
a tokenizer converted from GGUF), keyed by the file's path, size and mtime so
that a changed file is derived afresh."""
from __future__ import annotations

import hashlib
import os

from fleet.config import env


def derived_path(source: str, kind: str) -> str:
    """The cache path for `kind` derived from the file `source` (not created)."""
    stat = os.stat(source)
    key = hashlib.sha256(f"{os.path.abspath(source)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(env.cache_dir(), kind, key)


def write_atomically(path: str, data: bytes) -> None:
    """Several processes may derive the same thing at once: last rename wins, readers never see half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)

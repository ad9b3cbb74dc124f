"""Every environment variable fleet reads, in one place."""
from __future__ import annotations

import os


def api_key() -> str | None:
    """FLEET_API_KEY: the default of --api-key."""
    return os.environ.get("FLEET_API_KEY") or None


def cache_dir() -> str:
    """FLEET_CACHE_DIR: where fleet keeps what it derives from model files
    (GGUF metadata, converted tokenizers). Default: ~/.cache/fleet."""
    return os.environ.get("FLEET_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fleet")

"""Every environment variable fleet reads, in one place."""
from __future__ import annotations

import os


def api_key() -> str | None:
    """FLEET_API_KEY: the default of --api-key."""
    return os.environ.get("FLEET_API_KEY") or None

"""Run as a child process: imports transformers' hub-kernels integration (which
imports Hugging Face's `kernels`), then prints as JSON where each of fleet's
top-level folder names resolves as a top-level module, and whether this
interpreter runs with a safe path (-P)."""
from __future__ import annotations

import importlib.util
import json
import sys

TOP_LEVEL_NAMES = ["config", "core", "frontend", "kernels", "parallel", "workers", "scripts", "tests"]


def locations(name: str) -> list[str]:
    """Files or folders the top-level module `name` would load from ([] if none)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return []
    return [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])


def main() -> None:
    import transformers.integrations.hub_kernels  # noqa: F401  (fails when `kernels` is shadowed)

    print(json.dumps({
        "safe_path": bool(sys.flags.safe_path),
        "locations": {name: locations(name) for name in TOP_LEVEL_NAMES},
    }))


if __name__ == "__main__":
    main()

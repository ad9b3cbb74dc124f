"""The name of every fleet process: its `--name`, what `ps`, `fleet plan`
and error messages show. Formatted here only, so they always agree."""
from __future__ import annotations

API_SERVER_PREFIX = "fleet-api-"
DP_COORDINATOR = "fleet-dp-coordinator"


def api_server_name(index: int) -> str:
    return f"{API_SERVER_PREFIX}{index}"


def engine_core_name(dp_rank: int) -> str:
    return f"fleet-engine-dp{dp_rank}"


def worker_name(dp_rank: int, pp_rank: int, tp_rank: int) -> str:
    return f"fleet-worker-dp{dp_rank}-pp{pp_rank}-tp{tp_rank}"


def sandbox_name(api_server_index: int, number: int) -> str:
    """The `number`th sandbox process an API server started (frontend/sandbox.py): replaced ones count on."""
    return f"fleet-sandbox-{api_server_index}-{number}"

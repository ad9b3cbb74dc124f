"""Who may send kv_transfer_params: never a client.

They name KV to read (a transfer id), addresses for the decode instance to
connect to, and KV to hold on a prefill instance; a client that could send
them could read another request's KV, make the server connect anywhere and
fill its cache. So:
  - with --disaggregate the front end writes them itself, and a request that
    brings its own is a 400;
  - separate instances behind `fleet proxy` take them only from a request that
    carries the secret of their --kv-transfer-config (kv_connector_extra_config
    secret) in the SECRET_HEADER, which the proxy, started with the same
    secret, adds to what it forwards (and strips from what clients send it).
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers

from fleet.config.fleet import FleetConfig
from fleet.core.sampling_params import InvalidParameter

SECRET_HEADER = "fleet-kv-transfer-secret"


def secret_matches(given: str, secret: str) -> bool:
    """Constant time whatever the lengths (both are hashed first)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(secret.encode()).digest())


def check_kv_transfer_params(params: object, headers: Headers, config: FleetConfig) -> None:
    """Raise InvalidParameter unless this request may carry kv_transfer_params."""
    if params is None:
        return
    if config.parallel.disaggregation is not None:
        raise InvalidParameter("kv_transfer_params", "this server moves KV between its own replicas "
                                                     "(--disaggregate): a request may not send kv_transfer_params")
    secret = config.kv_transfer.secret if config.kv_transfer is not None else None
    if secret is None:
        raise InvalidParameter("kv_transfer_params", "this instance takes no kv_transfer_params "
                                                     "(it was started without --kv-transfer-config)")
    if not secret_matches(headers.get(SECRET_HEADER, ""), secret):
        raise InvalidParameter("kv_transfer_params", f"kv_transfer_params are taken only with the {SECRET_HEADER} "
                                                     "header that `fleet proxy --kv-transfer-secret` sends")

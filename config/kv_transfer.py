"""Prefill/decode disaggregation: what an instance's KV transfer does
(--kv-transfer-config, spelt as vLLM spells it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

KV_CONNECTORS = ("FleetConnector",)
EXTRA_KEYS = ("transfer_timeout_s", "hold_timeout_s", "max_held_fraction", "secret")
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class KVTransferConfig:
    """KV transfer between instances (--kv-transfer-config), for prefill/decode disaggregation."""

    kv_connector: str = "FleetConnector"
    """The transfer: FleetConnector (fleet's own: worker to worker over ZMQ, one message per layer of a request's blocks)."""
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    """kv_producer: a prefill instance (computes prompts and holds their KV for a decode instance to pull); kv_consumer: a decode instance (pulls a prompt's KV instead of computing it); kv_both: either, per request."""
    kv_rank: int | None = None
    """This instance's rank among the instances that exchange KV (accepted as vLLM takes it; fleet needs no group)."""
    kv_parallel_size: int = 1
    """Instances that exchange KV (accepted as vLLM takes it)."""
    kv_ip: str = "127.0.0.1"
    """Address where a producer's workers serve their KV: one a decode instance reaches (this machine's address for other nodes)."""
    kv_port: int = 0
    """First port of the producer's KV servers (worker r of replica d binds kv_port + d * replica size + r); 0: free ports."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """transfer_timeout_s (10): how long a decode instance waits for a prompt's KV before it computes the prompt itself; hold_timeout_s (120): how long a prefill instance keeps a finished prompt's KV for a decode instance that never pulls it; max_held_fraction (0.5): the most of its KV blocks a prefill instance holds for decode instances (the oldest go first, and any goes when a request needs its blocks); secret (required for separate instances, at least 16 characters): what `fleet proxy --kv-transfer-secret` sends in the fleet-kv-transfer-secret header, without which a request's kv_transfer_params are refused."""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", 10.0))

    @property
    def hold_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_timeout_s", 120.0))

    @property
    def max_held_fraction(self) -> float:
        return float(self.kv_connector_extra_config.get("max_held_fraction", 0.5))

    @property
    def secret(self) -> str | None:
        """What authenticates a request's kv_transfer_params (frontend/kv_transfer_gate.py); None: none is taken."""
        return self.kv_connector_extra_config.get("secret")

    def check(self, pipeline_parallel_size: int, executor: str) -> None:
        """ValueError naming --kv-transfer-config and what works."""
        flag = "--kv-transfer-config"
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"{flag} kv_connector {self.kv_connector!r} is not built: "
                             f"choose from {list(KV_CONNECTORS)}")
        if self.kv_parallel_size < 1 or (self.kv_rank is not None and not 0 <= self.kv_rank < self.kv_parallel_size):
            raise ValueError(f"{flag}: kv_rank {self.kv_rank} must be in [0, kv_parallel_size {self.kv_parallel_size})")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"{flag}: kv_port {self.kv_port} is not a port")
        unknown = sorted(set(self.kv_connector_extra_config) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"{flag}: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {', '.join(EXTRA_KEYS)}")
        if min(self.transfer_timeout_s, self.hold_timeout_s) <= 0:
            raise ValueError(f"{flag}: transfer_timeout_s and hold_timeout_s must be positive")
        if not 0 < self.max_held_fraction <= 1:
            raise ValueError(f"{flag}: max_held_fraction must be in (0, 1], got {self.max_held_fraction}")
        secret = self.secret
        if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS):
            raise ValueError(f"{flag}: kv_connector_extra_config secret must be a string of at least "
                             f"{MIN_SECRET_CHARS} characters")
        if pipeline_parallel_size != 1:
            raise ValueError(f"{flag} is built for one pipeline stage (tensor parallel works): "
                             f"got --pipeline-parallel-size {pipeline_parallel_size}")
        if executor == "ray":
            raise ValueError(f"{flag} is built for the mp and uni executors, not --distributed-executor-backend ray")

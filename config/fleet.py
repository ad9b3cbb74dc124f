"""FleetConfig: every resolved config of one job, as each process receives it."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from fleet.config.cache import CacheConfig
from fleet.config.compilation import CompilationConfig
from fleet.config.device import DeviceConfig
from fleet.config.frontend import FrontendConfig
from fleet.config.kv_transfer import KVTransferConfig
from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.parallel import ParallelConfig
from fleet.config.scheduler import SchedulerConfig
from fleet.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class FleetConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    kv_transfer: KVTransferConfig | None = None
    """Prefill/decode disaggregation (--kv-transfer-config); None: no KV transfer."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (--speculative-config); None: one token per request and step."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> FleetConfig:
        return msgspec.msgpack.decode(data, type=FleetConfig)

"""Typed configuration: one dataclass per concern, EngineArgs, and FleetConfig."""
from fleet.config.cache import CacheConfig
from fleet.config.compilation import CompilationConfig
from fleet.config.device import DeviceConfig
from fleet.config.engine_args import EngineArgs
from fleet.config.fleet import FleetConfig
from fleet.config.frontend import FrontendConfig
from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.parallel import ParallelConfig
from fleet.config.scheduler import SchedulerConfig

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "DeviceConfig",
    "EngineArgs",
    "FleetConfig",
    "FrontendConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
]

"""What the engine core steps its workers through; the implementations (in process,
worker processes, Ray actors) are core/launch/executor.py and ray_executor.py."""
from __future__ import annotations

from fleet.core.messages import KVCapacity, ModelRunnerOutput, SchedulerOutput


class Executor:
    kv_export_addresses: list[str] = []
    """Producer of KV (--kv-transfer-config): where each worker serves its share, by rank in the replica."""

    def start(self) -> KVCapacity:
        """Start the workers, size and allocate the KV cache; return its capacity."""
        raise NotImplementedError

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def check_alive(self) -> None:
        """Raise WorkerDied naming any worker that died (in-process workers cannot)."""

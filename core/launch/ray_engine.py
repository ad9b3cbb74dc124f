"""`--data-parallel-backend ray`: an engine core runs as a Ray actor in a
placement group of its replica's bundles, on whichever node has room; its
workers (core/launch/ray_executor.py) go in the same group. The actor's process
is the engine-core process."""
from __future__ import annotations

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.launch import processes
from fleet.parallel.ray_cluster import RayActorHandle, place_bundles


def start_engine_actor(config: FleetConfig, name: str, info_bytes: bytes) -> RayActorHandle:
    """--data-parallel-backend ray: an engine core as an actor in its own
    placement group (its replica's bundles; the engine takes no CPU of its
    own), on whichever node has room. Its workers go in the same group."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = place_bundles(config, config.parallel.replica_size)
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)
    actor = ray.remote(EngineActor).options(num_cpus=0, scheduling_strategy=strategy).remote()
    return RayActorHandle(name, actor, actor.run.remote(name, info_bytes), group)


class EngineActor:
    """The body of an engine-core actor: the actor process is the engine-core process."""

    def run(self, name: str, info: bytes) -> None:
        from fleet.core.launch.engine_process import EngineCoreProcess, EngineCoreStartupInfo

        processes.log_as(name)
        EngineCoreProcess(name, msgspec.msgpack.decode(info, type=EngineCoreStartupInfo)).run()

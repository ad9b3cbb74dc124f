"""`--distributed-executor-backend ray`: the workers of a replica are Ray
actors, placed by a placement group (one bundle per device: {"GPU": 1} on
CUDA, {"CPU": 1} here), packed on as few nodes as hold them and spread when
one node cannot.

Ray only places and starts the processes: the engine core drives the actors
with the same ZMQ + msgspec SchedulerOutput protocol as the mp executor, over TCP
because an actor may run on another node. A worker's start-up info travels
to its actor as msgpack bytes.
"""
from __future__ import annotations

import logging

import msgspec

from fleet.config import env
from fleet.config.fleet import FleetConfig
from fleet.workers.executor import (
    MultiprocExecutor,
    ReplicaAddresses,
    replica_ranks,
    worker_name,
    worker_startup_info,
)

logger = logging.getLogger(__name__)


def connect_ray(config: FleetConfig) -> None:
    """Join the cluster at --ray-address (the launcher resolves it) or
    RAY_ADDRESS from this process, once; without either (fleet.LLM), start a
    local cluster that lives as long as this process."""
    import ray

    if not ray.is_initialized():
        address = config.parallel.ray_address or env.ray_address()
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)


class RayActorHandle:
    """An actor watched and stopped like a child process (processes.ChildProcess):
    it is alive while its `run` call (the process's whole life) has not returned."""

    def __init__(self, name: str, actor, run_ref):
        self.name = name
        self.actor = actor
        self.run_ref = run_ref

    def alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.run_ref], timeout=0)
        return not done

    def describe_exit(self) -> str:
        import ray

        if self.alive():
            return f"{self.name} (Ray actor) is running"
        try:
            ray.get(self.run_ref, timeout=0)
        except Exception as error:  # noqa: BLE001 - the actor's failure, whatever it is, is the story
            return f"{self.name} (Ray actor) died: {type(error).__name__}: {str(error)[:300]}"
        return f"{self.name} (Ray actor) exited"

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)


class RayExecutor(MultiprocExecutor):
    def _tcp_bind_host(self) -> str | None:
        import ray

        return ray.util.get_node_ip_address()

    def __init__(self, config: FleetConfig, dp_rank: int):
        connect_ray(config)
        super().__init__(config, dp_rank)

    def _spawn(self, addresses: ReplicaAddresses) -> list[RayActorHandle]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = self.config.parallel
        # An engine core that is itself an actor (--data-parallel-backend ray) runs in its replica's group.
        current = ray.util.get_current_placement_group()
        self.owns_placement_group = current is None
        self.placement_group = current or place_bundles(self.config, parallel.replica_size)
        actor_class = ray.remote(WorkerActor)
        on_gpu = self.config.device.device == "cuda"
        handles = []
        for index, rank in enumerate(replica_ranks(parallel, self.dp_rank)):
            info = worker_startup_info(self.config, self.dp_rank, index, addresses)
            name = worker_name(parallel, rank)
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index)
            actor = actor_class.options(
                num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0, scheduling_strategy=strategy
            ).remote()
            handles.append(RayActorHandle(name, actor, actor.run.remote(name, msgspec.msgpack.encode(info))))
        return handles

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self._send_shutdown()
        for worker in self.workers:
            worker.kill()
        if getattr(self, "placement_group", None) is not None and self.owns_placement_group:
            remove_placement_group(self.placement_group)
        self.ctx.destroy(linger=0)


def place_bundles(config: FleetConfig, count: int):
    """A placement group of one bundle per device, packed on as few nodes as
    hold it; or a clear error naming what was asked and what is free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"GPU": 1} if config.device.device == "cuda" else {"CPU": 1}
    group = placement_group([bundle] * count, strategy="PACK")
    timeout = config.parallel.distributed_timeout_seconds
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {count} workers of {bundle} within {timeout} s "
            f"(--distributed-timeout-seconds): the cluster has {_resources(ray.available_resources())} free "
            f"of {_resources(ray.cluster_resources())}"
        ) from None
    return group


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
    return RayActorHandle(name, actor, actor.run.remote(name, info_bytes))


class EngineActor:
    """The body of an engine-core actor: the actor process is the engine-core process."""

    def run(self, name: str, info: bytes) -> None:
        from fleet.core.engine_core import EngineCoreProcess, EngineCoreStartupInfo

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name} %(message)s")
        EngineCoreProcess(name, msgspec.msgpack.decode(info, type=EngineCoreStartupInfo)).run()


class WorkerActor:
    """The body of a worker actor: the actor process is the worker process."""

    def run(self, name: str, info: bytes) -> None:
        from fleet.workers.executor import WorkerStartupInfo
        from fleet.workers.worker import serve_worker

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name} %(message)s")
        serve_worker(name, msgspec.msgpack.decode(info, type=WorkerStartupInfo))


def _resources(resources: dict) -> str:
    shown = {key: value for key, value in resources.items() if key in ("CPU", "GPU")}
    return ", ".join(f"{value:g} {key}" for key, value in sorted(shown.items())) or "nothing"


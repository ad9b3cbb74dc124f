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

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.launch import processes
from fleet.core.launch.executor import MultiprocExecutor, ReplicaAddresses, worker_startup_info
from fleet.core.launch.node_plan import EngineCorePlan, StartupFacts
from fleet.parallel.ray_cluster import RayActorHandle, connect_ray, place_bundles


class RayExecutor(MultiprocExecutor):
    def _tcp_bind_host(self) -> str | None:
        import ray

        return ray.util.get_node_ip_address()

    def __init__(self, config: FleetConfig, plan: EngineCorePlan, facts: StartupFacts):
        connect_ray(config, facts.ray_address)
        super().__init__(config, plan, facts)

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
        for index, worker in enumerate(self.plan.workers):
            info = worker_startup_info(self.config, worker, addresses)
            name = worker.name
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


class WorkerActor:
    """The body of a worker actor: the actor process is the worker process."""

    def run(self, name: str, info: bytes) -> None:
        from fleet.core.launch.worker_process import WorkerStartupInfo, serve_worker

        processes.log_as(name)
        serve_worker(name, msgspec.msgpack.decode(info, type=WorkerStartupInfo))

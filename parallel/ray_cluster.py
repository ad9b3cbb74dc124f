"""fleet's side of a Ray cluster: joining it, placing bundles (one per
device) in a placement group, and watching an actor as if it were a child
process. What runs in the actors is the engine core's (core/launch/ray_engine.py)
and the workers' (core/launch/ray_executor.py)."""
from __future__ import annotations

import logging

from fleet.config import env
from fleet.config.fleet import FleetConfig


def connect_ray(config: FleetConfig, resolved_address: str | None = None) -> None:
    """Join the cluster the launcher resolved (`resolved_address`), else
    --ray-address or RAY_ADDRESS, once; without any (fleet.LLM), start a
    local cluster that lives as long as this process."""
    import ray

    if not ray.is_initialized():
        address = resolved_address or config.parallel.ray_address or env.ray_address()
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)


class RayActorHandle:
    """An actor watched and stopped like a child process (processes.ChildProcess):
    it is alive while its `run` call (the process's whole life) has not returned."""

    def __init__(self, name: str, actor, run_ref, placement_group=None):
        self.name = name
        self.actor = actor
        self.run_ref = run_ref
        self.placement_group = placement_group
        """The group it was placed in, when this handle's owner made it for this actor alone."""

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

    def release(self) -> None:
        """Free the placement group made for it, once it died (its replica is restarted in a new one)."""
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def wait(self, timeout: float) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)


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


def _resources(resources: dict) -> str:
    shown = {key: value for key, value in resources.items() if key in ("CPU", "GPU")}
    return ", ".join(f"{value:g} {key}" for key, value in sorted(shown.items())) or "nothing"

"""`fleet launch`: start this node's processes, run the start-up handshake
under one deadline, then supervise. A dead data-parallel replica is started
again while the others serve, as --replica-restart-policy and
--max-replica-restarts allow (core/launch/replica_restarts.py); any other death, or
(multi-node) the loss of another node, tears the node down and exits
non-zero; SIGINT/SIGTERM shut down within --shutdown-timeout."""
from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from fleet.config import env
from fleet.config.fleet import FleetConfig
from fleet.core import ipc
from fleet.core.launch import processes
from fleet.core.launch.dp_coordinator import CoordinatorStartupInfo
from fleet.core.launch.engine_launch import start_engine_cores, start_workers_of_remote_engines
from fleet.core.launch.node_plan import APIServerPlan, CoordinatorPlan, NodePlan, StartupFacts
from fleet.core.launch.process_names import API_SERVER_PREFIX
from fleet.core.launch.replica_restarts import ReplicaRestarts, RestartRefused

if TYPE_CHECKING:
    from fleet.core.launch.job_store import JobStore
    from fleet.core.launch.node_watch import Heartbeat


logger = logging.getLogger("fleet.launch")

SUPERVISE_INTERVAL_S = 0.2



class APIServerStartupInfo(msgspec.Struct):
    config: FleetConfig
    plan: APIServerPlan
    listen_fd: int
    """The HTTP socket the launcher bound, shared by every API server."""
    handshake_address: str


class Launcher:
    def __init__(self, config: FleetConfig, plan: NodePlan):
        self.config = config
        self.plan = plan
        self.facts = StartupFacts()
        """What start-up learns (the Ray cluster, a bound store port), for the children started after."""
        self.children: list[processes.ChildProcess] = []
        self.stop_requested: str | None = None
        self.url = "(headless: no HTTP)"
        self.job: JobStore | None = None
        """The multi-node job store (--nnodes > 1)."""
        self.heartbeat: Heartbeat | None = None

    def run(self) -> int:
        """Start, supervise, stop; the exit code of `fleet launch`."""
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        start = time.monotonic()
        self._say_what_starts()
        try:
            self._start()
        except (processes.ChildFailed, processes.StartupTimeout, processes.NodeMissing, OSError) as error:
            logger.error("start-up failed: %s", error)
            self._tell_other_nodes(f"start-up failed: {error}")
            self._stop_all(timeout=2.0)
            return 1
        elapsed = time.monotonic() - start
        logger.info("serving %s on %s (ready in %.1f s)", self.config.model.served_model_name, self.url, elapsed)
        return self._supervise()

    def _say_what_starts(self) -> None:
        model, plan = self.config.model, self.plan
        workers = sum(len(engine.workers) for engine in plan.engine_cores) + len(plan.workers_of_remote_engines)
        logger.info("starting %s (%s, %s, context %d): %d API server(s), %d engine core(s), %d worker(s)%s",
                    model.model, model.architecture, model.dtype, model.max_model_len, len(plan.api_servers),
                    len(plan.engine_cores), workers, " and the DP coordinator" if plan.dp_coordinator else "")

    def _start(self) -> None:
        if self.config.parallel.nnodes > 1:
            self.job = self._join_job()
        parallel = self.config.parallel
        if "ray" in (parallel.distributed_executor_backend, parallel.data_parallel_backend):
            self._join_ray()
        ctx = zmq.Context()
        # Engine actors placed by Ray may run on another machine: they report over TCP.
        ray_engines = parallel.data_parallel_backend == "ray"
        tcp_host = parallel.data_parallel_address if ray_engines else None
        handshake = processes.HandshakeListener(ctx, tcp_host)
        try:
            if self.plan.dp_coordinator is not None:
                self._start_coordinator(self.plan.dp_coordinator, handshake)
            self._start_api_servers_and_engines(handshake)
        finally:
            handshake.close()
            ctx.destroy(linger=0)

    def _join_job(self) -> JobStore:
        from fleet.core.launch import node_watch  # imports torch: multi-node launches only
        from fleet.core.launch.job_store import JobStore

        parallel = self.config.parallel
        role = "serves HTTP" if not parallel.headless else "headless"
        logger.info("node %d of %d (%s): meeting at %s:%d", parallel.node_rank, parallel.nnodes, role,
                    parallel.master_addr, parallel.master_port)
        job = JobStore.for_launcher(parallel)
        node_watch.join(job)
        self.heartbeat = node_watch.Heartbeat(JobStore.client(parallel))
        return job

    def _tell_other_nodes(self, failure: str) -> None:
        """Multi-node launches: node 0 need not wait for this node's silence."""
        if self.job is not None:
            from fleet.core.launch import node_watch

            node_watch.report_failure(self.job, failure)

    def _join_ray(self) -> None:
        """Join the Ray cluster (--ray-address, else RAY_ADDRESS), or start a
        local one that lives as long as this launch; engines join the same."""
        import ray  # the optional dependency: pip install fleet[ray]

        parallel = self.config.parallel
        address = parallel.ray_address or env.ray_address()
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except Exception as error:  # Ray raises several kinds; all mean the same to the user
            where = "a new local cluster"
            if address:
                where = f"the Ray cluster at {address!r} (--ray-address / RAY_ADDRESS)"
            raise ConnectionError(f"could not join {where}: {type(error).__name__}: {error}") from error
        for signum in (signal.SIGTERM, signal.SIGINT):  # ray.init installs its own: ours stop gracefully
            signal.signal(signum, self._request_stop)
        resolved = ray.get_runtime_context().gcs_address
        logger.info("Ray cluster at %s (%s)", resolved, "joined" if address else "started for this launch")
        self.facts = msgspec.structs.replace(self.facts, ray_address=resolved)

    def _start_coordinator(self, plan: CoordinatorPlan, handshake: processes.HandshakeListener) -> None:
        """Start the DP coordinator first: lock-step workers need the port of
        the store it hosts, which it may bind only now."""
        child = processes.spawn("fleet.core.launch.dp_coordinator", plan.name,
                                CoordinatorStartupInfo(self.config, handshake.address, plan))
        self.children.append(child)
        ready = handshake.wait_all([child], self.config.parallel.distributed_timeout_seconds)[child.name]
        self.facts = msgspec.structs.replace(self.facts, store_port=int(ready.addresses["store_port"]))

    def _start_api_servers_and_engines(self, handshake: processes.HandshakeListener) -> None:
        config, frontend = self.config, self.config.frontend
        http = ipc.listening_socket(frontend.host, frontend.port) if self.plan.api_servers else None
        if http is not None:  # --port 0 binds any free port: say which
            self.url = f"http://{frontend.host}:{http.getsockname()[1]}"
        started: list[processes.ChildProcess] = []
        for plan in self.plan.api_servers:
            info = APIServerStartupInfo(config, plan, http.fileno(), handshake.address)
            started.append(processes.spawn("fleet.frontend.api_server", plan.name, info, pass_fds=(http.fileno(),)))
        started.extend(start_engine_cores(config, self.plan.engine_cores, handshake.address, self.facts))
        self.children.extend(started)
        self.children.extend(start_workers_of_remote_engines(config, self.plan.workers_of_remote_engines, self.job))
        ready = handshake.wait_all(started, config.parallel.distributed_timeout_seconds)
        if http is not None:
            http.close()  # the API servers hold their own copies
        for message in ready.values():
            if message.kv_capacity is not None:
                capacity = message.kv_capacity
                concurrency = capacity.num_tokens / config.model.max_model_len
                logger.info("%s (pid %d): KV cache %d tokens (%.2fx concurrency at %d tokens)", message.name,
                            message.pid, capacity.num_tokens, concurrency, config.model.max_model_len)

    def _supervise(self) -> int:
        restarts = ReplicaRestarts(self.config, self.plan.engine_cores, self.facts)
        try:
            while self.stop_requested is None:
                failure = self._watch(restarts)
                if failure is not None:
                    self._tell_other_nodes(failure)
                    return self._stop_after(failure)
                if self.heartbeat is not None and self.heartbeat.lost is not None:
                    return self._stop_after(str(self.heartbeat.lost))
                time.sleep(SUPERVISE_INTERVAL_S)
        finally:
            restarts.close()
        logger.info("%s: shutting down", self.stop_requested)
        self._stop_all(timeout=self.config.frontend.shutdown_timeout)
        return 0

    def _watch(self, restarts: ReplicaRestarts) -> str | None:
        """The failure that ends the job, if any. A dead replica whose restart
        the policy and budget allow is handed to `restarts`, and its engine
        core, started again, watched as before."""
        dead = [child for child in self.children if not child.alive()]
        if any(not restarts.handles(child) for child in dead):
            return "; ".join(child.describe_exit() for child in dead)
        try:
            for child in dead:
                self.children.remove(child)
                restarts.replica_died(child)
            self.children.extend(restarts.poll())
        except RestartRefused as refused:
            return str(refused)
        return None

    def _stop_after(self, failure: str) -> int:
        logger.error("%s: shutting the node down", failure)
        self._stop_all(timeout=2.0, engines_first=True)
        return 1

    def _request_stop(self, signum: int, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def _stop_all(self, timeout: float, engines_first: bool = False) -> None:
        """Graceful (SIGTERM): the API servers first, with `timeout` to finish
        the requests they hold (the engines must live for that), then the
        rest. After a failure (`engines_first`): the engines first, so that
        the API servers see them gone and fail what is in flight with an
        error instead of leaving it hanging. SIGKILL whatever is left 2 s
        after its SIGTERM."""
        api_servers = [child for child in self.children if child.name.startswith(API_SERVER_PREFIX)]
        others = [child for child in self.children if child not in api_servers]
        order = ((others, 2.0), (api_servers, timeout)) if engines_first else ((api_servers, timeout), (others, 2.0))
        for group, grace in order:
            for child in group:
                if child.alive():
                    child.terminate()
            processes.stop_all(group, grace)


def launch(config: FleetConfig, plan: NodePlan) -> int:
    """Execute `plan`, this node's part of the job `config` describes."""
    processes.log_as("fleet-launch")
    return Launcher(config, plan).run()

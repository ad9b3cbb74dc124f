"""How one job is spread over processes, devices and nodes."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from fleet.config.fields import RESOLVED

logger = logging.getLogger(__name__)


MULTI_NODE_MASTER_PORT = 29501
"""--master-port of a job of several launches (nodes, or hybrid/external load balancing) that names none:
every launch must agree, so no free port is picked."""


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: tensor, pipeline, data and expert parallel, nodes and load balancing."""

    tensor_parallel_size: int = 1
    """Number of tensor-parallel workers per pipeline stage: each holds a slice of every layer."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages: the layers are split evenly across them."""
    data_parallel_size: int = 1
    """Number of data-parallel replicas (engine cores) in the whole job, over all nodes."""
    data_parallel_size_local: int | None = None
    """Number of data-parallel replicas that run on this node. Unset: derived from --nnodes, or all of them."""
    data_parallel_rank: int | None = None
    """Rank of the one replica this launch runs; setting it selects external load balancing."""
    data_parallel_start_rank: int | None = None
    """Rank of the first replica on this node; above 0, with --data-parallel-size-local, it selects hybrid load
    balancing (the launch of start rank 0 passes --data-parallel-hybrid-lb, as with vLLM)."""
    data_parallel_address: str | None = None
    """Address of the node that runs data-parallel rank 0, where the others connect. Default: --master-addr."""
    data_parallel_rpc_port: int = 29550
    """Port on --data-parallel-address where launches of one job find each other."""
    data_parallel_hybrid_lb: bool = False
    """Hybrid load balancing: every node runs its own API servers, which balance only over that node's replicas."""
    data_parallel_external_lb: bool = False
    """External load balancing: every launch runs one replica and its API server; a balancer outside fleet spreads the requests."""
    data_parallel_routing: Literal["least-loaded", "cache-aware", "round-robin"] = "cache-aware"
    """How API servers pick the replica of each request: cache-aware (the one believed to hold the longest prefix of
    its prompt in its prefix cache, unless it is much busier than the least loaded), least-loaded (the fewest
    unfinished requests) or round-robin (in turn)."""
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    """How engine cores are started: local processes (mp) or Ray actors (ray)."""
    distributed_executor_backend: Literal["uni", "mp", "ray"] = "mp"
    """How workers are started: inside the engine-core process (uni, one worker only), as processes (mp) or as Ray actors (ray)."""
    ray_address: str | None = None
    """Ray cluster to join with a Ray backend (default: RAY_ADDRESS; without either, a local cluster is started)."""
    enable_expert_parallel: bool = False
    """Split the experts of MoE layers across all data- and tensor-parallel ranks of a stage instead of slicing each expert."""
    nnodes: int = 1
    """Number of machines the job spans."""
    node_rank: int = 0
    """Rank of this machine among --nnodes (0 runs the API servers with internal load balancing)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where torch.distributed meets."""
    master_port: int | None = None
    """Port on --master-addr for torch.distributed. Unset: a free port bound at start-up by a single launch, 29501 when several launches make the job."""
    headless: bool = False
    """Run engines and workers only, no API server (the other nodes of an internal-LB job)."""
    distributed_timeout_seconds: int = 300
    """How long a node waits for the others (and every process for its peers) before it gives up."""
    replica_restart_policy: Literal["never", "always", "on-failure"] = "on-failure"
    """When a data-parallel replica whose engine core or worker died is restarted while the others serve:
    on-failure when another replica of this node serves meanwhile, always (a lone replica too), or never (any
    death ends the job). Single-node launches with the mp backends; MoE with expert parallel never."""
    max_replica_restarts: int = 5
    """Replica restarts allowed in any 10 minutes; the death past them ends the job."""
    engine_step_timeout: float = 300.0
    """Seconds a replica's step may take before its workers count as hung and the replica as dead."""
    disaggregate: str | None = None
    """prefill=N,decode=M[,min_prompt_tokens=256]: N + M data-parallel replicas behind one front end, which sends each request's prompt to a prefill replica and its decoding, with the prompt's KV, to a decode replica (prefill/decode disaggregation; implies --kv-transfer-config kv_role kv_both). Prompts shorter than min_prompt_tokens go to a decode replica alone, which computes them (they stall its decodes less than a transfer costs them)."""
    is_moe: bool = field(default=False, metadata=RESOLVED)
    """Resolved from the model: whether it has mixture-of-experts layers."""

    @property
    def world_size(self) -> int:
        """Workers in the whole job: data x pipeline x tensor parallel."""
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def replica_size(self) -> int:
        """Workers in one data-parallel replica: pipeline x tensor parallel."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def world_size_local(self) -> int:
        """Workers that run on this node."""
        return self.world_size // self.nnodes

    @property
    def expert_parallel_size(self) -> int:
        """Ranks that share the experts of one stage (1 when expert parallel is off)."""
        if not self.enable_expert_parallel:
            return 1
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def disaggregation(self) -> Disaggregation | None:
        """--disaggregate's replicas and prompt threshold; None without."""
        return None if self.disaggregate is None else _disaggregation_sizes(self.disaggregate)

    def prefill_ranks(self) -> list[int]:
        """The data-parallel ranks that compute prompts (--disaggregate); [] without."""
        return list(range(self.disaggregation[0])) if self.disaggregation else []

    @property
    def internal_lb(self) -> bool:
        """Internal load balancing: one front end (node 0's API servers) reaches every engine of the job."""
        return not (self.data_parallel_hybrid_lb or self.data_parallel_external_lb)

    @property
    def replicas_step_together(self) -> bool:
        """Whether the data-parallel replicas form one world and step in
        lock-step: expert-parallel collectives of a MoE model span them."""
        return self.is_moe and self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def restarts_replicas(self) -> bool:
        """Whether a dead replica is restarted while the others serve (--replica-restart-policy),
        and, in a multi-node job, whether node 0 serves on when another node is lost. Not with
        lock-step replicas (a death breaks every replica's collectives), nor replicas that span nodes."""
        if self.replica_restart_policy == "never" or self.replicas_step_together:
            return False
        if self.nnodes > 1 and (self.world_size_local < self.replica_size or self.world_size_local % self.replica_size):
            return False
        replicas_behind_one_front_end = self.data_parallel_size if self.internal_lb else self.data_parallel_size_local
        return self.replica_restart_policy == "always" or (replicas_behind_one_front_end or 1) > 1

    def as_dict(self) -> dict:
        """Every field plus the derived sizes, as plain data (for `fleet plan`)."""
        data = dataclasses.asdict(self)
        for name in ("world_size", "world_size_local", "replica_size", "expert_parallel_size", "replicas_step_together",
                     "restarts_replicas"):
            data[name] = getattr(self, name)
        return data

    def resolve(self, is_moe: bool) -> ParallelConfig:
        """Resolve load-balancing mode and this node's data-parallel ranks.

        The rules are vLLM's (`create_engine_config`), so that users can move
        their multi-node command lines between the two. Raises ValueError
        naming the flags of any inconsistency.
        """
        if self.disaggregate is not None:
            self = _with_disaggregation(self)
        _check_sizes(self)
        if self.data_parallel_hybrid_lb and self.data_parallel_external_lb:
            raise ValueError("--data-parallel-hybrid-lb and --data-parallel-external-lb cannot both be set")
        if self.data_parallel_hybrid_lb and self.headless:
            raise ValueError("--data-parallel-hybrid-lb does not apply with --headless (a headless node serves no HTTP)")
        if self.nnodes > 1 and self.data_parallel_backend == "ray":
            raise ValueError("--nnodes > 1 is only supported with --data-parallel-backend mp (Ray places the engines itself)")

        local_size = self.data_parallel_size_local
        rank = self.data_parallel_rank
        inferred_rank = 0
        if self.nnodes > 1:
            inferred_rank = (self.node_rank * self.world_size_local) // self.replica_size
            if self.data_parallel_size > 1 and self.data_parallel_external_lb:
                rank = inferred_rank
            elif local_size is None:
                local_size = max(self.world_size_local // self.replica_size, 1)

        external = self.data_parallel_external_lb or rank is not None
        hybrid = self.data_parallel_hybrid_lb
        if self.data_parallel_size > 1 and external and not is_moe:
            raise ValueError(
                "--data-parallel-rank / --data-parallel-external-lb need a MoE model when --data-parallel-size > 1: "
                "for a dense model launch independent servers without --data-parallel-* flags"
            )
        if external:
            if local_size not in (1, None):
                raise ValueError(
                    f"--data-parallel-size-local must be 1 or unset with external load balancing "
                    f"(--data-parallel-rank / --data-parallel-external-lb), got {local_size}"
                )
            if rank is None:  # vLLM asserts the same: a lone launch cannot guess which replica it is
                raise ValueError(
                    "--data-parallel-external-lb needs --data-parallel-rank on a single node "
                    "(or --nnodes and --node-rank, from which the rank is inferred)"
                )
            local_size, hybrid = 1, False
        elif local_size is not None:
            # A start rank above 0 makes this launch one of several front ends. As in vLLM,
            # the first launch (start rank 0) of a hybrid job says so with --data-parallel-hybrid-lb.
            if self.data_parallel_start_rank and not self.headless:
                hybrid = True
            if hybrid and local_size == 1:
                logger.warning("hybrid load balancing with --data-parallel-size-local 1 is external load balancing; switching")
                external, hybrid = True, False
            if local_size == self.data_parallel_size:
                hybrid = False
            rank = self.data_parallel_start_rank or inferred_rank
        else:
            if hybrid:
                raise ValueError("--data-parallel-hybrid-lb needs --data-parallel-size-local")
            local_size = self.data_parallel_size
            rank = 0

        headless = self.headless
        several_launches = self.nnodes > 1 or local_size < self.data_parallel_size
        if self.nnodes > 1 and self.node_rank > 0 and not (external or hybrid) and not headless:
            logger.info("node rank %d of an internal-LB job runs headless: node 0 serves HTTP", self.node_rank)
            headless = True
        resolved = dataclasses.replace(
            self,
            headless=headless,
            data_parallel_size_local=local_size,
            data_parallel_rank=rank,
            data_parallel_start_rank=rank,
            data_parallel_external_lb=external,
            data_parallel_hybrid_lb=hybrid,
            data_parallel_address=self.data_parallel_address or self.master_addr,
            master_port=self.master_port if self.master_port is not None or not several_launches else MULTI_NODE_MASTER_PORT,
            is_moe=is_moe,
        )
        _check_ranks(resolved)
        return resolved


class Disaggregation(NamedTuple):
    prefill: int
    """Replicas that compute prompts (data-parallel ranks 0 .. prefill - 1)."""
    decode: int
    """Replicas that decode (the ranks after them)."""
    min_prompt_tokens: int
    """Shorter prompts are computed by the decode replica itself: moving them costs more than they stall."""


DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS = 256


def _disaggregation_sizes(text: str) -> Disaggregation:
    """"prefill=N,decode=M[,min_prompt_tokens=K]"; ValueError naming the flag."""
    sizes: dict[str, int] = {}
    parts = text.split(",")
    for part in parts:
        name, _, value = part.partition("=")
        if name.strip() in ("prefill", "decode", "min_prompt_tokens") and value.strip().isdigit():
            sizes[name.strip()] = int(value)
    if len(sizes) != len(parts) or not {"prefill", "decode"} <= set(sizes) or min(sizes["prefill"], sizes["decode"]) < 1:
        raise ValueError(f"--disaggregate takes prefill=N,decode=M[,min_prompt_tokens=K] with N, M >= 1, got {text!r}")
    return Disaggregation(sizes["prefill"], sizes["decode"],
                          sizes.get("min_prompt_tokens", DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS))


def _with_disaggregation(config: ParallelConfig) -> ParallelConfig:
    """The replicas --disaggregate asks for, on one node behind one front end."""
    prefill, decode, _ = _disaggregation_sizes(config.disaggregate)
    if config.data_parallel_size not in (1, prefill + decode):
        raise ValueError(f"--disaggregate {config.disaggregate} makes {prefill + decode} replicas: "
                         f"leave out --data-parallel-size {config.data_parallel_size}")
    conflicts = [flag for flag, value in (
        ("--nnodes", config.nnodes > 1), ("--data-parallel-hybrid-lb", config.data_parallel_hybrid_lb),
        ("--data-parallel-external-lb", config.data_parallel_external_lb),
        ("--data-parallel-rank", config.data_parallel_rank is not None),
        ("--data-parallel-size-local", config.data_parallel_size_local is not None),
        ("--enable-expert-parallel", config.enable_expert_parallel),
        ("--data-parallel-backend ray", config.data_parallel_backend == "ray")) if value]
    if conflicts:
        raise ValueError(f"--disaggregate runs its replicas on one node behind one front end: "
                         f"it does not combine with {', '.join(conflicts)} (use fleet proxy across launches)")
    return dataclasses.replace(config, data_parallel_size=prefill + decode)


def _check_sizes(config: ParallelConfig) -> None:
    for flag, value in (
        ("--tensor-parallel-size", config.tensor_parallel_size),
        ("--pipeline-parallel-size", config.pipeline_parallel_size),
        ("--data-parallel-size", config.data_parallel_size),
        ("--nnodes", config.nnodes),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if config.world_size % config.nnodes:
        raise ValueError(
            f"world size {config.world_size} (--data-parallel-size {config.data_parallel_size} x "
            f"--pipeline-parallel-size {config.pipeline_parallel_size} x --tensor-parallel-size "
            f"{config.tensor_parallel_size}) must be divisible by --nnodes {config.nnodes}"
        )
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"--node-rank {config.node_rank} must be in [0, --nnodes {config.nnodes})")
    if config.max_replica_restarts < 0:
        raise ValueError(f"--max-replica-restarts must be at least 0, got {config.max_replica_restarts}")
    if not config.engine_step_timeout > 0:
        raise ValueError(f"--engine-step-timeout must be above 0 seconds, got {config.engine_step_timeout}")
    if config.distributed_executor_backend == "uni" and config.replica_size > 1:
        raise ValueError(
            f"--distributed-executor-backend uni runs one worker, but a replica has {config.replica_size} "
            "(--tensor-parallel-size x --pipeline-parallel-size); use mp or ray"
        )


def _check_ranks(config: ParallelConfig) -> None:
    local, rank, size = config.data_parallel_size_local, config.data_parallel_rank, config.data_parallel_size
    assert local is not None and rank is not None
    if not 1 <= local <= size:
        raise ValueError(f"--data-parallel-size-local {local} must be in [1, --data-parallel-size {size}]")
    if not 0 <= rank or rank + local > size:
        raise ValueError(
            f"data-parallel ranks {rank}..{rank + local - 1} of this node (--data-parallel-rank / "
            f"--data-parallel-start-rank, --data-parallel-size-local) exceed --data-parallel-size {size}"
        )

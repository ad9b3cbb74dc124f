"""MoE models over several ranks: experts sliced over tensor parallel, or split
whole over expert parallel, give transformers' greedy tokens; FusedMoE's
data-parallel dispatch (replicas with different token counts, zero included)
matches a single-rank run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fleet
from fleet import SamplingParams
from fleet.config.parallel import ParallelConfig
from fleet.kernels.moe import fused_moe, select_experts
from fleet.parallel import comm
from fleet.parallel.dims import WorkerCoord, coord_of, parallel_groups
from fleet.parallel.moe import ExpertShard, FusedMoE
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.tiny_models import MOE_DIMS, write_tiny_model

pytestmark = pytest.mark.slow

# (model, tensor parallel, pipeline parallel, expert parallel)
LAYOUTS = [
    ("tiny_mixtral_dir", 2, 1, False),
    ("tiny_mixtral_dir", 2, 1, True),  # EP group = the 2 TP ranks: 4 experts each
    ("tiny_mixtral_dir", 1, 2, False),
    ("tiny_qwen2_moe_dir", 2, 1, False),
    ("tiny_qwen2_moe_dir", 2, 1, True),
    ("tiny_qwen3_moe_dir", 1, 2, False),  # tp 2: over HTTP (test_architectures_over_http.py)
]


@pytest.mark.parametrize("model_fixture,tp,pp,ep", LAYOUTS)
def test_greedy_matches_transformers(request, model_fixture, tp, pp, ep):
    model_dir = str(request.getfixturevalue(model_fixture))
    oracle = hf_model(model_dir)
    prompts = random_prompts(3, oracle.config.vocab_size, seed=tp * 10 + pp + ep, max_len=24)
    with fleet.LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="2M", tensor_parallel_size=tp,
                   pipeline_parallel_size=pp, enable_expert_parallel=ep, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, min_tokens=5), use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == greedy(oracle, prompt, 5)
        assert_all_blocks_free(llm)
    assert_no_fleet_processes()


def test_experts_that_do_not_divide_over_expert_parallel_are_refused(tmp_path):
    model_dir = str(write_tiny_model(tmp_path / "mixtral3", "mixtral", seed=5, num_local_experts=3, **MOE_DIMS))
    # Refused by create_config, before any process starts.
    with pytest.raises(ValueError, match=r"--enable-expert-parallel: the model's 3 experts must divide over the "
                       r"expert-parallel size 2 \(--data-parallel-size 1 x --tensor-parallel-size 2\)"):
        fleet.LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="2M", tensor_parallel_size=2,
                  enable_expert_parallel=True)
    assert_no_fleet_processes()


# ---- FusedMoE across data-parallel replicas, in-process ranks over gloo ---------------------

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 12
STEPS = [(5, 0), (0, 0), (3, 7), (0, 4), (1, 1)]
"""Token counts of replicas 0 and 1 at each step."""


def _checkpoint() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    return {"router": randn(NUM_EXPERTS, HIDDEN), "gate": randn(NUM_EXPERTS, INTER, HIDDEN),
            "up": randn(NUM_EXPERTS, INTER, HIDDEN), "down": randn(NUM_EXPERTS, HIDDEN, INTER)}


def _tokens(step: int, replica: int, count: int) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(100 * step + replica))


def _reference(hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    w13 = torch.cat([weights["gate"], weights["up"]], dim=1)
    topk_weights, topk_ids = select_experts(hidden @ weights["router"].T, TOP_K, renormalize=True)
    return fused_moe(hidden, w13, weights["down"], topk_weights, topk_ids)


def _join_groups(config: ParallelConfig, rank: int) -> None:
    groups = parallel_groups(config)
    for ranks_of_groups, setter in ((groups.tp, comm.set_tp_group), (groups.dp, comm.set_dp_group),
                                    (groups.ep, comm.set_ep_group)):
        for ranks in ranks_of_groups:
            group = dist.new_group(ranks)  # collective: every rank creates every group
            if rank in ranks:
                setter(comm.GroupCoordinator(ranks.index(rank), len(ranks), group))


def _rank_main(rank: int, config: ParallelConfig, store_file: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=60))
    try:
        _join_groups(config, rank)
        coord: WorkerCoord = coord_of(config, rank)
        moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True, dtype=torch.float32)
        assert moe.num_local_experts == NUM_EXPERTS // config.expert_parallel_size
        weights = _checkpoint()
        for expert in range(NUM_EXPERTS):
            for projection, param in (("gate", moe.w13), ("up", moe.w13), ("down", moe.w2)):
                moe.weight_loader(param, weights[projection][expert], ExpertShard(expert, projection))
        for step, counts in enumerate(STEPS):
            hidden = _tokens(step, coord.dp, counts[coord.dp])
            out = moe(hidden, hidden @ weights["router"].T)
            assert out.shape == hidden.shape, (rank, step, out.shape)
            torch.testing.assert_close(out, _reference(hidden, weights), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallel_across_data_parallel_replicas(tmp_path, tp):
    """DP=2 replicas x TP ranks form one EP group; each replica's tokens come
    back right whatever the other's count, and a step where no replica has a
    token runs no expert collective at all (a mismatch would time out)."""
    config = _dp2_config(tp)
    assert config.expert_parallel_size == 2 * tp
    # Plain subprocesses: multiprocessing would leave its resource tracker behind.
    ranks = [
        subprocess.Popen(
            [sys.executable, "-P", "-c", RANK_MAIN, str(rank), str(tp), os.fspath(tmp_path / "store")]
        )
        for rank in range(config.world_size)
    ]
    codes = [rank.wait(timeout=120) for rank in ranks]
    assert codes == [0] * config.world_size


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_MAIN = (
    "import sys; from fleet.tests.parallel.test_moe_parallel import _rank_main_cli; _rank_main_cli(*sys.argv[1:])"
)


def _dp2_config(tp: int) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=2, tensor_parallel_size=tp, enable_expert_parallel=True)


def _rank_main_cli(rank: str, tp: str, store_file: str) -> None:
    _rank_main(int(rank), _dp2_config(int(tp)), store_file)

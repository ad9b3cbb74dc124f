"""The node's memory plan on the CPU (fleet.core.launch.memory): one budget for
the node, divided among its local workers, no more KV cache than the launch
can use, and clear errors naming the flags when it cannot fit."""
from __future__ import annotations

import pytest

from fleet.config import EngineArgs, FleetConfig
from fleet.core.launch.memory import (
    COMPILED_DECODE_BYTES,
    KV_SHARE_OF_NODE,
    blocks_per_sequence,
    check_fits,
    kv_bytes_per_block,
    node_memory,
    usable_kv_cache_bytes,
    worker_weight_bytes,
)
from fleet.core.launch.plan import build_node_plan, describe
from fleet.tests.config.plan_json import of_kind

GiB = 2**30
NODE = 24 * GiB
"""The machine the issue names: 2 cores, 24 GiB."""


def create(model, **fields) -> FleetConfig:
    return EngineArgs(model=str(model), device="cpu", **fields).create_config()


def test_the_node_budget_is_divided_among_its_workers(llama_config_dir):
    config = create(llama_config_dir, tensor_parallel_size=2, data_parallel_size=2, max_num_seqs=100_000)
    plan = node_memory(config, node_bytes=NODE)
    assert plan.num_workers == 4
    assert plan.kv_cache_source == "the node's share"
    assert plan.worker.kv_cache == pytest.approx(KV_SHARE_OF_NODE * NODE / 4, rel=1e-6)
    assert plan.footprint <= config.cache.gpu_memory_utilization * NODE


def test_no_more_kv_cache_than_the_launch_can_use(llama_config_dir):
    config = create(llama_config_dir, max_num_seqs=8, max_model_len=256)
    plan = node_memory(config, node_bytes=NODE)
    assert plan.kv_cache_source == "--max-num-seqs x --max-model-len"
    assert plan.worker.kv_cache == 8 * blocks_per_sequence(config) * kv_bytes_per_block(config)
    assert plan.worker.kv_cache == usable_kv_cache_bytes(config)


def test_a_compiled_decode_step_counts_in_each_workers_runtime(llama_config_dir):
    eager = node_memory(create(llama_config_dir, tensor_parallel_size=2), node_bytes=NODE)
    compiled = node_memory(create(llama_config_dir, tensor_parallel_size=2,
                                  compilation_config={"mode": "torch_compile"}), node_bytes=NODE)
    assert compiled.worker.runtime == eager.worker.runtime + COMPILED_DECODE_BYTES
    assert compiled.footprint == eager.footprint + 2 * COMPILED_DECODE_BYTES  # the KV caches are the same


def test_eight_workers_of_tp4_dp2_fit_a_24_gib_node(llama_config_dir):
    config = create(llama_config_dir, tensor_parallel_size=4, data_parallel_size=2, max_num_seqs=100_000)
    plan = node_memory(config, node_bytes=NODE)
    assert plan.num_workers == 8
    assert plan.footprint <= 0.9 * NODE
    check_fits(plan, free_bytes=int(0.95 * NODE))


def test_the_kv_block_holds_each_workers_shard(llama_config_dir):
    """2 layers, 2 KV heads of 16 dims, float32: tp=2 halves the heads, pp=2 the layers."""
    one = kv_bytes_per_block(create(llama_config_dir, dtype="float32"))
    assert one == 2 * 16 * 2 * 16 * 2 * 4
    assert kv_bytes_per_block(create(llama_config_dir, dtype="float32", tensor_parallel_size=2)) == one // 2
    assert kv_bytes_per_block(create(llama_config_dir, dtype="float32", pipeline_parallel_size=2)) == one // 2
    # 2 KV heads over 4 ranks: each rank keeps one replicated head.
    assert kv_bytes_per_block(create(llama_config_dir, dtype="float32", tensor_parallel_size=4)) == one // 2


def test_a_sequence_that_does_not_fit_names_the_flags(llama_config_dir):
    config = create(llama_config_dir)
    with pytest.raises(ValueError, match="--max-model-len .*--tp, --pp, --dp.*--kv-cache-memory-bytes"):
        node_memory(config, node_bytes=4 * 2**20)


def test_a_too_small_kv_cache_flag_names_it(llama_config_dir):
    config = create(llama_config_dir, kv_cache_memory_bytes=1024)
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes 1.00 KiB holds less than one sequence"):
        node_memory(config, node_bytes=NODE)


def test_the_flag_sets_each_workers_kv_cache(llama_config_dir):
    config = create(llama_config_dir, kv_cache_memory_bytes="64M", tensor_parallel_size=2)
    plan = node_memory(config, node_bytes=NODE)
    assert plan.worker.kv_cache == 64 * 2**20 and plan.kv_cache_source == "--kv-cache-memory-bytes"


def test_a_launch_that_does_not_fit_the_free_memory_names_the_flags(llama_config_dir):
    plan = node_memory(create(llama_config_dir, kv_cache_memory_bytes="8G", data_parallel_size=2), node_bytes=NODE)
    with pytest.raises(ValueError, match=r"needs 1[0-9]\.\d\d GiB .* but 4.00 GiB is free.*--kv-cache-memory-bytes"):
        check_fits(plan, free_bytes=4 * GiB)


def test_fleet_plan_shows_each_workers_budget(llama_config_dir):
    config = create(llama_config_dir, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    plan = describe(config, build_node_plan(config))
    workers = of_kind(plan, "worker")
    assert len(workers) == 8
    budget = plan["memory"]["per_worker"]["kv_cache"]
    assert budget > 0 and all(p["kv_cache_bytes"] == budget for p in workers)
    assert plan["memory"]["workers"] == 8 and plan["memory"]["footprint_bytes"] > 8 * budget


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mixtral_dir", "tiny_qwen2_moe_dir"])
def test_weight_estimate_matches_the_models_parameters(request, fixture):
    """The estimate from config.json alone, against transformers' parameter count."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    actual = sum(p.numel() for p in hf.parameters()) * 4
    estimate = worker_weight_bytes(create(model_dir, dtype="float32"))
    assert estimate == pytest.approx(actual, rel=0.05)
    halves = worker_weight_bytes(create(model_dir, dtype="float32", tensor_parallel_size=2))
    assert halves == pytest.approx(actual / 2, rel=0.05)


@pytest.mark.parametrize("tp", [1, 3])
def test_weight_estimate_of_kept_gguf_blocks_is_the_files_bytes(tp):
    """A bfloat16 GGUF model whose blocks stay quantized (kernels/quantized.py)
    holds about its file's bytes, split over tensor parallel, with no bfloat16
    decode copy; loaded, the default model's parameters take 92 MiB. On AMX
    its matrices are also held in bfloat16, for steps of many rows."""
    import math
    import os

    from fleet.config.model_files import default_model_path
    from fleet.workers.gguf_file import read_gguf_tensors

    try:
        path = default_model_path()
    except ValueError as error:
        pytest.skip(str(error))
    config = create(path, dtype="bfloat16", tensor_parallel_size=tp)
    if not config.model.keeps_gguf_blocks("cpu"):
        pytest.skip("GGUF blocks stay quantized only on a CPU with AVX512-BF16")
    expected = os.path.getsize(path)
    if config.model.keeps_amx_gemm_copies("cpu"):
        expected += 2 * sum(math.prod(tensor.shape) for tensor in read_gguf_tensors(path) if len(tensor.shape) == 2)
    assert worker_weight_bytes(config) == pytest.approx(expected / tp, rel=0.1)

"""Our Mixtral and Qwen2-MoE over a paged KV cache vs transformers (float32),
driven like tests/models/test_model_vs_hf.py drives the dense models."""
from __future__ import annotations

import os
import random

import pytest

from fleet.parallel.moe import ExpertShard, FusedMoE
from fleet.tests.models.paged_pair import BlockPool, Pair, assert_matches_hf, load_pair, random_tokens, run_step
from fleet.tests.tiny_models import MOE_DIMS, write_tiny_model
from fleet.workers.models.mixtral import MixtralForCausalLM, SparseMoeBlock
from fleet.workers.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseBlock


@pytest.fixture(scope="session")
def tiny_qwen2_moe_mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2-MoE with dense layers (sparse step 2, layer 3 MLP-only: only layer 1
    is sparse) and renormalised top-k weights."""
    directory = tmp_path_factory.mktemp("tiny_qwen2_moe_mixed")
    return os.fspath(write_tiny_model(
        directory, "qwen2_moe", seed=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True, **MOE_DIMS,
    ))


@pytest.fixture(scope="module", params=["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen2_moe_mixed_dir", "tiny_qwen3_moe_dir"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return load_pair(request.getfixturevalue(request.param))


def test_batched_prefill_then_batched_decode(pair: Pair) -> None:
    rng, pool = random.Random(1), BlockPool()
    seqs = [pool.new_seq(random_tokens(rng, n), n + 6) for n in (7, 1, 13, 30)]
    run_step(pair, [(seq, len(seq.tokens)) for seq in seqs])
    for _ in range(5):
        run_step(pair, [(seq, 1) for seq in seqs])
    assert_matches_hf(pair, seqs)


def test_decodes_alongside_chunked_prefill(pair: Pair) -> None:
    rng, pool = random.Random(2), BlockPool()
    a = pool.new_seq(random_tokens(rng, 9), 20)
    b = pool.new_seq(random_tokens(rng, 22), 30)
    run_step(pair, [(a, 9), (b, 6)])
    run_step(pair, [(a, 1), (b, 16)])
    for _ in range(3):
        run_step(pair, [(b, 1), (a, 1)])
    assert_matches_hf(pair, [a, b])


def test_qwen2_moe_sparse_and_dense_layers(tiny_qwen2_moe_dir, tiny_qwen2_moe_mixed_dir) -> None:
    every = load_pair(tiny_qwen2_moe_dir).ours.model.layers
    assert all(isinstance(layer.mlp, Qwen2MoeSparseBlock) for layer in every.values())
    mixed = load_pair(tiny_qwen2_moe_mixed_dir).ours
    assert [type(layer.mlp).__name__ for layer in mixed.model.layers.values()] == [
        "LlamaMLP", "Qwen2MoeSparseBlock", "LlamaMLP", "LlamaMLP"]
    assert mixed.spec.renormalize and not load_pair(tiny_qwen2_moe_dir).ours.spec.renormalize


def test_mixtral_layers_are_sparse_blocks(tiny_mixtral_dir) -> None:
    model = load_pair(tiny_mixtral_dir).ours
    block = model.model.layers["0"].mlp
    assert isinstance(block, SparseMoeBlock) and isinstance(block.experts, FusedMoE)
    assert block.experts.w13.shape == (8, 2 * 64, 64) and block.experts.w2.shape == (8, 64, 64)


def test_checkpoint_names(tiny_mixtral_dir, tiny_qwen2_moe_dir) -> None:
    mixtral = load_pair(tiny_mixtral_dir).ours.param_name
    assert mixtral("model.layers.3.block_sparse_moe.experts.5.w3.weight") == (
        "model.layers.3.mlp.experts.w13", ExpertShard(5, "up"))
    assert mixtral("model.layers.3.block_sparse_moe.gate.weight") == ("model.layers.3.mlp.gate.weight", None)
    qwen = load_pair(tiny_qwen2_moe_dir).ours.param_name
    assert qwen("model.layers.0.mlp.experts.7.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2", ExpertShard(7, "down"))
    assert qwen("model.layers.0.mlp.shared_expert.gate_proj.weight") == (
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight", 0)
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    assert qwen(gate) == (gate, None)


def test_sliding_windows_are_read_from_the_config(tiny_mixtral_dir, tiny_qwen2_moe_dir) -> None:
    from fleet.config.model_files import read_hf_config

    mixtral = read_hf_config(tiny_mixtral_dir)
    assert MixtralForCausalLM.spec_from_config({**mixtral, "sliding_window": 1024}).sliding_windows == (1024,) * 4
    qwen = {**read_hf_config(tiny_qwen2_moe_dir), "sliding_window": 64, "max_window_layers": 3}
    qwen.pop("layer_types", None)  # as a transformers 4 config.json
    assert Qwen2MoeForCausalLM.spec_from_config({**qwen, "use_sliding_window": True}).sliding_windows == (0, 0, 0, 64)


def test_a_missing_expert_is_an_error(tiny_mixtral_dir) -> None:
    import torch

    from fleet.config.model_files import read_hf_config
    from fleet.workers.loader import iterate_weights

    model = MixtralForCausalLM(read_hf_config(tiny_mixtral_dir), torch.float32, "cpu")
    dropped = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    weights = ((name, w) for name, w in iterate_weights(tiny_mixtral_dir) if name != dropped)
    with pytest.raises(ValueError, match=r"1 expert projections of model.layers.2.mlp.experts, e.g. \[\(5, 'up'\)\]"):
        model.load_weights(weights)

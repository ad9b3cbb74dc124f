"""--compilation-config mode torch_compile: the compiled decode step computes
what eager does, its graphs compile at start-up and never again, and
generation through it matches transformers."""
from __future__ import annotations

import random

import pytest
import torch

import fleet
from fleet import SamplingParams
from fleet.config.engine_args import EngineArgs
from fleet.kernels.attention import AttentionMetadata
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.workers.compiled_decode import CompiledDecode
from fleet.workers.loader import load_model

BLOCK_SIZE = 16
NUM_BLOCKS = 64


def decode_step(size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`size` sequences of random lengths, one new token each, in shuffled blocks (block 0 unused)."""
    blocks = list(range(1, NUM_BLOCKS))
    rng.shuffle(blocks)
    seq_lens = [rng.randrange(1, 4 * BLOCK_SIZE) for _ in range(size)]
    tables = []
    for seq_len in seq_lens:
        needed = -(-seq_len // BLOCK_SIZE)
        tables.append(blocks[:needed])
        blocks = blocks[needed:]
    meta = AttentionMetadata.build([1] * size, seq_lens, tables, BLOCK_SIZE)
    input_ids = torch.tensor([rng.randrange(3, 512) for _ in range(size)])
    positions = torch.tensor([seq_len - 1 for seq_len in seq_lens])
    return input_ids, positions, meta


@torch.inference_mode()
def test_compiled_decode_is_eager_bit_for_bit_with_no_graph_after_warm_up(tiny_llama_dir):
    # Imported here, not at collection: torch._dynamo imports triton, which must first see the
    # TRITON_INTERPRET that tests/kernels/test_triton_kernels.py sets when it is collected.
    from torch._dynamo.utils import counters

    config = EngineArgs(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=16,
        compilation_config={"mode": "torch_compile", "batch_sizes": [1, 2]},
    ).create_config()  # fmt: skip
    model = load_model(config.model, config.load, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv_caches = [torch.randn(shape, generator=generator) for _ in range(model.num_layers)]  # a context to attend to
    compiled = CompiledDecode(config, model, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    compiled.warm_up(kv_caches, torch.float32)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one sequence, and any other number of them
    rng = random.Random(0)
    for size in (1, 3, 16, 7, 1, 2, 5):
        input_ids, positions, meta = decode_step(size, rng)
        assert compiled.applies(meta)
        ours = compiled(input_ids, positions, kv_caches, meta)
        eager = model(input_ids, positions, kv_caches, meta)  # writes the same keys and values again
        assert torch.equal(ours, eager), size
    assert counters["stats"]["unique_graphs"] == graphs, "a batch size compiled after the warm-up"
    assert not counters["graph_break"], dict(counters["graph_break"])
    prefill = AttentionMetadata.build([1, 3], [4, 3], [[1], [2]], BLOCK_SIZE)
    too_many = AttentionMetadata.build([1] * 17, [2] * 17, [[1]] * 17, BLOCK_SIZE)
    assert not compiled.applies(prefill) and not compiled.applies(too_many)  # these run eager


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_generation_through_the_compiled_decode_matches_transformers(tiny_llama_dir, capfd, tp):
    model = hf_model(str(tiny_llama_dir))
    # 20 blocks of 16 tokens hold 320 tokens, fewer than 4 sequences of up to ~90 need: requests are
    # preempted and recomputed; 32 tokens a step put prefill chunks beside decodes; as requests
    # finish and start, decode steps hold 1 to 4 sequences.
    with fleet.LLM(
        str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
        max_num_batched_tokens=32, kv_cache_memory_bytes=20 * 16 * 1024 // tp, tensor_parallel_size=tp,
        compilation_config={"mode": "torch_compile"},
    ) as llm:  # fmt: skip
        assert "compiled the decode step for batch sizes [1, 2, 4]" in capfd.readouterr().err
        prompts = random_prompts(7, model.config.vocab_size, seed=20, min_len=20, max_len=70)
        lengths = [24, 8, 30, 16, 24, 12, 20]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, n, output in zip(prompts, lengths, outputs):
            assert output.outputs[0].token_ids == greedy(model, prompt, n)
        assert_all_blocks_free(llm)
    assert_no_fleet_processes()

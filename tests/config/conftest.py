"""Fixtures for the config tests: tiny HF model directories (config.json only,
written with transformers; resolution reads no weights) and a CLI parser."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.config import EngineArgs
from fleet.config.cli_args import parse_engine_args
from fleet.frontend.cli import launch_parser

TINY_CONTEXT = 512


@pytest.fixture(scope="session")
def llama_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama config.json with no dtype (so a float32 checkpoint) and a 512-token context."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=TINY_CONTEXT,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral config.json: a mixture-of-experts model (4 experts)."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-mixtral")
    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=TINY_CONTEXT,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(path)
    return path


@pytest.fixture
def model_dir_with(llama_config_dir: Path, tmp_path: Path) -> Callable[..., Path]:
    """Factory: a copy of the tiny Llama config.json with some keys changed."""
    counter = iter(range(1000))

    def make(**changes: Any) -> Path:
        config = json.loads((llama_config_dir / "config.json").read_text())
        config.update(changes)
        path = tmp_path / f"model-{next(counter)}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    return make


@pytest.fixture
def parse() -> Callable[..., EngineArgs]:
    """parse("--tp", "2", ...) -> EngineArgs, through the `fleet launch` parser."""

    def run(*argv: str) -> EngineArgs:
        _, args = parse_engine_args(launch_parser("launch"), list(argv))
        return args

    return run

"""The CLI generated from the config dataclasses: every kind of field, the short
aliases, nested dataclasses, `--config file.yaml`, and `--help`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Literal

import pytest

from fleet.config import CompilationConfig, EngineArgs
from fleet.config.cli_args import argparse_kwargs, flag_name
from fleet.config.engine_args import FLAT_GROUPS, NESTED_GROUPS, user_fields
from fleet.config.fields import HumanInt, attribute_docs, parse_human_int
from fleet.config.model import DEFAULT_MODEL
from fleet.frontend.cli import launch_parser


def assert_usage_error(capsys: pytest.CaptureFixture[str], exit_info: pytest.ExceptionInfo[SystemExit], *names: str):
    """Exit code 2, one line on stderr naming `names`, no traceback."""
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for name in names:
        assert name in err, f"{name!r} not in {err!r}"


# ---------------------------------------------------------------- defaults


def test_no_flags_give_the_engine_args_defaults(parse):
    assert parse() == EngineArgs()
    args = parse()
    assert args.model == DEFAULT_MODEL
    assert args.enable_prefix_caching is None and args.enable_chunked_prefill is None
    assert args.compilation_config == CompilationConfig()


def test_engine_args_has_a_field_per_user_field_and_nothing_resolved():
    expected = {f.name for cls in FLAT_GROUPS.values() for f in user_fields(cls)} | set(NESTED_GROUPS)
    assert {f.name for f in dataclasses.fields(EngineArgs)} == expected
    for resolved in ("is_moe", "model_path", "tokenizer_path", "architecture", "hf_config"):
        assert resolved not in expected


# ---------------------------------------------------------------- aliases and long names


@pytest.mark.parametrize(
    "argv,field,value",
    [
        (["-tp", "2"], "tensor_parallel_size", 2),
        (["--tp", "2"], "tensor_parallel_size", 2),
        (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
        (["--tensor-parallel-size=4"], "tensor_parallel_size", 4),
        (["-pp", "3"], "pipeline_parallel_size", 3),
        (["--pp", "3"], "pipeline_parallel_size", 3),
        (["--pipeline-parallel-size", "3"], "pipeline_parallel_size", 3),
        (["-dp", "4"], "data_parallel_size", 4),
        (["--dp", "4"], "data_parallel_size", 4),
        (["--data-parallel-size", "4"], "data_parallel_size", 4),
        (["-ep"], "enable_expert_parallel", True),
        (["--enable-expert-parallel"], "enable_expert_parallel", True),
        (["-n", "2"], "nnodes", 2),
        (["--nnodes", "2"], "nnodes", 2),
        (["-r", "1"], "node_rank", 1),
        (["--node-rank", "1"], "node_rank", 1),
        (["--data-parallel-size-local", "2"], "data_parallel_size_local", 2),
        (["--data-parallel-start-rank", "2"], "data_parallel_start_rank", 2),
        (["--data-parallel-rank", "3"], "data_parallel_rank", 3),
        (["--data-parallel-address", "10.0.0.1"], "data_parallel_address", "10.0.0.1"),
        (["--data-parallel-rpc-port", "1234"], "data_parallel_rpc_port", 1234),
        (["--data-parallel-hybrid-lb"], "data_parallel_hybrid_lb", True),
        (["--data-parallel-external-lb"], "data_parallel_external_lb", True),
        (["--data-parallel-routing", "round-robin"], "data_parallel_routing", "round-robin"),
        (["--data-parallel-backend", "ray"], "data_parallel_backend", "ray"),
        (["--distributed-executor-backend", "uni"], "distributed_executor_backend", "uni"),
        (["--master-addr", "10.0.0.9"], "master_addr", "10.0.0.9"),
        (["--master-port", "29500"], "master_port", 29500),
        (["--headless"], "headless", True),
        (["--api-server-count", "3"], "api_server_count", 3),
    ],
)
def test_parallel_flags_and_aliases(parse, argv, field, value):
    assert getattr(parse(*argv), field) == value


def test_short_aliases_combine(parse):
    args = parse("-tp", "2", "-pp", "3", "-dp", "4", "-ep", "-n", "6", "-r", "5")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 3, 4)
    assert (args.enable_expert_parallel, args.nnodes, args.node_rank) == (True, 6, 5)


def test_the_last_occurrence_of_a_flag_wins(parse):
    assert parse("--tp", "2", "-tp", "3").tensor_parallel_size == 3


# ---------------------------------------------------------------- bool


@pytest.mark.parametrize(
    "field", ["headless", "data_parallel_hybrid_lb", "data_parallel_external_lb", "enable_expert_parallel"]
)
def test_bool_fields_have_a_flag_and_a_no_flag(parse, field):
    flag = flag_name(field)
    assert getattr(parse(), field) is False
    assert getattr(parse(flag), field) is True
    assert getattr(parse(flag, "--no-" + flag[2:]), field) is False


@pytest.mark.parametrize("field", ["enable_prefix_caching", "enable_chunked_prefill"])
def test_optional_bool_fields_stay_unset_unless_given(parse, field):
    flag = flag_name(field)
    assert getattr(parse(), field) is None
    assert getattr(parse(flag), field) is True
    assert getattr(parse("--no-" + flag[2:]), field) is False


# ---------------------------------------------------------------- Literal


@pytest.mark.parametrize(
    "field,choices",
    [
        ("dtype", ["auto", "float32", "bfloat16", "float16"]),
        ("data_parallel_backend", ["mp", "ray"]),
        ("data_parallel_routing", ["least-loaded", "cache-aware", "round-robin"]),
        ("distributed_executor_backend", ["uni", "mp", "ray"]),
        ("scheduling_policy", ["fcfs", "priority"]),
        ("load_format", ["auto", "safetensors", "gguf", "dummy"]),
        ("device", ["auto", "cpu", "cuda"]),
        ("uvicorn_log_level", ["critical", "error", "warning", "info", "debug", "trace"]),
    ],
)
def test_literal_fields_accept_exactly_their_choices(parse, capsys, field, choices):
    flag = flag_name(field)
    for choice in choices:
        assert getattr(parse(flag, choice), field) == choice
    with pytest.raises(SystemExit) as exit_info:
        parse(flag, "bogus")
    assert_usage_error(capsys, exit_info, flag, "bogus", "invalid choice")


def test_data_parallel_routing_is_cache_aware_unless_told_and_a_bad_value_names_the_choices(parse, capsys):
    assert parse().data_parallel_routing == "cache-aware"
    with pytest.raises(SystemExit) as exit_info:
        parse("--data-parallel-routing", "random")
    assert_usage_error(capsys, exit_info, "--data-parallel-routing", "least-loaded", "cache-aware", "round-robin")


def test_literal_choices_are_shown_in_help():
    text = " ".join(launch_parser("launch").format_help().split())
    assert "--dtype {auto,float32,bfloat16,float16,float,half}" in text
    assert "--distributed-executor-backend {uni,mp,ray}" in text


# ---------------------------------------------------------------- int, float, str, optional


def test_int_float_and_str_fields(parse):
    args = parse(
        "--seed", "7", "--block-size", "32", "--gpu-memory-utilization", "0.5", "--shutdown-timeout", "3",
        "--host", "0.0.0.0", "--port", "9000", "--api-key", "secret", "--tokenizer", "/tok",
    )  # fmt: skip
    assert (args.seed, args.block_size, args.port) == (7, 32, 9000)
    assert args.gpu_memory_utilization == 0.5 and isinstance(args.gpu_memory_utilization, float)
    assert args.shutdown_timeout == 3.0 and isinstance(args.shutdown_timeout, float)
    assert (args.host, args.api_key, args.tokenizer) == ("0.0.0.0", ["secret"], "/tok")


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--tp", "two"], ["--tensor-parallel-size", "two"]),
        (["--seed", "1.5"], ["--seed", "1.5"]),
        (["--port", "1k"], ["--port", "1k"]),  # only token and byte counts read 1k
        (["--gpu-memory-utilization", "lots"], ["--gpu-memory-utilization", "lots"]),
        (["--max-num-seqs", "many"], ["--max-num-seqs", "many"]),
    ],
)
def test_a_bad_number_exits_2_naming_the_flag(parse, capsys, argv, names):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert_usage_error(capsys, exit_info, *names)


@pytest.mark.parametrize(
    "field", ["max_num_seqs", "max_model_len", "master_port", "data_parallel_rank", "data_parallel_size_local"]
)
def test_optional_ints_accept_none(parse, field):
    flag = flag_name(field)
    assert getattr(parse(flag, "5"), field) == 5
    assert getattr(parse(flag, "5", flag, "None"), field) is None


def test_optional_str_accepts_none(parse):
    assert parse("--tokenizer", "/tok", "--tokenizer", "None").tokenizer is None


def test_a_required_int_refuses_none(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--seed", "None")
    assert_usage_error(capsys, exit_info, "--seed")


# ---------------------------------------------------------------- list


def test_list_fields_take_several_values(parse):
    assert parse("--served-model-name", "a", "b", "c").served_model_name == ["a", "b", "c"]
    assert parse("--served-model-name", "only").served_model_name == ["only"]


def test_list_flag_needs_a_value(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--served-model-name")
    assert_usage_error(capsys, exit_info, "--served-model-name")


def test_optional_list_accepts_none(parse):
    assert parse("--served-model-name", "None").served_model_name is None


# ---------------------------------------------------------------- positional MODEL


def test_positional_model(parse):
    assert parse("/models/x").model == "/models/x"
    assert parse("/models/x", "--model", "/models/x").model == "/models/x"
    assert parse("--model", "/models/y").model == "/models/y"


def test_positional_and_flag_model_that_disagree_exit_2(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("/models/x", "--model", "/models/y")
    assert_usage_error(capsys, exit_info, "MODEL", "--model")


# ---------------------------------------------------------------- nested dataclass


def test_nested_dataclass_as_json_with_human_numbers(parse):
    args = parse("--compilation-config", '{"mode": "torch_compile", "max_batch_size": 1k}')
    assert args.compilation_config == CompilationConfig(mode="torch_compile", max_batch_size=1000)


def test_nested_dataclass_json_with_a_list(parse):
    args = parse("--compilation-config", '{"batch_sizes": [1, 2, 4], "max_batch_size": 1K}')
    assert args.compilation_config == CompilationConfig(batch_sizes=[1, 2, 4], max_batch_size=1024)


def test_nested_dataclass_one_key_at_a_time(parse):
    args = parse(
        "--compilation-config.mode", "torch_compile",
        "--compilation-config.max_batch_size=2K",
        "--compilation-config.batch-sizes", "[1, 8]",
    )  # fmt: skip
    assert args.compilation_config == CompilationConfig(mode="torch_compile", max_batch_size=2048, batch_sizes=[1, 8])


def test_dotted_keys_override_the_json_object(parse):
    args = parse(
        "--compilation-config.mode", "torch_compile",
        "--compilation-config", '{"mode": "none", "max_batch_size": 64}',
    )  # fmt: skip
    assert args.compilation_config == CompilationConfig(mode="torch_compile", max_batch_size=64)


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--compilation-config", "{not json"], ["--compilation-config"]),
        (["--compilation-config", '{"mode": "fast"}'], ["--compilation-config", "mode"]),
        (["--compilation-config", '{"max_batch_size": "big"}'], ["--compilation-config", "max_batch_size"]),
        (["--compilation-config.mode", "fast"], ["--compilation-config", "mode"]),
        (["--compilation-config.mode"], ["--compilation-config.mode"]),
    ],
)
def test_bad_nested_values_exit_2(parse, capsys, argv, names):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert_usage_error(capsys, exit_info, *names)


@pytest.mark.parametrize(
    "argv", [["--compilation-config", '{"max_batch": 8}'], ["--compilation-config.max_batch", "8"]]
)
def test_unknown_nested_keys_exit_2(parse, argv):
    with pytest.raises(SystemExit):
        parse(*argv)


# ---------------------------------------------------------------- type -> argparse mapping


def test_argparse_kwargs_mapping():
    assert argparse_kwargs(bool) == {"action": argparse.BooleanOptionalAction}
    assert argparse_kwargs(bool | None) == {"action": argparse.BooleanOptionalAction}
    assert argparse_kwargs(int) == {"type": int}
    assert argparse_kwargs(float) == {"type": float}
    assert argparse_kwargs(str) == {"type": str}
    assert argparse_kwargs(Literal["a", "b"]) == {"type": str, "choices": ["a", "b"]}
    assert argparse_kwargs(list[int]) == {"type": int, "nargs": "+"}
    assert argparse_kwargs(HumanInt) == {"type": parse_human_int, "metavar": "N"}
    optional = argparse_kwargs(int | None)
    assert optional["type"]("None") is None and optional["type"]("3") == 3
    optional_human = argparse_kwargs(HumanInt | None)
    assert optional_human["type"]("None") is None and optional_human["type"]("2k") == 2000
    optional_choice = argparse_kwargs(Literal["x", "y"] | None)
    assert optional_choice["choices"] == ["x", "y", None] and optional_choice["type"]("None") is None
    nested = argparse_kwargs(CompilationConfig)
    assert nested["type"]('{"max_batch_size": 3}') == CompilationConfig(max_batch_size=3)


def test_argparse_kwargs_refuses_an_unmapped_type():
    with pytest.raises(TypeError, match="no CLI mapping"):
        argparse_kwargs(dict[str, int])


# ---------------------------------------------------------------- --config file.yaml


def test_yaml_config_supplies_flags(parse, tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "tensor-parallel-size: 2\n"
        "dp: 2\n"
        "enable_prefix_caching: false\n"
        "headless: true\n"
        "served_model_name: [a, b]\n"
        "max_num_batched_tokens: 2k\n"
        "max_model_len: null\n"
        "gpu_memory_utilization: 0.5\n"
        "dtype: bfloat16\n"
        "compilation_config: {mode: torch_compile, max_batch_size: 512}\n"
    )
    args = parse("--config", str(path))
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 2)
    assert args.enable_prefix_caching is False and args.headless is True
    assert args.served_model_name == ["a", "b"]
    assert args.max_num_batched_tokens == 2000 and args.max_model_len is None
    assert args.gpu_memory_utilization == 0.5 and args.dtype == "bfloat16"
    assert args.compilation_config == CompilationConfig(mode="torch_compile", max_batch_size=512)


def test_command_line_flags_win_over_the_yaml_config(parse, tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("tensor_parallel_size: 2\nheadless: true\nseed: 3\ncompilation_config: {max_batch_size: 64}\n")
    args = parse("--tp", "4", "--config", str(path), "--no-headless", "--compilation-config.mode", "torch_compile")
    assert args.tensor_parallel_size == 4 and args.headless is False
    assert args.seed == 3, "flags the command line does not give come from the file"
    assert args.compilation_config == CompilationConfig(mode="torch_compile", max_batch_size=64)
    assert parse(f"--config={path}", "--seed", "9").seed == 9


def test_yaml_config_with_a_model(parse, tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("model: /models/from-yaml\n")
    assert parse("--config", str(path)).model == "/models/from-yaml"
    assert parse("--config", str(path), "--model", "/models/cli").model == "/models/cli"


def test_empty_yaml_config_changes_nothing(parse, tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert parse("--config", str(path)) == EngineArgs()


@pytest.mark.parametrize(
    "content,names",
    [
        (None, ["--config", "missing.yaml"]),
        ("- just\n- a list\n", ["--config", "mapping"]),
        pytest.param(
            "key: [unclosed\n",
            ["--config"]
        ),
        ("tensor_parallel_size: two\n", ["--tensor-parallel-size", "two"]),
        ("no_such_flag: 1\n", ["--no-such-flag"]),
    ],
)
def test_bad_yaml_config_exits_2(parse, capsys, tmp_path, content, names):
    path = tmp_path / "missing.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        parse("--config", str(path))
    assert_usage_error(capsys, exit_info, *names)


def test_config_flag_needs_a_path(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--config")
    assert_usage_error(capsys, exit_info, "--config")


def test_yaml_config_nested_human_numbers(parse, tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("compilation_config: {max_batch_size: 1k}\n")
    assert parse("--config", str(path)).compilation_config.max_batch_size == 1000


# ---------------------------------------------------------------- --help


@pytest.fixture
def help_text(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping, so that docstrings appear whole
    return launch_parser("launch").format_help()


def test_help_is_grouped_by_config_class(help_text):
    positions = [help_text.index(f"\n{cls.__name__}:\n") for cls in [*FLAT_GROUPS.values(), *NESTED_GROUPS.values()]]
    assert positions == sorted(positions), "groups appear in FLAT_GROUPS order"
    for cls in FLAT_GROUPS.values():
        start = help_text.index(f"\n{cls.__name__}:\n")
        following = [help_text.find(f"\n{other.__name__}:\n", start + 1) for other in FLAT_GROUPS.values()]
        end = min([p for p in following if p > start] + [len(help_text)])
        section = help_text[start:end]
        for f in user_fields(cls):
            assert flag_name(f.name) in section, f"{flag_name(f.name)} not in the {cls.__name__} group"


def test_help_shows_each_flag_with_its_docstring_and_default(help_text):
    text = " ".join(help_text.split())
    for cls in FLAT_GROUPS.values():
        docs = attribute_docs(cls)
        for f in user_fields(cls):
            doc = " ".join(docs[f.name].split())
            shown = "unset" if f.default is None and hint_is_bool(cls, f.name) else f.default
            assert f"{doc} (default: {shown})" in text, f"{f.name}: docstring and default not in --help"


def hint_is_bool(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    return hint is bool or set(typing.get_args(hint)) == {bool, type(None)}


def test_help_shows_aliases_and_the_nested_group(help_text):
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE, --tp" in help_text
    assert "--enable-expert-parallel, --no-enable-expert-parallel, -ep" in help_text
    assert "--compilation-config.KEY VALUE" in help_text
    assert "--config FILE.yaml" in help_text


def test_resolved_fields_have_no_flag(help_text):
    for flag in ("--is-moe", "--model-path", "--tokenizer-path", "--architecture", "--hf-config"):
        assert flag not in help_text


def test_launch_help_exits_0(capsys):
    from fleet.frontend.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--help"])
    assert exit_info.value.code == 0
    assert "ParallelConfig" in capsys.readouterr().out


def test_every_config_field_is_documented():
    classes = [*FLAT_GROUPS.values(), *NESTED_GROUPS.values()]
    for cls in classes:
        docs = attribute_docs(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not undocumented, f"{cls.__name__}: {undocumented} have no docstring"
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"

"""`vllm serve` command lines run unchanged with `fleet launch`: each flag of
vLLM 0.32.0 is fleet's own, ignored with a line in the log, or refused by
name (config/vllm_flags.py); underscores stand for dashes in flag names."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from fleet.config.cli_args import parse_engine_args
from fleet.config.vllm_flags import (
    IGNORED_DEST,
    OLDER_VLLM_FLAGS,
    OPTIONAL_VALUE,
    SHORT_FLAGS,
    VLLM_FLAGS,
    IgnoredFlag,
    VllmFlagAction,
)
from fleet.frontend.cli import launch_parser
from fleet.tests.config.vllm_serve_flags import VLLM_LONG_ALIASES, VLLM_SERVE_FLAGS, VLLM_SHORT_ALIASES
from fleet.tests.frontend.server import Server

VLLM_KINDS = {flag: kind for flag, kind, _ in VLLM_SERVE_FLAGS}
EXAMPLES = {flag: example for flag, _, example in VLLM_SERVE_FLAGS}


def fleets_own_options() -> set[str]:
    """The option strings of fleet's generated parser, without the vLLM flags added to it."""
    parser = launch_parser("launch")
    return {option for action in parser._actions if not isinstance(action, VllmFlagAction)
            for option in action.option_strings}


def parse(*argv: str):
    """(namespace, engine_args) as `fleet launch` parses argv (nothing starts)."""
    return parse_engine_args(launch_parser("launch"), list(argv))


def ignored(*argv: str) -> tuple[IgnoredFlag, ...]:
    namespace, _ = parse(*argv)
    return getattr(namespace, IGNORED_DEST)


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line usage error that argv gets (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def assert_parses_or_names(capsys: pytest.CaptureFixture[str], flag: str, argv: list[str]) -> None:
    """argv parses, or is a usage error that names `flag` and is no "unrecognized arguments"."""
    try:
        parse(*argv)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err
        assert flag in err and "unrecognized" not in err, err


# ---------------------------------------------------------------- every flag of vLLM's parser


@pytest.mark.parametrize(("flag", "kind", "example"), VLLM_SERVE_FLAGS, ids=[f for f, _, _ in VLLM_SERVE_FLAGS])
def test_each_vllm_flag_parses_or_is_refused_by_name(capsys, tmp_path, flag, kind, example):
    if flag == "--config":  # the example names a file that is not there: give one
        example = str(tmp_path / "config.yaml")
        (tmp_path / "config.yaml").write_text("max_model_len: 512\n")
    assert_parses_or_names(capsys, flag, [flag] + ([example] if kind != "switch" else []))


def test_the_table_lists_exactly_the_vllm_flags_fleet_lacks_with_vllms_kinds():
    own = fleets_own_options()
    assert set(VLLM_FLAGS) == {flag for flag in VLLM_KINDS if flag not in own}
    assert {flag: entry.kind for flag, entry in VLLM_FLAGS.items()} == {flag: VLLM_KINDS[flag] for flag in VLLM_FLAGS}
    assert not set(OLDER_VLLM_FLAGS) & (set(VLLM_KINDS) | own), "an older flag is vLLM 0.32's or fleet's"
    for entry in [*VLLM_FLAGS.values(), *OLDER_VLLM_FLAGS.values()]:
        assert entry.reason and not entry.reason.endswith("."), entry
        assert not entry.accepts or entry.refused, f"{entry}: only a refused flag lists values it accepts"


def test_short_aliases_are_fleets_own_or_those_of_a_listed_flag(capsys):
    parser = launch_parser("launch")
    own = fleets_own_options()
    for short, long in VLLM_SHORT_ALIASES.items():
        if short in own:
            assert parser._option_string_actions[short] is parser._option_string_actions[long], short
        else:
            assert SHORT_FLAGS[short] == long and long in VLLM_FLAGS, short
        kind = VLLM_KINDS[long]
        assert_parses_or_names(capsys, short, [short] + ([EXAMPLES[long]] if kind != "switch" else []))
    assert set(SHORT_FLAGS) <= set(VLLM_SHORT_ALIASES)


def test_long_aliases_are_fleets_own_flag():
    parser = launch_parser("launch")
    for alias, canonical in VLLM_LONG_ALIASES.items():
        assert parser._option_string_actions[alias] is parser._option_string_actions[canonical]
    assert parse("--device-memory-utilization", "0.5")[1].gpu_memory_utilization == 0.5


# ---------------------------------------------------------------- ignored and refused


def test_ignored_flags_are_recorded_with_their_value_and_reason():
    assert ignored() == ()
    flags = ignored("--enforce-eager", "--max-log-len", "100", "--ignore-patterns", "a/*", "b/*", "--enforce-eager")
    assert flags == (
        IgnoredFlag("--enforce-eager", VLLM_FLAGS["--enforce-eager"].reason),
        IgnoredFlag("--max-log-len 100", VLLM_FLAGS["--max-log-len"].reason),
        IgnoredFlag("--ignore-patterns a/* b/*", VLLM_FLAGS["--ignore-patterns"].reason),
    )
    assert [f.flag for f in ignored("--disable-log-requests", "--swap-space", "4")] == [
        "--disable-log-requests", "--swap-space 4"]


def test_every_switch_has_a_no_form_that_is_ignored():
    for flag, entry in VLLM_FLAGS.items():
        if entry.kind == "switch":
            negative = "--no-" + flag[2:]
            assert ignored(negative) == (IgnoredFlag(negative, entry.reason),)


def test_a_refused_flag_names_itself_its_value_and_why(capsys):
    err = refusal(capsys, "--quantization", "awq")
    assert err.startswith("fleet launch: error: --quantization awq: not supported: fleet reads GGUF")
    assert "(see fleet launch --help)" in err
    assert "--enable-lora: not supported: fleet serves no LoRA adapters" in refusal(capsys, "--enable-lora")
    assert "-q awq: not supported" in refusal(capsys, "-q", "awq")
    assert "--lora-modules a=/x b=/y: not supported" in refusal(capsys, "--lora-modules", "a=/x", "b=/y")


def test_values_that_ask_for_what_fleet_does_are_ignored(capsys):
    assert [f.flag for f in ignored("--kv-cache-dtype", "auto", "--quantization", "gguf", "-dcp", "1")] == [
        "--kv-cache-dtype auto", "--quantization gguf", "-dcp 1"]
    assert "--kv-cache-dtype fp8: not supported" in refusal(capsys, "--kv-cache-dtype", "fp8")
    assert "--decode-context-parallel-size 2: not supported" in refusal(capsys, "--decode-context-parallel-size", "2")


def test_optimization_level_takes_vllms_short_forms():
    for argv in (["-O3"], ["-O", "3"], ["-O=3"]):
        assert [f.flag for f in ignored(*argv)] == ["-O 3"], argv
    assert [f.flag for f in ignored("--optimization-level", "3")] == ["--optimization-level 3"]


def test_hf_token_alone_is_the_hub_login_fleet_uses_and_a_token_is_refused(capsys):
    assert [f.flag for f in ignored("--hf-token")] == [f"--hf-token {OPTIONAL_VALUE['--hf-token']}"]
    assert "--hf-token hf_x: not supported: fleet reads the hub token from HF_TOKEN" in refusal(
        capsys, "--hf-token", "hf_x")


def test_vllm_flags_stay_out_of_help_but_the_epilog_points_to_them():
    text = " ".join(launch_parser("launch").format_help().split())
    assert "--enforce-eager" not in text and "--quantization" not in text
    assert "fleet/config/vllm_flags.py" in text


# ---------------------------------------------------------------- underscores


def test_underscores_stand_for_dashes_in_flag_names_only():
    _, args = parse("--max_model_len", "512", "--served_model_name", "my_model", "--kv_cache_memory_bytes=16M",
                    "--compilation_config.max_batch_size", "8", "--enable_prefix_caching")
    assert args.max_model_len == 512
    assert args.served_model_name == ["my_model"]
    assert args.kv_cache_memory_bytes == 16 * 2**20
    assert args.compilation_config.max_batch_size == 8
    assert args.enable_prefix_caching is True
    assert [f.flag for f in ignored("--trust_remote_code", "--max_log_len", "a_b")] == [
        "--trust-remote-code", "--max-log-len a_b"]
    assert parse("-cc.max_batch_size", "4")[1].compilation_config.max_batch_size == 4


# ---------------------------------------------------------------- the command


def fleet(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def test_launch_refuses_a_quantization_method_naming_it():
    result = fleet("launch", "--quantization", "awq")
    assert result.returncode == 2
    assert result.stderr.startswith("fleet launch: error: --quantization awq: not supported:"), result.stderr
    assert result.stdout == ""


def test_plan_logs_ignored_flags_on_stderr_and_keeps_stdout_json(llama_config_dir):
    result = fleet("plan", str(llama_config_dir), "--device", "cpu", "--enforce-eager", "--disable-log-stats",
                   "--max_model_len", "256")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"]["max_model_len"] == 256
    lines = result.stderr.splitlines()
    assert f"--enforce-eager: ignored: {VLLM_FLAGS['--enforce-eager'].reason}" in lines
    assert f"--disable-log-stats: ignored: {VLLM_FLAGS['--disable-log-stats'].reason}" in lines


@pytest.mark.slow
def test_a_vllm_command_line_serves_and_logs_each_ignored_flag(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--enforce-eager", "--disable-log-requests", "--trust-remote-code",
                    "--max_model_len", "512", "--dtype", "float", "--device", "cpu", "--kv-cache-memory-bytes", "16M",
                    "--api-key", "k1", "k2", "--root-path", "/llm", "--disable-fastapi-docs")
    try:
        name = server.get("/v1/models", headers={"Authorization": "Bearer k2"}).json()["data"][0]
        assert name["max_model_len"] == 512
        body = {"model": name["id"], "prompt": "hello world", "max_tokens": 4, "min_tokens": 4, "temperature": 0}
        for key, status in (("k3", 401), ("k1", 200), ("k2", 200)):
            response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        keyed = {"headers": {"Authorization": "Bearer k1"}}
        assert server.get("/docs", **keyed).status_code == server.get("/openapi.json", **keyed).status_code == 404
        assert server.get("/metrics").status_code == 200, "open to scrapers without --metrics-require-key"
        log = "".join(server.log)
        for flag in ("--enforce-eager", "--disable-log-requests", "--trust-remote-code"):
            assert log.count(f"{flag}: ignored: ") == 1, log
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_vllm_offline_script_runs_unchanged(tiny_llama_dir, caplog):
    """vLLM's LLM keywords: fleet's own fields, ignored ones logged, refused ones a ValueError naming them."""
    import fleet
    from fleet.tests.engine.helpers import assert_no_fleet_processes

    with pytest.raises(ValueError, match="enable_lora=True: not supported: fleet serves no LoRA adapters"):
        fleet.LLM(tiny_llama_dir, enable_lora=True)
    with pytest.raises(TypeError, match="no_such_keyword"):
        fleet.LLM(tiny_llama_dir, no_such_keyword=1)
    with caplog.at_level("WARNING"), fleet.LLM(tiny_llama_dir, trust_remote_code=True, enforce_eager=True, dtype="float",
                                              device="cpu", kv_cache_memory_bytes="4M", max_model_len=256) as llm:
        (output,) = llm.generate("hello", fleet.SamplingParams(max_tokens=3, min_tokens=3), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 3
    assert f"trust_remote_code=True: ignored: {VLLM_FLAGS['--trust-remote-code'].reason}" in caplog.messages
    assert f"enforce_eager=True: ignored: {VLLM_FLAGS['--enforce-eager'].reason}" in caplog.messages
    assert_no_fleet_processes()

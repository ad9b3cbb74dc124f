"""Human-readable integers: `1k` is 1000, `1K` is 1024, on the CLI and inside JSON."""

from __future__ import annotations

import json

import pytest

from fleet.config.fields import expand_human_numbers_in_json, parse_human_int


@pytest.mark.parametrize(
    "text,value",
    [
        ("0", 0),
        ("7", 7),
        ("512", 512),
        (" 512 ", 512),
        ("1k", 1000),
        ("1K", 1024),
        ("2m", 2_000_000),
        ("2M", 2 * 2**20),
        ("1g", 10**9),
        ("1G", 2**30),
        ("1t", 10**12),
        ("1T", 2**40),
        ("25.6k", 25_600),
        ("2.5m", 2_500_000),
        ("0.5K", 512),
        ("1.5", None),
        ("1.0", 1),
    ],
)
def test_parse_human_int(text, value):
    if value is None:
        with pytest.raises(ValueError, match="whole number"):
            parse_human_int(text)
    else:
        assert parse_human_int(text) == value


@pytest.mark.parametrize("text", ["", "k", "abc", "1x", "1kk", "1 k k", "-1", "1e3", "0x10", "1,000"])
def test_parse_human_int_refuses_what_is_not_a_number(text):
    with pytest.raises(ValueError):
        parse_human_int(text)


def test_parse_human_int_refuses_a_fraction_after_scaling():
    with pytest.raises(ValueError, match="whole number"):
        parse_human_int("1.0005k")


def test_human_numbers_inside_json_are_expanded_outside_strings():
    text = '{"a": 1k, "b": "1k", "c": [2K, 3, 25.6k], "d": {"e": 1G}, "f": "x 2M y"}'
    assert json.loads(expand_human_numbers_in_json(text)) == {
        "a": 1000,
        "b": "1k",
        "c": [2048, 3, 25600],
        "d": {"e": 2**30},
        "f": "x 2M y",
    }


def test_json_without_human_numbers_is_unchanged():
    text = '{"mode": "torch_compile", "max_batch_size": 256, "batch_sizes": [1, 2.5, 4], "flag": true}'
    assert expand_human_numbers_in_json(text) == text


def test_escaped_quotes_do_not_confuse_the_expansion():
    text = r'{"a": "say \"1k\"", "b": 1k}'
    assert json.loads(expand_human_numbers_in_json(text)) == {"a": 'say "1k"', "b": 1000}


@pytest.mark.parametrize(
    "flag,field,text,value",
    [
        ("--max-num-batched-tokens", "max_num_batched_tokens", "1k", 1000),
        ("--max-num-batched-tokens", "max_num_batched_tokens", "1K", 1024),
        ("--max-num-batched-tokens", "max_num_batched_tokens", "25.6k", 25_600),
        ("--max-model-len", "max_model_len", "2M", 2 * 2**20),
        ("--max-model-len", "max_model_len", "32K", 32_768),
        ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", "1G", 2**30),
        ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", "2g", 2 * 10**9),
        ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", "123456", 123_456),
    ],
)
def test_human_numbers_on_the_command_line(parse, flag, field, text, value):
    assert getattr(parse(flag, text), field) == value


def test_a_fraction_on_the_command_line_exits_2_naming_the_flag(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--max-model-len", "1.0005k")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-model-len" in err

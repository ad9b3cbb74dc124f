"""The CLI is generated from the config dataclasses: type hints choose the
argparse options, the docstring under each field becomes its help."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any, Literal, NoReturn

import msgspec
import yaml

from fleet.config.engine_args import FLAT_GROUPS, NESTED_GROUPS, EngineArgs, user_fields
from fleet.config.fields import HumanReadable, attribute_docs, expand_human_numbers_in_json, parse_human_int
from fleet.config.model import DEFAULT_MODEL

ALIASES: dict[str, list[str]] = {
    "tensor_parallel_size": ["-tp", "--tp"],
    "pipeline_parallel_size": ["-pp", "--pp"],
    "data_parallel_size": ["-dp", "--dp"],
    "data_parallel_size_local": ["-dpl"],
    "data_parallel_rank": ["-dpn"],
    "data_parallel_start_rank": ["-dpr"],
    "data_parallel_address": ["-dpa"],
    "data_parallel_rpc_port": ["-dpp"],
    "data_parallel_hybrid_lb": ["-dph"],
    "data_parallel_external_lb": ["-dpe"],
    "data_parallel_backend": ["-dpb"],
    "enable_expert_parallel": ["-ep"],
    "speculative_config": ["-sc"],
    "nnodes": ["-n"],
    "node_rank": ["-r"],
    "gpu_memory_utilization": ["--device-memory-utilization"],
    "api_server_count": ["-asc"],
    "compilation_config": ["-cc"],
}
"""Other names of a field's flag: vLLM's, which mean the same."""


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one argument group per config class, one flag per user field."""
    for cls in FLAT_GROUPS.values():
        group = parser.add_argument_group(cls.__name__, _first_line(cls.__doc__))
        hints = typing.get_type_hints(cls, include_extras=True)
        docs = attribute_docs(cls)
        for f in user_fields(cls):
            flags = [flag_name(f.name), *ALIASES.get(f.name, [])]
            kwargs = argparse_kwargs(hints[f.name])
            group.add_argument(*flags, dest=f.name, default=f.default, help=_help(docs.get(f.name, ""), f.default, kwargs), **kwargs)
    for name, cls in NESTED_GROUPS.items():
        group = parser.add_argument_group(cls.__name__, _first_line(cls.__doc__))
        fields_help = "; ".join(f"{f.name}: {attribute_docs(cls).get(f.name, '')}" for f in dataclasses.fields(cls))
        group.add_argument(
            flag_name(name),
            *ALIASES.get(name, []),
            dest=name,
            type=dataclass_parser(cls),
            default=_engine_args_default(name),
            help=f"A JSON object, or one key at a time as {flag_name(name)}.KEY VALUE. Keys: {fields_help}".replace("%", "%%"),
        )


def _engine_args_default(name: str) -> Any:
    """EngineArgs' default for a nested group: a config, or None where the group is off unless given."""
    (field,) = [f for f in dataclasses.fields(EngineArgs) if f.name == name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def argparse_kwargs(hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one field's type hint."""
    optional, hint = _strip_optional(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is typing.Annotated:
        if HumanReadable in args[1:]:
            kwargs: dict[str, Any] = {"type": parse_human_int, "metavar": "N"}
        else:
            return argparse_kwargs(args[0] if not optional else args[0] | None)
    elif origin is Literal:
        kwargs = {"type": type(args[0]), "choices": list(args)}
    elif origin is list:
        kwargs = {"type": args[0], "nargs": "+"}
    elif dataclasses.is_dataclass(hint):
        kwargs = {"type": dataclass_parser(hint)}
    elif hint in (int, float, str):
        kwargs = {"type": hint}
    else:
        raise TypeError(f"no CLI mapping for type {hint!r}")
    if optional and kwargs.get("nargs") == "+":
        kwargs["action"] = _OptionalListAction
    elif optional:
        kwargs["type"] = _none_or(kwargs["type"])
        if "choices" in kwargs:
            kwargs["choices"] = [*kwargs["choices"], None]
    return kwargs


class _OptionalListAction(argparse.Action):
    """A list flag whose single value `None` means unset."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, None if list(values) == ["None"] else values)


def convert_to_dataclass(data: Any, cls: type) -> Any:
    """msgspec.convert, but an unknown key is an error rather than ignored."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}")
    return msgspec.convert(data, cls)


def dataclass_parser(cls: type):
    """Parse a JSON object (human-readable numbers allowed) into `cls`."""

    def parse(text: str):
        try:
            return convert_to_dataclass(json.loads(expand_human_numbers_in_json(text)), cls)
        except (ValueError, msgspec.ValidationError) as error:
            raise argparse.ArgumentTypeError(f"invalid {cls.__name__} JSON {text!r}: {error}") from None

    parse.__name__ = cls.__name__
    return parse


def _strip_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, hint


def _none_or(convert):
    def parse(text: str):
        return None if text in ("None", "none", "") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _help(doc: str, default: Any, kwargs: dict[str, Any]) -> str:
    if kwargs.get("action") is argparse.BooleanOptionalAction:
        shown = "unset" if default is None else default
    else:
        shown = default
    return f"{doc} (default: {shown})".replace("%", "%%")


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""


def expand_config_file(argv: list[str]) -> list[str]:
    """Replace `--config FILE.yaml` by the flags the file holds, placed first
    so that flags on the command line win."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if not path:
        raise ValueError("--config needs a YAML file path")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return [*_yaml_to_argv(data), *rest]


def _yaml_to_argv(data: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in data.items():
        flag = flag_name(str(key).lstrip("-").replace("-", "_"))
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(_human_numbers_as_ints(value))]
        else:
            argv += [flag, "None" if value is None else str(value)]
    return argv


def _human_numbers_as_ints(value: Any) -> Any:
    """YAML reads `1k` as a string; inside a nested config it means 1000, as on the CLI."""
    if isinstance(value, dict):
        return {k: _human_numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            return parse_human_int(value)
        except ValueError:
            return value
    return value


def split_dotted_nested_args(argv: list[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Take `--compilation-config.KEY VALUE` (or `=VALUE`, or `-cc.KEY`) out of
    argv, as {"compilation_config": {"KEY": value}}; values are JSON where they parse."""
    prefixes = {option + ".": name for name in NESTED_GROUPS for option in [flag_name(name), *ALIASES.get(name, [])]}
    rest: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        prefix = next((p for p in prefixes if arg.startswith(p)), None)
        if prefix is None:
            rest.append(arg)
            i += 1
            continue
        key, sep, value = arg[len(prefix):].partition("=")
        if not sep:
            if i + 1 >= len(argv):
                raise ValueError(f"{arg} needs a value")
            value = argv[i + 1]
            i += 1
        dotted.setdefault(prefixes[prefix], {})[key.replace("-", "_")] = _json_or_text(value)
        i += 1
    return rest, dotted


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(expand_human_numbers_in_json(value))
    except ValueError:
        return value


def _take_positional_model(namespace: argparse.Namespace) -> None:
    tag = getattr(namespace, "model_tag", None)
    if tag is None:
        return
    if namespace.model not in (DEFAULT_MODEL, tag):
        raise ValueError(f"MODEL {tag!r} and --model {namespace.model!r} disagree: give one")
    namespace.model = tag


def engine_args_from_namespace(namespace: argparse.Namespace, dotted: dict[str, dict[str, Any]]) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(namespace, f.name)}
    for name, overrides in dotted.items():
        cls = NESTED_GROUPS[name]
        merged = msgspec.to_builtins(values[name] or {}) | overrides
        try:
            values[name] = convert_to_dataclass(merged, cls)
        except (ValueError, msgspec.ValidationError) as error:
            raise ValueError(f"{flag_name(name)}: {error}") from None
    return EngineArgs(**values)


def dashes_in_flag_names(argv: list[str]) -> list[str]:
    """`--max_model_len 512` is `--max-model-len 512`, as vLLM's parser takes it:
    underscores become dashes in the names of long flags (before any `.KEY`
    or `=VALUE`), never in values."""
    normalised = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg:
            name, sep, value = arg.partition("=")
            flag, dot, key = name.partition(".")
            arg = flag.replace("_", "-") + dot + key + sep + value
        normalised.append(arg)
    return normalised


def parse_engine_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineArgs]:
    """Parse argv (with --config and dotted nested keys) into EngineArgs."""
    argv = dashes_in_flag_names(list(sys.argv[1:] if argv is None else argv))
    try:
        argv, dotted = split_dotted_nested_args(expand_config_file(argv))
        namespace = parser.parse_args(argv)
        _take_positional_model(namespace)
        return namespace, engine_args_from_namespace(namespace, dotted)
    except ValueError as error:
        parser.error(str(error))

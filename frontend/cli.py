"""`fleet`: the command line. `fleet launch` serves; `fleet plan` prints what
a launch with the same flags would start, without starting anything."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from fleet.config.cli_args import OneLineErrorParser, add_engine_args, parse_engine_args
from fleet.config.vllm_flags import IGNORED_DEST, IgnoredFlag, add_vllm_flags
from fleet.core.launch.memory import check_fits, node_memory

logger = logging.getLogger("fleet.launch")

COMMANDS = {
    "launch": "Serve a model over an OpenAI-compatible HTTP API.",
    "serve": "The same as launch (vLLM's name for it).",
    "plan": "Print this node's resolved launch plan as JSON; starts nothing and reads no weights.",
    "prepare": "Build the CPU kernels and convert the model's files now, so that the first launch starts at once.",
    "proxy": "`fleet proxy --prefill URL... --decode URL...`: prefill/decode disaggregation in front of instances "
             "launched with --kv-transfer-config.",
    "bench": "`fleet bench serve --base-url URL ...`: load a running OpenAI-compatible server and report "
             "throughput and latencies (vLLM's `vllm bench serve`).",
}


VLLM_FLAGS_EPILOG = (
    "vLLM's `vllm serve` flags parse too (and --max_model_len for --max-model-len): those fleet has no use for "
    "are ignored, each with a line in the log saying why; those it cannot honour (LoRA, draft-model speculative "
    "decoding, quantization methods, ...) are refused. The list and the reasons: fleet/config/vllm_flags.py."
)


def launch_parser(command: str) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=f"fleet {command}", description=COMMANDS[command], epilog=VLLM_FLAGS_EPILOG)
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="Model to serve (same as --model).")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file of flag values; flags on the command line win.")
    add_engine_args(parser)
    add_vllm_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from fleet import __version__

        sys.stdout.write(f"fleet {__version__}\n")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:8} {text}" for name, text in COMMANDS.items()]
        message = f"usage: fleet {{{','.join(COMMANDS)}}} [MODEL] [flags] | fleet --version\n\n" + "\n".join(lines) + "\n"
        if argv and argv[0] not in ("-h", "--help"):
            sys.stderr.write(f"fleet: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}\n")
            return 2
        sys.stdout.write(message)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return _bench(rest)
    if command == "proxy":
        from fleet.frontend.proxy import main as proxy

        return proxy(rest)
    parser = launch_parser(command)
    namespace, engine_args = parse_engine_args(parser, rest)
    _log_ignored(command, getattr(namespace, IGNORED_DEST))
    if command in ("launch", "serve"):
        from fleet.core.ipc import private_socket_dir

        with private_socket_dir():  # the plan names the sockets: in there
            return _run(command, parser, engine_args)
    return _run(command, parser, engine_args)


def _run(command: str, parser: argparse.ArgumentParser, engine_args) -> int:
    """`command` (launch, serve, plan or prepare) with the parsed flags."""
    from fleet.core.launch.plan import build_node_plan, describe

    try:
        config = engine_args.create_config()
        plan = build_node_plan(config)  # the node's memory plan refuses what cannot fit
        serves = command in ("launch", "serve")
        if serves and config.device.device == "cpu":
            check_fits(node_memory(config))
    except ValueError as error:
        parser.error(str(error))
    if command == "plan":
        json.dump(describe(config, plan), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if command == "prepare":
        from fleet.frontend.prepare import prepare

        return prepare(config)
    from fleet.core.launch.launcher import launch

    return launch(config, plan)


def _log_ignored(command: str, ignored: tuple[IgnoredFlag, ...]) -> None:
    """One line on stderr per vLLM flag that this command ignores, before anything starts."""
    if not ignored:
        return
    if command in ("launch", "serve"):
        from fleet.core.launch.processes import log_as

        log_as("fleet-launch")  # as the launcher logs
    else:
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # as `fleet prepare` logs
    for flag in ignored:
        logger.warning("%s: ignored: %s", flag.flag, flag.reason)


def _bench(argv: list[str]) -> int:
    if argv[:1] != ["serve"]:
        sys.stderr.write("fleet bench: error: the only benchmark is `serve`: fleet bench serve --help\n")
        return 2
    from fleet.frontend.bench_serve import main as bench_serve

    bench_serve(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

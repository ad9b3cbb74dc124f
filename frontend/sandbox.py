"""The API server's side of its sandbox processes (sandbox_process.py): a
small pool that renders chat templates and checks grammars under a time
budget. A process that runs past --sandbox-timeout, or dies (a segfault in
native grammar code, an allocation past its memory limit), costs the one
request a 400 and is replaced; the API server itself only waits.

Calls block (the API server makes them on its worker threads); each waits
for an idle process, then at most the budget.
"""
from __future__ import annotations

import copy
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import threading
import time
from typing import Any, BinaryIO

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.launch.process_names import sandbox_name
from fleet.core.launch.processes import python_command
from fleet.core.sampling_params import InvalidParameter, StructuredOutputsParams

logger = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("<I")
CRASH_CAUSES = {"SIGSEGV": ": a grammar nested too deeply overflows llguidance's stack",
                "SIGABRT": ": native code ran out of memory"}
START_TIMEOUT_S = 60.0
"""A fresh process's start (Python and jinja2 imported) on a loaded machine; not a request's budget."""


class SandboxStartupInfo(msgspec.Struct):
    max_chars: int
    """Longest rendered prompt, string or list a template may make (--max-prompt-chars)."""
    memory_bytes: int
    """The process's data segment limit (--sandbox-memory-bytes)."""
    tokenizer_json: str | None
    """The model's tokenizer as HF tokenizers' JSON, for llguidance (None: the model ships none)."""
    vocab_size: int
    eos_token_ids: list[int]


def startup_info(config: FleetConfig, tokenizer) -> SandboxStartupInfo:
    """What the sandbox needs: the limits, and the tokenizer as the worker's
    llguidance sees it (workers/structured_output.py), so that a grammar is
    checked against the same vocabulary."""
    tokenizer_json = None
    vocab_size = config.model.hf_config.get("vocab_size") or 0
    if tokenizer is not None and hasattr(tokenizer, "backend_tokenizer"):
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        tokenizer_json = backend.to_str()
        vocab_size = max(vocab_size, len(tokenizer))
    return SandboxStartupInfo(config.frontend.max_prompt_chars, config.frontend.sandbox_memory_bytes,
                              tokenizer_json, vocab_size, list(config.model.eos_token_ids))


class RenderChat(msgspec.Struct, tag=True):
    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    variables: dict[str, Any]


class CheckGrammar(msgspec.Struct, tag=True):
    constraint: StructuredOutputsParams


class Rendered(msgspec.Struct, tag=True):
    text: str


class GrammarAccepted(msgspec.Struct, tag=True):
    pass


class Refused(msgspec.Struct, tag=True):
    message: str


SANDBOX_REQUEST = RenderChat | CheckGrammar
SANDBOX_REPLY = Rendered | GrammarAccepted | Refused


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(FRAME_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame, or None at the end of the stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    payload = stream.read(FRAME_HEADER.unpack(header)[0])
    return payload if len(payload) == FRAME_HEADER.unpack(header)[0] else None


class SandboxGone(Exception):
    """The process died or ran past its time; the message says which."""


class SandboxProcess:
    """One sandbox process and its pipes."""

    def __init__(self, name: str, info: SandboxStartupInfo):
        self.name = name
        self.popen = subprocess.Popen(python_command("fleet.frontend.sandbox_process", "--name", name),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""
        self._decoder = msgspec.msgpack.Decoder(SANDBOX_REPLY)
        write_frame(self.popen.stdin, msgspec.msgpack.encode(info))
        self.ready = False

    def call(self, request: bytes, timeout: float):
        """The reply to one encoded request, within `timeout` (after the process's start)."""
        if not self.ready:
            self._reply(START_TIMEOUT_S)
            self.ready = True
        try:
            write_frame(self.popen.stdin, request)
        except (BrokenPipeError, OSError):
            raise SandboxGone(self._exit_description()) from None
        return self._reply(timeout)

    def _reply(self, timeout: float):
        """Read one frame within `timeout` (select on the pipe, so that a
        process that hangs or dies is noticed without a blocked read)."""
        deadline = time.monotonic() + timeout
        fd = self.popen.stdout.fileno()
        while True:
            frame = self._frame_in_buffer()
            if frame is not None:
                return self._decoder.decode(frame)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxGone(f"it ran past the budget of {timeout:g} s")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise SandboxGone(self._exit_description())
                self._buffer += chunk

    def _frame_in_buffer(self) -> bytes | None:
        if len(self._buffer) < FRAME_HEADER.size:
            return None
        size = FRAME_HEADER.unpack_from(self._buffer)[0]
        end = FRAME_HEADER.size + size
        if len(self._buffer) < end:
            return None
        frame, self._buffer = self._buffer[FRAME_HEADER.size : end], self._buffer[end:]
        return frame

    def _exit_description(self) -> str:
        code = self.popen.wait(timeout=5)
        if code >= 0:
            return f"the sandbox process exited with code {code}"
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"the sandbox process crashed ({name}{CRASH_CAUSES.get(name, '')})"

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                stream.close()
            except OSError:
                pass


class Sandbox:
    """The pool. `render_chat` and `check_grammar` raise InvalidParameter for
    what a request cannot have, naming the limit it passed."""

    def __init__(self, api_server_index: int, info: SandboxStartupInfo, size: int, timeout: float):
        self.api_server_index = api_server_index
        self.info = info
        self.timeout = timeout
        self._started = 0
        self._lock = threading.Lock()
        self._idle: queue.Queue[SandboxProcess] = queue.Queue()
        self._all: list[SandboxProcess] = []
        for _ in range(size):
            self._idle.put(self._start())

    def _start(self) -> SandboxProcess:
        with self._lock:
            self._started += 1
            process = SandboxProcess(sandbox_name(self.api_server_index, self._started), self.info)
            self._all = [p for p in self._all if p.popen.poll() is None] + [process]
            return process

    def render_chat(self, request: RenderChat) -> str:
        reply = self._call(request, "messages", "rendering the chat template")
        return reply.text

    def check_grammar(self, constraint: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        self._call(CheckGrammar(constraint), param, "checking the structured output constraint")

    def _call(self, request, param: str, what: str):
        try:
            encoded = msgspec.msgpack.encode(request)
        except (OverflowError, TypeError, msgspec.EncodeError) as error:
            raise InvalidParameter(param, f"{what}: the request holds a value that cannot be used ({error})") from None
        process = self._idle.get()
        try:
            reply = process.call(encoded, self.timeout)
        except SandboxGone as gone:
            logger.warning("%s: %s failed: %s; starting a fresh one", process.name, what, gone)
            process.kill()
            process = self._start()
            raise InvalidParameter(param, f"{what} failed: {gone} (limits: --sandbox-timeout {self.timeout:g} s, "
                                          f"--sandbox-memory-bytes {self.info.memory_bytes})") from None
        finally:
            self._idle.put(process)
        if isinstance(reply, Refused):
            raise InvalidParameter(param, reply.message)
        return reply

    def close(self) -> None:
        for process in self._all:
            process.kill()

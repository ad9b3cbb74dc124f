"""The sandbox process: where an API server renders chat templates and
checks structured-output grammars, the two things a request can make
unbounded (a template is a program; llguidance is native code that a
deep grammar overflows the stack of).

Here the worst a request can do is cost this process: its data segment is
limited (--sandbox-memory-bytes: a template that allocates gigabytes gets a
MemoryError), and the API server kills and replaces it when a render or a
check runs past --sandbox-timeout or it crashes. The API server's memory and
CPU never see the work.

Talks over its stdin/stdout pipes: msgspec frames (sandbox.py), one request
at a time.
"""
from __future__ import annotations

import os
import resource
import sys
import threading

import msgspec

from fleet.core.launch.processes import die_with_parent, log_as
from fleet.core.sampling_params import InvalidParameter, StructuredOutputsParams
from fleet.frontend.chat_template import render_conversation
from fleet.frontend.sandbox import (
    SANDBOX_REQUEST,
    GrammarAccepted,
    Refused,
    RenderChat,
    Rendered,
    SandboxStartupInfo,
    read_frame,
    write_frame,
)

GRAMMAR_STACK_BYTES = 4 * 2**20
"""Stack of the thread that runs llguidance here: half a worker's main thread
(8 MiB), so that a grammar recursive enough to overflow a worker's stack
overflows here first (llguidance recurses once per chained rule: a 3,000-rule
chain crashed an 8 MiB stack)."""
PROBE_STEPS = 4
"""Tokens the grammar check follows after the first mask: some grammars
(`(a{1000}){1000}`) compile and give a first mask, then exhaust the lexer at
the next token."""


class GrammarChecker:
    """llguidance with the model's tokenizer, built at the first check."""

    def __init__(self, info: SandboxStartupInfo):
        self.info = info
        self._tokenizer = None

    def check(self, constraint: StructuredOutputsParams) -> str | None:
        """None when the worker will be able to follow `constraint`, else why not."""
        from llguidance import LLMatcher

        try:
            grammar = constraint.to_llguidance()
        except InvalidParameter as error:
            return str(error)
        tokenizer = self.tokenizer()
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            return f"invalid structured output constraint: {error.strip()}"
        return self._probe(LLMatcher(tokenizer, grammar, log_level=0))

    def _probe(self, matcher) -> str | None:
        """Compute the first masks as the worker will, following the first
        allowed token that is not an end of sequence."""
        import numpy as np

        words = np.zeros((self.tokenizer().vocab_size + 31) // 32, dtype=np.int32)
        eos = set(self.info.eos_token_ids)
        for _ in range(PROBE_STEPS + 1):
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            if matcher.is_error():
                return f"the structured output constraint cannot be followed: {matcher.get_error().splitlines()[0]}"
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            token = next((int(t) for t in allowed if int(t) not in eos), None)
            if token is None:
                return None
            matcher.consume_tokens([token])
        return None

    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            if self.info.tokenizer_json is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model ships none")
            self._tokenizer = LLTokenizer(self.info.tokenizer_json, n_vocab=self.info.vocab_size,
                                          eos_token=list(self.info.eos_token_ids) or None)
        return self._tokenizer


def handle(request, info: SandboxStartupInfo, grammars: GrammarChecker):
    if isinstance(request, RenderChat):
        try:
            return Rendered(render_conversation(
                request.template, request.messages, tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                variables=request.variables, max_chars=info.max_chars))
        except ValueError as error:
            return Refused(str(error))
        except (MemoryError, RecursionError) as error:
            return Refused(f"the chat template needed more than the sandbox allows ({type(error).__name__}; "
                           f"--sandbox-memory-bytes {info.memory_bytes})")
    return _on_grammar_stack(lambda: _checked(grammars, request.constraint))


def _checked(grammars: GrammarChecker, constraint: StructuredOutputsParams):
    try:
        why = grammars.check(constraint)
    except (ValueError, MemoryError) as error:
        why = f"the structured output constraint cannot be used: {error}"
    except RecursionError:  # a JSON schema given as text, nested past Python's recursion limit
        why = "the structured output constraint cannot be used: it nests too deeply"
    return GrammarAccepted() if why is None else Refused(why)


def _on_grammar_stack(work):
    result = []
    threading.stack_size(GRAMMAR_STACK_BYTES)
    thread = threading.Thread(target=lambda: result.append(work()), name="grammar")
    thread.start()
    thread.join()
    return result[0] if result else Refused("the structured output constraint could not be checked")


def main() -> None:
    log_as(sys.argv[sys.argv.index("--name") + 1])
    die_with_parent()
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    info = msgspec.msgpack.decode(read_frame(requests), type=SandboxStartupInfo)
    resource.setrlimit(resource.RLIMIT_DATA, (info.memory_bytes, info.memory_bytes))
    grammars = GrammarChecker(info)
    decoder = msgspec.msgpack.Decoder(SANDBOX_REQUEST)
    write_frame(replies, msgspec.msgpack.encode(Rendered("")))  # ready
    while (frame := read_frame(requests)) is not None:
        write_frame(replies, msgspec.msgpack.encode(handle(decoder.decode(frame), info, grammars)))


if __name__ == "__main__":
    main()

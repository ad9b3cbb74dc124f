"""The HTTP side: where the OpenAI-compatible API listens, and how many servers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleet.config.fields import HumanInt


@dataclass(frozen=True)
class FrontendConfig:
    """Frontend: the HTTP server, its address, key and process count."""

    host: str = "127.0.0.1"
    """Address the HTTP server listens on (0.0.0.0 for every interface)."""
    port: int = 8000
    """HTTP port."""
    api_key: list[str] | None = None
    """Keys of which clients must send one as `Authorization: Bearer KEY`. Default: $FLEET_API_KEY, else none."""
    api_server_count: int = 1
    """Number of API server processes; all of them reach every engine of this node."""
    max_request_body_bytes: HumanInt = 8 * 2**20
    """Largest HTTP request body (e.g. 8M); a larger one is answered 413 (before it is read, when it gives its length)."""
    metrics_require_key: bool = False
    """/metrics needs the API key too (by default it is open, as /health and /ping, for scrapers)."""
    http_header_timeout: float = 10.0
    """Seconds a connection has to send a request's head (line and headers); then it is closed (slow clients)."""
    http_keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection stays open between requests."""
    max_connections: int = 1000
    """Open HTTP connections each API server serves; one past it gets a 503 and is closed."""
    shutdown_timeout: float = 10.0
    """Seconds that SIGINT/SIGTERM waits for processes to end before they are killed."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "warning"
    """Log level of the HTTP server's access log."""
    chat_template: str | None = None
    """The chat template instead of the model's: a file, or the Jinja template itself."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice "auto"): its calls are read from its text by --tool-call-parser."""
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    """How tool calls are written in the model's text: hermes (<tool_call>{...}</tool_call>, Hermes and Qwen models) or llama3_json (a JSON object with name and parameters, Llama 3)."""
    trust_request_chat_template: bool = False
    """Let a request bring its own `chat_template` (a program the server runs; refused without this flag, as vLLM)."""
    max_prompt_chars: HumanInt | None = None
    """Longest prompt text, rendered chat or given, before it is tokenised; also bounds what a chat template may build. Unset: 32 characters per token of --max-model-len."""
    max_tools: int = 128
    """Most tools one chat request may list (OpenAI's limit)."""
    max_inputs_per_request: int = 2048
    """Most prompts in one completions request, or inputs in one embeddings request (OpenAI's limit)."""
    max_request_tokens: HumanInt = 128 * 2**10
    """Most tokens one request may count, summed over its prompts: n x (prompt tokens + max_tokens + logprob entries), the entries being per position and alternative returned, prompt tokens x (prompt_logprobs + 1) and max_tokens x (logprobs + 1) (frontend/request_tokens.py). A chat without max_tokens gets what fits."""
    max_structured_choices: int = 4096
    """Most strings in a structured output `choice`."""
    sandbox_processes: int = 2
    """Processes per API server that render chat templates and check grammars (a request's template or grammar can cost only them)."""
    sandbox_timeout: float = 3.0
    """Seconds one chat template render or grammar check may take; past it the request gets a 400 and the process is replaced."""
    sandbox_memory_bytes: HumanInt = 2**30
    """Memory (data segment) of each sandbox process: a template or grammar needing more gets a 400."""
    root_path: str | None = None
    """The path prefix a path-based proxy in front serves fleet under (FastAPI's root_path, for /docs); the proxy strips it."""
    disable_fastapi_docs: bool = False
    """Serve no /docs, /redoc or /openapi.json."""
    max_stored_responses: int = 1000
    """Most Responses API responses each API server keeps for each --api-key key (for all clients without one; GET /v1/responses/{id}, previous_response_id); the key's oldest go first. 0 stores none."""
    max_stored_response_bytes: HumanInt = 64 * 2**20
    """Most bytes of stored responses (their JSON) each API server keeps, all keys together; past it the oldest of the key holding the most bytes goes."""

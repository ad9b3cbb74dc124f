"""fleet: a multi-process, distributed LLM server with an OpenAI-compatible API."""
__version__ = "0.1.0"

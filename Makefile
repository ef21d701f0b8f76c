# The quick start: `make serve` (the service on ./mint-data) and `make test`.
# Both create or reuse .venv and install everything themselves.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STORE ?= ./mint-data
PORT ?= 8470

.PHONY: venv test serve lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# pin torch first: on these machines it is a CPU wheel on local disk; unpinned it is GBs
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q

serve: venv
	$(BIN)/mint serve --store $(STORE) --port $(PORT)

lint: venv
	$(BIN)/ruff check mint_store engine_client tools tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Everything bootstraps a local .venv from nothing but python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kernelexec demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

check: $(STAMP)
	$(BIN)/ruff check kernelexec tests benchmarks
	$(BIN)/ruff format --check kernelexec tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

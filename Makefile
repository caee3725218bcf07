# Everything bootstraps a local .venv from nothing but python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check docs dist ci bench bench-neighbours soak bwrap clean browser suites letta-suite

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo needs the base package only: its own venv, without the development set.
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEMO_VENV)/bin/python -m pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/kernelexec demo

# The hostile suite's bubblewrap cases need bwrap: install it where we can (root with apt),
# quietly and only if missing; elsewhere those cases skip and say why.
bwrap:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& (apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
		|| (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1)) \
		|| echo "bubblewrap not installed: the bwrap cases will skip"; }

# The suite runs twice: on the fast paths (tool calls served by the kernel side, kernels forked
# from a fork server), then on the fallbacks (execute requests, plain launches).
# The agent frameworks' own test suites ship in their sdists, not their wheels: fetched once
# into .cache/suites (from the package index); without them those tests skip and say why.
suites: $(STAMP)
	@$(BIN)/python tests/support/fetch_suites.py .cache/suites >/dev/null \
		|| echo "could not fetch the frameworks' test suites: those tests will skip"

test: $(STAMP) bwrap browser suites
	$(BIN)/python -m pytest -q -n 2 tests
	KERNELEXEC_FAST_CALLS=0 KERNELEXEC_NO_FORK_SERVER=1 \
		$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider tests

# The browser tests need Debian's chromium (Playwright cannot download its own browser here):
# installed when we can (root with apt-get); otherwise those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1; } \
		|| echo "chromium is not installed: the browser tests will be skipped"

check: $(STAMP)
	$(BIN)/ruff check kernelexec tests benchmarks conformance docs/_hooks
	$(BIN)/ruff format --check kernelexec tests benchmarks conformance docs/_hooks
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site (MkDocs + Material, API pages from the docstrings), warnings as errors.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The sdist and wheel, checked as PyPI would check them.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist . >/dev/null
	$(BIN)/twine check --strict dist/*

# What CI runs: the checks, the docs, the packages, then the tests.
ci: check docs dist test

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py

# A hostile tenant's attacks against another session's warm calls (issue 35; root).
bench-neighbours: $(STAMP)
	$(BIN)/python benchmarks/neighbours.py

soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

# Letta's own local-sandbox tests through the adapter (a venv of Letta 0.11.7 of its own; slow
# the first time): conformance/letta/README.md.
letta-suite:
	conformance/letta/run.sh

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache site dist .cache

# The two entry points of the README; both set up .venv first (fast when done).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlxrt-setup
# AIPerf's own venv (its pins conflict with the project's), built by bootstrap.sh too.
LOADGEN := .venv-loadgen/bin/aiperf

.PHONY: setup serve demo test test-all test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml .ci/bootstrap.sh $(LOADGEN)
	@bash .ci/bootstrap.sh
	@touch $@

# No recipe: when it is missing, the stamp above is out of date and bootstrap.sh rebuilds it.
$(LOADGEN):

# Main job: serve the default model (SmolLM2-135M-Instruct) on a Unix socket (Ctrl-C stops it).
serve: setup
	$(PY) -m tools.cli serve --config configs/default.toml

demo: setup
	$(PY) -m tools.cli demo --config configs/default.toml

# The suite (CI runs it) on two pytest-xdist workers (the machine's two cores), a test module to
# each at a time (module fixtures are built once), without the `exhaustive` cases (further
# models, modes or formats of a behaviour whose other cases run). docs/tests.md says what runs where.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

test: setup
	$(PY) -m pytest -q $(XDIST) -m "not exhaustive"

# Every test, the `exhaustive` cases too.
test-all: setup
	$(PY) -m pytest -q $(XDIST)

# The inner loop: the suite without the tests marked slow, server or distributed (pyproject's
# [tool.pytest.ini_options] markers; docs/tests.md).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow and not server and not distributed and not exhaustive"

# ruff (lint and format), mypy, and the layering contract (pyproject's [tool.importlinter]:
# each package imports only those below it; protocols and policies never import mlx or anyio).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

bench: setup
	$(PY) -m tools.cli bench --config configs/bench.toml

clean:
	rm -rf $(VENV) .venv-loadgen .pytest_cache .hypothesis

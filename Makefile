# The two entry points of the README; both set up .venv first (fast when done).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlxrt-setup

.PHONY: setup serve demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml .ci/bootstrap.sh
	@bash .ci/bootstrap.sh
	@touch $@

# Main job: until the socket server lands, a one-shot demo generation on the built-in model.
serve: setup
	$(PY) -m runtime.cli demo --config configs/default.toml

demo: serve

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m runtime.cli bench --config configs/bench.toml

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The two commands: `make run` (the default job) and `make test` (the whole suite).
# Both create .venv when it is missing and install neocfg into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.neocfg-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/neocfg $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Benchmarks (not part of CI): each prints ratios measured side by side in one run and writes JSON.
bench: $(STAMP)
	$(PY) bench/bench_planner.py --quick
	$(PY) bench/bench_embedding.py
	$(PY) bench/bench_e2e.py
	$(PY) bench/prediction_error.py
	$(PY) bench/bench_dpp.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

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

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

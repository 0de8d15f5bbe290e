# The two commands: `make run` (the default job) and `make test` (the whole suite).
# Both create .venv when it is missing and install neocfg into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.neocfg-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test test-fast test-torchrec bench clean torchrec-env gpu-check

# TorchRec 1.8 (for bench/bench_vs_torchrec.py and the interop tests) lives in an environment of its own: it is
# installed without its dependencies (its fbgemm-gpu requirement would pull a CUDA build; fbgemm-gpu-cpu serves).
TR_VENV ?= .venv-torchrec
TR_PY := $(TR_VENV)/bin/python
TR_STAMP := $(TR_VENV)/.neocfg-installed

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

$(TR_STAMP): pyproject.toml
	@test -x $(TR_PY) || $(PYTHON) -m venv $(TR_VENV)
	$(TR_PY) -m pip install --quiet -e '.[test]'
	$(TR_PY) -m pip install --quiet --no-deps torchrec==1.8.0
	$(TR_PY) -m pip install --quiet tensordict 'torchmetrics==1.0.3' pyre-extensions iopath
	@touch $(TR_STAMP)

torchrec-env: $(TR_STAMP)

run: $(STAMP)
	$(VENV)/bin/neocfg $(ARGS)

# The whole suite, then (when no PYTEST_ARGS narrow it) the TorchRec interop tests in .venv-torchrec, where TorchRec
# is installed (in .venv they are skipped, saying so). Targeted runs (PYTEST_ARGS set) need only .venv.
TORCHREC_TESTS := tests/test_interop_torchrec.py tests/test_interop_criteo.py tests/test_interop_torchrec_oracle.py

test: $(STAMP) $(if $(strip $(PYTEST_ARGS)),,$(TR_STAMP))
	$(PY) -m pytest -q $(PYTEST_ARGS)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(TR_PY) -m pytest -q $(TORCHREC_TESTS)
endif

# The edit-test loop: config, planner, docs and unit tests (no training runs, no rank processes, no Ray), a few
# minutes on 2 cores. `make test` stays the whole suite (CI).
FAST_TESTS := tests/test_config.py tests/test_docs.py tests/test_plan_check.py tests/test_planner_bound.py \
	tests/test_planner_cli.py tests/test_planner_costs.py tests/test_planner_dpp.py tests/test_planner_options.py \
	tests/test_planner_solve.py tests/test_interop_export.py tests/test_runtime_units.py tests/test_runtime_sharding.py \
	tests/test_runtime_dense.py tests/test_runtime_replicated.py tests/test_data_transforms.py \
	tests/test_data_sizing.py tests/test_timing_precision.py tests/test_synthetic_source.py

# The infeasible-model CLI test runs the ILP-verified fit-advice search (about 4 minutes): whole suite only.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(FAST_TESTS) --deselect tests/test_planner_cli.py::test_infeasible_exits_nonzero_with_one_line $(PYTEST_ARGS)

test-torchrec: $(TR_STAMP)
	$(TR_PY) -m pytest -q $(TORCHREC_TESTS)

# Correctness on CUDA, for a machine with a GPU (CI has none; there these tests skip): one GPU, world size 1 over
# NCCL, every memory tier (HBM, UVM caching, UVM), fp16 weights, bf16 dense, the CUDA-event stopwatch.
gpu-check: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device visible to torch ' + torch.__version__ + ' (install a CUDA build of torch and fbgemm-gpu)')"
	$(PY) -m pytest -q -rs tests/test_gpu.py $(PYTEST_ARGS)

# Benchmarks (not part of CI): each prints ratios measured side by side in one run and writes JSON.
bench: $(STAMP)
	$(PY) bench/bench_planner.py --quick
	$(PY) bench/bench_embedding.py --record
	$(PY) bench/bench_e2e.py --record
	$(PY) bench/prediction_error.py
	$(PY) bench/bench_dpp.py

clean:
	rm -rf $(VENV) $(TR_VENV) outputs multirun .pytest_cache

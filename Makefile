# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# A stamp per extras set: re-install only when pyproject.toml changes.
STAMP_RUN  := $(VENV)/.stamp-run
STAMP_TEST := $(VENV)/.stamp-test

export PREFECT_HOME ?= $(CURDIR)/.smthrs/prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export DO_NOT_TRACK = 1
export PREFECT_LOGGING_LEVEL ?= WARNING
export PREFECT_SERVER_LOGGING_LEVEL ?= CRITICAL
export PREFECT_LOGGING_ROOT_LEVEL ?= CRITICAL
# Prefect waits only 20 s for its ephemeral server; a first start on a fresh, busy 2-core machine needs longer.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
# `make test` runs the suite on TEST_WORKERS pytest-xdist workers (0: in one process). A worker is a session of its
# own (Prefect server, moto server, temporary tree); `--dist loadfile` keeps a test file's module fixtures on one.
# Most tests wait on subprocesses, servers and fsync, so two workers halve the wall time even on 2 cores. The 30
# slowest tests are listed at the end: where the suite's time goes.
TEST_WORKERS ?= 2
# `make test-stress`: the suite STRESS_RUNS times in a row with every core kept busy (.ci/stress), on the same
# workers as `make test` (PYTEST_ARGS adds to them, as it does for `make test`).
STRESS_RUNS ?= 3

.PHONY: demo test test-stress lint docs docs-serve bench clean bytecode

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,dev,docs]'
	touch $@ $(STAMP_RUN)

# The project's own bytecode, written once. An editable install leaves it unwritten, and where the environment sets
# PYTHONDONTWRITEBYTECODE (container images often do) no process ever writes it: every CLI call, server, flow run and
# worker the suite and the demo start would compile the package's ~200 modules from source again (~0.4 s of CPU each).
bytecode: | $(BIN)/python
	@$(BIN)/python -m compileall -q -j 0 smthrs_plugin tests examples benchmarks tools

demo: $(STAMP_RUN) bytecode
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python examples/quickstart.py

test: $(STAMP_TEST) bytecode
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

test-stress: $(STAMP_TEST) bytecode
	@mkdir -p $(PREFECT_HOME)
	PYTHON=$(BIN)/python .ci/stress $(STRESS_RUNS) -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The house's rules run from the repo itself: import contracts in pyproject.toml (floors, no cycles, private
# modules), the same private-module rule for tests/benchmarks/examples, and the module size ceiling.
lint: $(STAMP_TEST)
	$(BIN)/ruff check smthrs_plugin tests benchmarks examples tools
	$(BIN)/ruff format --check smthrs_plugin tools
	$(BIN)/mypy smthrs_plugin
	$(BIN)/lint-imports
	$(BIN)/python tools/check_test_imports.py
	$(BIN)/python tools/check_module_size.py

# The docs site (mkdocs.yml, docs/): --strict turns every broken link, anchor and generated page into a failure.
docs: $(STAMP_TEST)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: $(STAMP_TEST)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(STAMP_TEST) bytecode
	@mkdir -p $(PREFECT_HOME)
	@for b in benchmarks/[!_]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .smthrs .pytest_cache

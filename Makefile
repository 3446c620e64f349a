# loom: `make demo` and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-all demo lint format bench clean

setup: $(STAMP)

# The stamp is rebuilt when the project's dependencies change; otherwise setup does nothing.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 11) else 1)" 2>/dev/null \
		|| $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test]"
	@touch $(STAMP)

lint: setup
	$(BIN)/ruff check loom tests benchmarks examples
	$(BIN)/ruff format --check loom tests benchmarks examples

format: setup
	$(BIN)/ruff format loom tests benchmarks examples
	$(BIN)/ruff check --fix loom tests benchmarks examples

# `make test` samples the slow cases (tests marked `slow`: more combinations of the same features);
# `make test-all` runs every case. Both print the 15 slowest tests. Two pytest processes: one runs every
# test that uses the multi-rank worker pool, in two groups each run by one process, the rest filling in (see tests/conftest.py).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

test: setup lint
	$(PYTEST) -m "not slow"

test-all: setup lint
	$(PYTEST)

# The main job (a small GPT learning arithmetic on 4 workers, dp=2 x tp=2, optimizer level 1), then the two
# MindSpore layout examples checked against one device.
demo: setup
	$(BIN)/loom train configs/demo.toml
	$(BIN)/python examples/demo.py

bench: setup
	$(BIN)/python benchmarks/dp_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info

# loom: `make demo` and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-all demo lint format bench gpu-wheels clean

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

# The wheels benchmarks/gpu_step.py installs on a GPU machine (no network) when its image lacks one of the
# packages it needs besides torch (benchmarks/gpu_deps.py REQUIRED; docs/gpu.md). For CPython 3.12, the GPU
# image's python3, and 3.11; manylinux x86_64. One folder, refilled each time; it must travel with the working
# tree (`carry`), so the last step checks the two together against the device tool's 64 MiB.
GPU_WHEELS := .gpu-wheels
GPU_PYTHONS ?= 3.12 3.11
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

gpu-wheels: setup
	rm -rf $(GPU_WHEELS)
	for v in $(GPU_PYTHONS); do \
		$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
			--python-version $$v $(foreach p,$(GPU_PLATFORMS),--platform $(p)) -d $(GPU_WHEELS) \
			$$($(BIN)/python benchmarks/gpu_deps.py names) || exit 1; \
	done
	ls -s --block-size=K $(GPU_WHEELS)
	$(BIN)/python benchmarks/gpu_deps.py size $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info $(GPU_WHEELS)

# Everything the project needs is installed by these targets into ./.venv (no manual steps).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install run test test-fast test-crash-long lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned to the deployed release; its wheel is on the build machines' disk.
	$(BIN)/python -m pip install -q "torch==2.14.1"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The main job: train a small model with async checkpoints into ./runs/demo and print what was committed.
run: $(STAMP)
	$(BIN)/python examples/train_lightning.py --dirpath runs/demo

## The whole test suite (slow multi-process, crash-matrix and soak tests included).
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## The shutdown-crash test's long matrix: 50 forked runs per path (`make test` runs 8; docs/reliability.md).
test-crash-long: $(STAMP)
	LAC_CRASH_RUNS=50 $(BIN)/python -m pytest -q tests/system/test_shutdown_crash.py

lint: $(STAMP)
	$(BIN)/ruff check lightning_async_ckpt tests examples benchmarks
	$(BIN)/ruff format --check lightning_async_ckpt tests examples benchmarks

bench: $(STAMP)
	$(BIN)/lightning-async-ckpt bench

clean:
	rm -rf $(VENV) runs .pytest_cache

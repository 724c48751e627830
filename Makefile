# The two Quickstart commands: `make demo` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# the CPU wheel first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# compile the numba kernels once now (numba caches them), so the first demo or test run
	# does not spend its first steps compiling
	$(PY) -m integration.train --tables uniform:100000 --steps 3 --batch 256 --hot 1000 \
		--eval-batches 1 --prefetch 2 --no-progress --run-dir $(VENV)/warmup >/dev/null
	rm -rf $(VENV)/warmup
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m integration.train --demo

test: $(STAMP)
	$(PY) -m ruff check tierstore tests bench integration
	$(PY) -m pytest -q -n auto

bench: $(STAMP)
	$(PY) -m bench.store

clean:
	rm -rf $(VENV) demo_store bench/out

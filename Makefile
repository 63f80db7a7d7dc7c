# Set-up, demo and tests. `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo check test test-all lint clean test-torch gpu-wheels

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first, so that resolving the other dependencies never pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar plan --model llama2-7b --cluster 8xA100-80GB --global-batch-size 8 --seq-len 2048 --explain
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/train_llama.py --steps 5

# Three tiers, chosen by the markers of pyproject.toml; each prints its 15 slowest tests.
# check: the unit tests, which start no process (under a minute on 2 cores): the loop while developing.
# test: adds whole models planned and trained in process and on gloo ranks, the CLI, the golden plans (what CI runs).
# test-all: adds the tests marked slow.
# test and test-all run JOBS pytest workers (pytest-xdist), each test file on one worker, the longest files first
# (tests/conftest.py); JOBS=0: in one process.
PYTEST := TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests --durations=15
JOBS ?= 2
# A worker that crashes (a segmentation fault in a test) fails the run at once, naming the test it ran: with workers
# restarted after a crash, pytest-xdist's loadfile scheduling waited for ever (tests/test_tiers.py).
XDIST := -n $(JOBS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0

check: $(STAMP)
	$(PYTEST) -m "not distributed and not subprocess and not integration and not slow" $(PYTEST_ARGS)

test: $(STAMP)
	$(PYTEST) $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PYTEST) $(XDIST) $(PYTEST_ARGS)

# The smoke tier (tests marked smoke) on another torch release, in its own environment .venv-torch-<release>:
# `make test-torch TORCH=2.11.0`. The registry's Linux wheels of torch are CUDA builds (several GB; they run on
# CPU): slow to install, so this is on demand. Triton comes pinned by torch's own requirements; transformers is
# pinned per release below (the one tested with it), the newest otherwise.
TORCH ?= 2.13.0
TORCH_VENV := .venv-torch-$(TORCH)
TRANSFORMERS_2.11.0 := 5.17.0
TRANSFORMERS_2.13.0 := 5.25.0
TRANSFORMERS_2.15.0 := 5.25.0
TRANSFORMERS_PIN := $(if $(TRANSFORMERS_$(TORCH)),==$(TRANSFORMERS_$(TORCH)),)

$(TORCH_VENV)/.installed: pyproject.toml
	test -x $(TORCH_VENV)/bin/python || python3 -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH) 'transformers$(TRANSFORMERS_PIN)'
	$(TORCH_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_VENV)/bin/python -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(TORCH_VENV)/bin/python -m pytest -q tests -m smoke --durations=0 -p no:cacheprovider $(PYTEST_ARGS)

# Wheels a GPU machine without network lacks: pulp and highspy (the versions the tests run with) for CPython 3.12
# on x86-64 Linux, into gpu-wheels/ (ignored by git; copy it along with the tree). See docs/gpu.md.
GPU_WHEELS := pulp==3.3.2 highspy==1.16.0
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d gpu-wheels $(GPU_WHEELS)

lint: $(STAMP)
	test -x $(VENV)/bin/ruff || $(PY) -m pip install -q 'ruff>=0.6'
	$(VENV)/bin/ruff check autopar passes cost_model triton_kernels tests examples
	$(VENV)/bin/ruff format --check autopar passes cost_model triton_kernels tests examples
	# the layers (base -> cost model -> plans -> passes -> programs -> planning -> api/cli/bench), on the source
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

clean:
	rm -rf $(VENV) *.egg-info

# Set-up, demo and tests. `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo check test test-all lint clean

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
# test and test-all run JOBS pytest workers (pytest-xdist), each test file on one worker; JOBS=0: in one process.
PYTEST := TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests --durations=15
JOBS ?= 2

check: $(STAMP)
	$(PYTEST) -m "not distributed and not subprocess and not integration and not slow" $(PYTEST_ARGS)

test: $(STAMP)
	$(PYTEST) -n $(JOBS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PYTEST) -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	test -x $(VENV)/bin/ruff || $(PY) -m pip install -q 'ruff>=0.6'
	$(VENV)/bin/ruff check autopar passes cost_model triton_kernels tests examples
	$(VENV)/bin/ruff format --check autopar passes cost_model triton_kernels tests examples

clean:
	rm -rf $(VENV) *.egg-info

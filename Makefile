# Set-up, demo and tests. `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first, so that resolving the other dependencies never pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar plan --model llama2-7b --cluster 8xA100-80GB --global-batch-size 8 --seq-len 2048 --explain
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/train_llama.py --steps 5

# The suite without the tests marked slow (the whole of it: `make test-all`).
test: $(STAMP)
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests -m "not slow" --durations=25 $(PYTEST_ARGS)

test-all: $(STAMP)
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests $(PYTEST_ARGS)

lint: $(STAMP)
	test -x $(VENV)/bin/ruff || $(PY) -m pip install -q 'ruff>=0.6'
	$(VENV)/bin/ruff check autopar passes cost_model triton_kernels tests examples
	$(VENV)/bin/ruff format --check autopar passes cost_model triton_kernels tests examples

clean:
	rm -rf $(VENV) *.egg-info

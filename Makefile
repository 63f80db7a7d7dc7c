# Set-up, demo and tests. `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint clean test-torch

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

# The smoke tier (tests marked smoke) on another torch release, in its own environment .venv-torch-<release>:
# `make test-torch TORCH=2.11.0`. Releases other than 2.13.0 come from the registry as CUDA builds (several GB,
# they run on CPU): slow to install, so this is on demand. Triton comes pinned by torch's own requirements;
# transformers is pinned per release below (the one tested with it), the newest otherwise.
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

lint: $(STAMP)
	test -x $(VENV)/bin/ruff || $(PY) -m pip install -q 'ruff>=0.6'
	$(VENV)/bin/ruff check autopar passes cost_model triton_kernels tests examples
	$(VENV)/bin/ruff format --check autopar passes cost_model triton_kernels tests examples

clean:
	rm -rf $(VENV) *.egg-info

"""Shared setup of the Triton kernel tests: interpreter mode without a GPU, and the device of the inputs.

Triton reads ``TRITON_INTERPRET`` when ``triton.language`` is imported and when each kernel is defined, so it is
set here at import time, before the test modules import the kernels. Without a GPU the package also turns the
interpreter on by itself (see ``autopar.triton_kernels.kernels_interpreted``), so the tests work whichever test
module of a larger run imports triton first. With a GPU and no ``TRITON_INTERPRET`` in the environment the same
tests run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from autopar.triton_kernels import kernels_interpreted  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """Where the kernels can run: any device in the interpreter (the CPU is used), else the GPU."""
    return torch.device("cpu") if kernels_interpreted() else torch.device("cuda")

"""`compile(..., compile_mode=...)`: the program's graph run through `torch.compile` trains as it does without.

One CPU rank, the sharded program (full recompute: its lowered graph has checkpointed regions and parameter hooks,
what torch.compile has to run through); Inductor compiles on the CPU with the machine's C++ compiler.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from tests.models import make_batch, make_model

# fp32: Inductor fuses and reorders the same arithmetic (seen: ~1e-7 relative on the loss after three steps); a
# wrong gradient or a skipped update moves the second and third losses by ~1e-3
LOSS_RTOL = 1e-5


def _optimizer(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _run(steps: int, evaluate: bool, **options):
    args, kwargs = make_batch("llama")
    pm = autopar.compile(
        make_model("llama"), "cpu:1", args, kwargs, optimizer=_optimizer, constraints={"recompute": "full"}, **options
    )
    losses = [pm.train_step(*args, **kwargs) for _ in range(steps)]
    return pm, losses + ([pm.eval_step(*args, **kwargs)] if evaluate else [])


def _losses(**options):
    return _run(3, False, **options)


# slow: Inductor compiles the training graph with the C++ compiler (about 50 s on a busy 2-core machine)
@pytest.mark.slow
@pytest.mark.subprocess  # Inductor runs the C++ compiler
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler")
def test_compiled_sharded_graph_trains_as_the_plain_one():
    plain, want = _losses()
    compiled, got = _losses(compile_mode="default")
    assert compiled.plan.program == plain.plan.program == "sharded"
    assert compiled._interp.runs is not compiled._interp.gm  # the step ran what torch.compile made
    assert got == pytest.approx(want, rel=LOSS_RTOL)


# slow: Inductor compiles the eval graph apart from the training one (a minute on a busy 2-core machine, as long as
# the training graph)
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler")
def test_compiled_eval_graph_gives_the_plain_eval_loss():
    plain, want = _run(1, True)
    compiled, got = _run(1, True, compile_mode="default")
    assert compiled._eval_interp.runs is not compiled._eval_interp.gm  # the eval step ran what torch.compile made
    assert got == pytest.approx(want, rel=LOSS_RTOL)


def test_unknown_compile_mode_is_refused():
    with pytest.raises(ConfigError, match="not a torch.compile mode"):
        _losses(compile_mode="fastest")

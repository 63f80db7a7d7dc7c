"""The loop options `compile` takes: what each plan sets on its program before any rank runs a step."""

from types import SimpleNamespace

import pytest

from autopar.errors import ConfigError
from autopar.loop import LoopOptions
from autopar.loss import LossSpec


def _loss(outputs, batch):
    return outputs.sum()


class _Program:
    def __init__(self):
        self.loop = None

    def configure_loop(self, **kwargs):
        self.loop = kwargs


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"pp": 2}, {"dp": 2}, {"pp": 2, "cp": 2}])
def test_a_loss_fn_is_set_on_every_plan(mesh):
    program = _Program()
    LoopOptions(loss=LossSpec(_loss)).apply(program, SimpleNamespace(mesh=mesh, max_grad_norm=None))
    assert program.loop["loss"].fn is _loss and program.loop["max_grad_norm"] is None


def test_compile_max_grad_norm_wins_over_the_plans():
    program = _Program()
    LoopOptions(max_grad_norm=0.5).apply(program, SimpleNamespace(mesh={"dp": 2}, max_grad_norm=1.0))
    assert program.loop["max_grad_norm"] == 0.5
    LoopOptions().apply(program, SimpleNamespace(mesh={"dp": 2}, max_grad_norm=1.0))
    assert program.loop["max_grad_norm"] == 1.0


def test_bad_loop_options_are_refused():
    with pytest.raises(ConfigError, match="local_batch"):
        LoopOptions(local_batch="yes")

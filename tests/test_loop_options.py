"""The loop options `compile` takes: what each plan refuses before any rank runs a step."""

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


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"pp": 2}, {"dp": 2}])
def test_a_loss_fn_is_set_on_plans_it_is_checked_on(mesh):
    program = _Program()
    LoopOptions(loss=LossSpec(_loss)).apply(program, SimpleNamespace(mesh=mesh, max_grad_norm=None))
    assert program.loop["loss"].fn is _loss


def test_a_loss_fn_on_a_cp_and_pp_plan_is_refused_before_the_program_is_set():
    program = _Program()
    plan = SimpleNamespace(mesh={"pp": 2, "cp": 2}, max_grad_norm=None)
    with pytest.raises(ConfigError, match="both a cp and a pp axis"):
        LoopOptions(loss=LossSpec(_loss)).apply(program, plan)
    assert program.loop is None

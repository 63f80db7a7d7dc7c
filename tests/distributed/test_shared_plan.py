"""compile plans on rank 0 only: the other ranks run its plan, raise its planning error, and wait a bounded time."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

import autopar
from autopar import api
from autopar.errors import ConfigError, InfeasiblePlanError, LoweringError
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed


@contextlib.contextmanager
def _replaced_planning(fn, wait_s: str | None = None):
    """compile's planning replaced by `fn` (and the plan wait set) on this rank, restored after: pooled ranks
    run the next test with the library as it was."""
    before, env = api.plan_to_compile, os.environ.get("AUTOPAR_PLAN_WAIT_S")
    api.plan_to_compile = fn
    if wait_s is not None:
        os.environ["AUTOPAR_PLAN_WAIT_S"] = wait_s
    try:
        yield
    finally:
        api.plan_to_compile = before
        if env is None:
            os.environ.pop("AUTOPAR_PLAN_WAIT_S", None)
        else:
            os.environ["AUTOPAR_PLAN_WAIT_S"] = env


def _compile(rank: int, world_size: int):
    args, kwargs = make_batch("llama")

    def no_planning(request):  # a rank other than 0 that planned would fail here
        raise AssertionError(f"rank {rank} planned")

    with _replaced_planning(no_planning if rank != 0 else api.plan_to_compile):
        pm = autopar.compile(make_model("llama"), "cpu:2", args, kwargs, constraints={"tp": 2})
    return {"plan": pm.plan.to_json(), "loss": pm.train_step(*args, **kwargs)}


def test_only_rank_zero_plans_and_every_rank_runs_its_plan():
    got = run_distributed(_compile, 2)
    assert got[0]["plan"] == got[1]["plan"]
    assert '"tp": 2' in got[0]["plan"]
    assert got[0]["loss"] == got[1]["loss"]


def _infeasible(rank: int, world_size: int):
    args, kwargs = make_batch("llama")
    try:  # 1 kB a device: no layout fits
        autopar.compile(make_model("llama"), "cpu:2", args, kwargs, memory_budget=1000)
    except InfeasiblePlanError as e:
        return str(e)
    return None


def test_rank_zeros_planning_error_is_raised_on_every_rank_as_its_class():
    mine, theirs = run_distributed(_infeasible, 2)
    assert mine is not None and theirs is not None
    assert "rank 0 could not plan" not in mine  # rank 0 raises its own error
    assert theirs.startswith("rank 0 could not plan: InfeasiblePlanError: ") and mine in theirs


def _slow_rank_zero(rank: int, world_size: int):
    args, kwargs = make_batch("llama")

    def slow(request):  # longer than the others wait, then gives up
        time.sleep(3.0)
        raise ConfigError("gave up")

    start = time.monotonic()
    with _replaced_planning(slow if rank == 0 else api.plan_to_compile, wait_s="0.5"):
        try:
            autopar.compile(make_model("llama"), "cpu:2", args, kwargs)
        except (LoweringError, ConfigError) as e:
            return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_a_rank_waits_for_rank_zeros_plan_a_bounded_time_and_says_what_it_waited_for():
    zero, one = run_distributed(_slow_rank_zero, 2)
    assert zero[:2] == ("ConfigError", "gave up")
    kind, message, waited = one
    assert kind == "LoweringError" and "rank 1 waited 0.5 s for rank 0's plan" in message, message
    assert "AUTOPAR_PLAN_WAIT_S" in message
    assert waited < 2.5  # it did not wait for rank 0's 3 s

"""`autopar.plan(..., time_limit_s=...)`: the best plan found by then, and the plan saying what was not tried."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.errors import ConfigError
from tests.models import make_batch, make_model


def _plan(**kw):
    args, kwargs = make_batch("llama", batch=8, seq=16)
    return autopar.plan(make_model("llama"), "cpu:4", args, kwargs, **kw)


@pytest.fixture(scope="module")
def unlimited():
    return _plan()


@pytest.mark.integration
def test_a_limit_that_has_passed_gives_the_best_plan_so_far_and_says_so(unlimited):
    cut = _plan(time_limit_s=0)
    record = cut.stats["time_limit"]
    assert record["limit_s"] == 0 and record["cut_short"]
    # the meshes past the first solved, and the report's layouts, were not tried
    assert any(x.startswith("mesh dp=") for x in record["not_tried"])
    assert any("layouts a report prices" in x for x in record["not_tried"])
    assert any(a["reason"] == "not solved: the time limit had passed" for a in cut.alternatives)
    # the full search saw every candidate the cut one saw: it is never slower
    assert unlimited.predicted.step_time_s <= cut.predicted.step_time_s
    assert "time limit" in cut.explain() and "not tried" in cut.explain()


@pytest.mark.integration
def test_a_limit_that_does_not_bind_changes_nothing(unlimited):
    roomy = _plan(time_limit_s=1e6)
    assert roomy.stats["time_limit"] == {"limit_s": 1e6, "cut_short": False, "not_tried": []}
    a, b = json.loads(roomy.to_json()), json.loads(unlimited.to_json())
    a["stats"].pop("time_limit")
    assert a == b
    assert "time limit" not in roomy.explain()


@pytest.mark.parametrize("bad", [-1, "soon", True])
def test_a_bad_limit_says_what_it_takes(bad):
    with pytest.raises(ConfigError, match="time_limit_s"):
        _plan(time_limit_s=bad)


@pytest.mark.integration
def test_compile_plans_under_a_time_limit_as_plan_does():
    # rank 0 plans and every rank runs its plan (`autopar.runtime.shared_plan`), so a clock cannot part the ranks
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    pm = autopar.compile(model, "cpu:1", args, kwargs, time_limit_s=0)
    record = pm.plan.stats["time_limit"]
    assert record["limit_s"] == 0 and isinstance(record["not_tried"], list)

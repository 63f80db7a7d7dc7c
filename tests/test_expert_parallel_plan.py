"""A pinned expert axis: its checks, and the plan priced with it against `cost_model.experts`."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.experts import estimate_expert_parallel
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.expert_parallel import moe_shape
from tests.families import family_batch, make_family
from tests.models import make_batch, tiny_llama


def _plan(model, world: int, constraints: dict, family: str = "mixtral"):
    args, kwargs = family_batch(family, batch=4)
    return autopar.plan(model, f"cpu:{world}", args, kwargs, constraints=constraints, alternatives=False)


def test_moe_shape_finds_the_experts_not_the_router():
    shape = moe_shape(make_family("mixtral"))
    assert (shape.num_experts, shape.top_k, len(shape.modules)) == (4, 2, 2)
    assert all(".experts." in p for p in shape.params) and len(shape.params) == 4
    assert moe_shape(tiny_llama()) is None


@pytest.mark.parametrize(
    "constraints, match",
    [
        ({"ep": 3}, "does not divide the data axis"),
        ({"ep": 2, "dp": 1, "tp": 2}, "does not divide the data axis"),
        ({"ep": 2, "tp": 2}, "data-parallel layout only"),
        ({"ep": 2, "zero": 3}, "data-parallel layout only"),
    ],
)
def test_bad_ep_pins_are_named(constraints, match):
    with pytest.raises(ConfigError, match=match):
        _plan(make_family("mixtral"), 2, constraints)


def test_ep_must_divide_the_experts():
    with pytest.raises(ConfigError, match="does not divide the 4 experts"):
        _plan(make_family("mixtral"), 8, {"ep": 8})


def test_ep_needs_experts():
    (ids,), kw = make_batch("llama", batch=4, seq=16)
    with pytest.raises(ConfigError, match="no mixture of experts"):
        autopar.plan(tiny_llama(), "cpu:2", (ids,), kw, constraints={"ep": 2}, alternatives=False)


@pytest.mark.integration
def test_pinned_ep_prices_the_all_to_alls_and_the_expert_memory():
    model = make_family("mixtral")
    dense = _plan(model, 2, {"dp": 2, "tp": 1, "zero": 0, "recompute": "none"})
    plan = _plan(model, 2, {"ep": 2})
    info = plan.expert_parallel
    assert plan.program == "expert-parallel" and info["degree"] == 2
    # 4 x 16 tokens over dp 2: 32 tokens a rank, top-2, hidden 64, fp32, 2 MoE layers, one micro-batch
    assert info["all_to_all_bytes"] == 2 * 32 * 2 * 64 * 4
    assert info["all_to_alls_per_step"] == 4 * 2
    cost = estimate_expert_parallel(
        ep=2,
        tokens=32,
        top_k=2,
        hidden_size=64,
        bytes_per_element=4,
        num_moe_layers=2,
        num_microbatches=1,
        link=plan.cluster.link_for_axis(2, 1),
    )
    assert plan.predicted.step_time_s == pytest.approx(dense.predicted.step_time_s + cost.all_to_all_s, rel=1e-9)
    # the experts' weights, gradients and optimizer states (all fp32, all trainable) halve on each rank
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    held = dense.predicted.memory_breakdown
    states = held["params"] + held["grads"] + held["optimizer"]
    per_element = states / dense.num_parameters
    assert info["memory_saved_bytes"] == pytest.approx(experts * per_element / 2, rel=1e-9)
    assert plan.predicted.peak_memory_bytes == pytest.approx(
        dense.predicted.peak_memory_bytes - info["memory_saved_bytes"]
    )
    assert autopar.Plan.from_json(plan.to_json()).expert_parallel == info
    report = plan.explain()
    assert "## Expert parallelism" in report and "| bytes each re-splits over the group | 32,768 |" in report
    assert "Expert parallelism" not in dense.explain()


def test_a_pinned_ep_that_does_not_fit_says_why():
    args, kwargs = family_batch("mixtral", batch=4)
    with pytest.raises(InfeasiblePlanError, match="with ep=2 pinned, the layout is solved as data parallelism"):
        autopar.plan(
            make_family("mixtral"),
            "cpu:2",
            args,
            kwargs,
            constraints={"ep": 2},
            memory_budget="1MB",
            alternatives=False,
        )

"""A pinned expert axis: its checks, and the plan priced with it against `cost_model.experts`."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.cost_model.experts import estimate_expert_parallel
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.expert_parallel import ep_memory_advice, moe_shape
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
    assert info["all_to_all_s"] == pytest.approx(cost.all_to_all_s, rel=1e-12)
    assert plan.time_breakdown["comm_dp"] >= cost.all_to_all_s
    assert sum(plan.time_breakdown.values()) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    # each device holds the dense weights whole and half of every expert weight, fp32 (4 B weights, 4 B
    # gradients, 8 B of AdamW moments): the solver checked these, not the whole model, against the budget
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    held = plan.predicted.memory_breakdown
    local = dense + experts / 2
    assert (held["params"], held["grads"], held["optimizer"]) == pytest.approx((local * 4, local * 4, local * 8))
    assert info["memory_saved_bytes"] == experts / 2 * 16
    assert autopar.Plan.from_json(plan.to_json()).expert_parallel == info
    report = plan.explain()
    assert "## Expert parallelism" in report and "| bytes each re-splits over the group | 32,768 |" in report


@pytest.mark.integration
def test_a_pinned_ep_fits_where_its_share_of_the_experts_does():
    """A budget between what ep=2 holds and what the same layout holds without ep: the pin is planned (it was
    refused while the memory was checked with every expert on each device), and the layout without ep is not."""
    model = make_family("mixtral")
    whole = _plan(model, 2, {"dp": 2, "tp": 1, "zero": 0, "recompute": "none", "num_microbatches": 1})
    split = _plan(model, 2, {"ep": 2, "num_microbatches": 1})
    need, need_whole = split.predicted.peak_memory_bytes, whole.predicted.peak_memory_bytes
    assert need < need_whole
    budget = f"{int((need + need_whole) / 2)}B"
    args, kwargs = family_batch("mixtral", batch=4)
    fits = autopar.plan(
        model,
        "cpu:2",
        args,
        kwargs,
        constraints={"ep": 2, "num_microbatches": 1},
        memory_budget=budget,
        alternatives=False,
    )
    assert fits.program == "expert-parallel" and fits.predicted.peak_memory_bytes == pytest.approx(need)
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(
            model,
            "cpu:2",
            args,
            kwargs,
            constraints={"dp": 2, "tp": 1, "zero": 0, "recompute": "none", "num_microbatches": 1},
            memory_budget=budget,
            alternatives=False,
        )


@pytest.mark.parametrize("budget, states_short", [("1MB", True), ("6MB", False)])
def test_a_pinned_ep_that_does_not_fit_says_why_and_gives_advice_that_applies_to_ep(budget, states_short):
    """The expert-parallel program keeps every state on the device at ZeRO-0: the refusal does not advise host
    offload (the dense advice) but what does apply; it says a smaller batch does not help where the model states
    alone exceed the budget (1 MB: below this model's states), and advises it where activations push it over."""
    args, kwargs = family_batch("mixtral", batch=4)
    with pytest.raises(InfeasiblePlanError) as refused:
        autopar.plan(
            make_family("mixtral"),
            "cpu:2",
            args,
            kwargs,
            constraints={"ep": 2},
            memory_budget=budget,
            alternatives=False,
        )
    message = str(refused.value)
    # it says why: what a device needs at least, and that the layout is the one ep pins
    assert re.search(r"at least .* per device .*with ep=2, the layout is the one the ", message), message
    assert "offload=None" not in message and "plan without ep (drop the pin)" in message
    assert ("the model states alone exceed the budget at ep=2" in message) == states_short
    assert ("use a shorter sequence or a smaller batch" in message) == (not states_short)


def test_the_ep_advice_offers_a_larger_ep_only_where_the_experts_allow_one():
    parts = {"states": 2.0, "activations": 1.0, "transient": 0.0}
    assert "use a larger ep" in ep_memory_advice(2, 4)(parts, 1.0)
    assert "use a larger ep" not in ep_memory_advice(4, 4)(parts, 1.0)
    assert ep_memory_advice(4, 4)(parts, 1.0).endswith(
        "does not change: raise memory_budget, or plan without ep (drop the pin), where ZeRO, host offload and "
        "recompute are open to the search"
    )


def test_a_dense_plan_that_does_not_fit_still_advises_host_offload():
    (ids,), kw = make_batch("llama", batch=4, seq=16)
    with pytest.raises(InfeasiblePlanError, match=r"smaller batch, or allow host offload \(offload=None\)$"):
        autopar.plan(tiny_llama(), "cpu:2", (ids,), kw, offload=False, memory_budget="64KB", alternatives=False)


@pytest.fixture(scope="module")
def ep2_of_dp4():
    """Mixtral (4 experts) on 4 ranks with ep=2: two ranks hold each expert, so its gradient is all-reduced."""
    model = make_family("mixtral")
    return model, _plan(model, 4, {"ep": 2})


def test_the_expert_gradient_sync_is_named_dp_ep_not_dp(ep2_of_dp4):
    model, plan = ep2_of_dp4
    syncs = [
        (op["node"], c) for e in plan.layer_ops for op in e["ops"] for c in op["collectives"] if c["pass"] == "step"
    ]
    expert = [(n, c) for n, c in syncs if ".experts." in n]
    dense = [(n, c) for n, c in syncs if ".experts." not in n]
    assert expert and dense
    assert {c["axis"] for _, c in expert} == {"dp/ep"} and {c["axis"] for _, c in dense} == {"dp"}
    # an expert row's bytes are the fp32 gradient of the half of the experts a rank holds
    assert all(c["bytes"] == model.get_parameter(n).numel() / 2 * 4 for n, c in expert)
    sync_s = sum(c["time_s"] * c["per_step"] for _, c in expert)
    report = plan.explain()
    expert_lines = [line for line in report.splitlines() if line.startswith("| `model.layers.0.mlp.experts.")]
    assert expert_lines and all("| dp/ep | step |" in line for line in expert_lines)
    # one layer table holds the experts: its per-axis line names dp/ep with their time
    assert f"; dp/ep step {sync_s * 1e3:,.3f} ms." in report
    assert "| experts' gradient sync per step (ms), axis dp/ep, in dp communication |" in report
    assert "the experts' gradient sync over dp/ep" in report


def test_the_summary_names_the_ep_degree(ep2_of_dp4):
    _, plan = ep2_of_dp4
    assert "mesh dp=4 x tp=1 (ep=2 within dp), ZeRO-0" in plan.summary()
    assert "| mesh | dp=4 x tp=1 (" in plan.explain() and ", ep=2 within dp (" in plan.explain()
    (ids,), kw = make_batch("llama", batch=4, seq=16)
    dense = autopar.plan(tiny_llama(), "cpu:4", (ids,), kw, constraints={"tp": 1}, alternatives=False)
    assert "ep=" not in dense.summary() and "ep=" not in dense.explain() and "dp/ep" not in dense.explain()

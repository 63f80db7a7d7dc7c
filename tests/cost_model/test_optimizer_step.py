"""The optimizer step in the plan: priced per local shard, per ZeRO stage, and reported in the breakdown."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.compute import AnalyticEstimator
from autopar.cost_model.devices import get_device
from autopar.plan_build import step_guard_s
from tests.models import make_batch, tiny_llama

TENSOR_S, S_PER_BYTE = 40e-6, 1e-9


class FixedOptimizer(AnalyticEstimator):
    """The analytic estimator of the ops, with an optimizer step of known cost per tensor and per byte."""

    def optimizer_step_time_s(self, num_tensors: int, num_param_bytes: float) -> float:
        return num_tensors * TENSOR_S + num_param_bytes * S_PER_BYTE


@pytest.mark.integration
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_optimizer_term_is_the_step_over_the_local_shards(zero):
    model = tiny_llama()
    (ids,), kw = make_batch("llama", batch=8, seq=16)
    est = FixedOptimizer(get_device("A100-80GB"), "bf16")
    plan = autopar.plan(
        model.to("meta"),
        "2xA100-80GB",
        (ids.to("meta"),),
        {"labels": kw["labels"].to("meta")},
        constraints={"dp": 2, "tp": 1, "zero": zero},
        estimator=est,
        offload=False,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    # every rank updates every parameter tensor: whole under ZeRO 0, its half (1/dp) from stage 1 on;
    # the optimizer steps fp32 weights (the master copy under bf16): 4 bytes per parameter
    numel = sum(p.numel() for p in params) / (2 if zero >= 1 else 1)
    expected = len(params) * TENSOR_S + 4 * numel * S_PER_BYTE
    p = plan.predicted
    assert plan.zero_stage == zero
    # the optimizer term also carries the step guard's pass over the gradients (`plan_build.step_guard_s`)
    guard = step_guard_s(plan.cluster, p.memory_breakdown, plan.precision, False)
    assert p.optimizer_s - guard == pytest.approx(expected, rel=1e-9)
    assert p.step_time_s == pytest.approx(p.compute_s + p.reshard_s + p.grad_sync_s + p.optimizer_s, rel=1e-9)
    assert autopar.Plan.from_json(plan.to_json()).predicted.optimizer_s == p.optimizer_s

"""The step guard's price (`cost_model.step_guard`): a pass over the device's gradients (three with clipping) and
one small all-reduce over the world, in every plan; `max_grad_norm` is recorded in the plan and priced."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.step_guard import GUARD_REDUCE_BYTES, estimate_step_guard_time_s
from tests.models import make_batch, make_model


def test_the_guard_is_a_pass_over_the_gradients_and_one_small_all_reduce():
    cluster = autopar.ClusterSpec.parse("2x8xH100-80GB")
    grads = 4e9
    plain = estimate_step_guard_time_s(cluster, grads, clip=False)
    clipped = estimate_step_guard_time_s(cluster, grads, clip=True)
    reduce_s = estimate_collective_time(Collective.ALL_REDUCE, GUARD_REDUCE_BYTES, 16, cluster.link_for_axis(16, 1))
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s
    assert plain == pytest.approx(grads / bandwidth + reduce_s)
    assert clipped == pytest.approx(3 * grads / bandwidth + reduce_s)
    # latency-bound: the 16-rank group's latency per call (NCCL's cheapest algorithm for a small all-reduce over
    # two nodes, `GroupLink.latency_s`), whatever the bytes: 24 bytes add 1.2 ns to 25.2 µs
    assert reduce_s == pytest.approx(cluster.link_for_axis(16, 1).latency_s, rel=1e-3)


def test_a_plan_prices_clipping_and_records_it():
    args, kwargs = make_batch("llama")
    pins = {"dp": 2, "tp": 1}
    plain = autopar.plan(make_model("llama"), "cpu:2", args, kwargs, constraints=pins, alternatives=False)
    clipped = autopar.plan(
        make_model("llama"), "cpu:2", args, kwargs, constraints=pins, alternatives=False, max_grad_norm=1.0
    )
    grads = plain.predicted.memory_breakdown["optimizer"] / 2  # fp32 AdamW: 8 bytes of moments per 4 of gradient
    extra = 2 * grads / plain.cluster.device.memory_bandwidth_bytes_per_s  # the scaling pass reads and writes
    assert clipped.predicted.step_time_s - plain.predicted.step_time_s == pytest.approx(extra, rel=1e-6)
    assert clipped.time_breakdown["optimizer"] - plain.time_breakdown["optimizer"] == pytest.approx(extra, rel=1e-6)
    assert plain.max_grad_norm is None and clipped.max_grad_norm == 1.0
    assert autopar.Plan.from_json(clipped.to_json()).max_grad_norm == 1.0
    assert "max_grad_norm" not in plain.to_json()  # plans without clipping keep their text


@pytest.mark.integration  # plans the tiny LLaMA through the CLI (1-2 s)
def test_the_cli_prices_and_records_max_grad_norm(tmp_path):
    import json

    from autopar.cli import main

    out = tmp_path / "plan.json"
    flags = ["plan", "--model", "tiny-llama", "--global-batch-size", "8", "--seq-len", "32", "--quiet"]
    assert main([*flags, "--cluster", "cpu:2", "--max-grad-norm", "1.0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["max_grad_norm"] == 1.0

"""The price of tensor-axis collectives launched early: where a value's only consumer is not the very next op, the
interpreter launches its collective where the value is made (`parallelize.launches_early`), and the plan counts
the collective's bandwidth time as hidden behind the ops in between (at the device's overlap efficiency, up to
their forward time); its latency never hides. With overlap off the interpreter waits where the value is read and
the plan prices the whole collective.

The model is the parallel block of the runtime's test (tests/distributed/test_tp_overlap.py): the MLP's down
projection ends in a partial sum whose consumer, the residual add, comes after the whole attention branch."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost_model import DType
from autopar.ir import tensor_args
from autopar.passes.parallelize import launches_early, local_op_targets
from autopar.passes.sharding.reshard import redistribute_time
from autopar.passes.sharding_rules import parse_placement
from autopar.trace import trace_model
from tests.distributed.test_tp_overlap import _batch, _model
from tests.passes.test_overlap_pricing import BWD_S, FWD_S, _Fixed


class _Split(_Fixed):
    """Each op takes FWD_S forward and BWD_S backward on its whole tensors, the share it runs of them when split:
    splitting the block Megatron's way then pays for its collectives."""

    def forward_time_s(self, node, divisor=1):
        return FWD_S / divisor

    def backward_time_s(self, node, divisor=1):
        return BWD_S / divisor


@pytest.fixture(scope="module")
def plans():
    model, args = _model(), _batch()
    traced = trace_model(model, args, compute_dtype=torch.bfloat16)
    cluster = autopar.ClusterSpec.parse("2xA100-80GB")
    est = _Split(cluster.device, DType("bf16"))
    pins = {"tp": 2, "dp": 1}
    out = {
        on: autopar.plan(
            model,
            cluster,
            args,
            constraints={**pins, "overlap": on},
            estimator=est,
            _traced=traced,
            alternatives=False,
            precision="bf16",
        )
        for on in (True, False)
    }
    return traced, out


@pytest.mark.integration
def test_a_collective_launched_early_hides_its_bandwidth_time_behind_the_ops_before_its_use(plans):
    """By hand from the plan's placements and the link: every value whose one consumer comes later than the next
    op and needs another placement than the value's own. Each op here takes at least 0.05 ms forward (`_Split`),
    far more than an all-reduce of a 32 KiB activation over NVLink, so all of each collective but its latency
    hides."""
    traced, out = plans
    on, off = out[True], out[False]
    graph = traced.exported.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    link = on.cluster.link_for_axis(2, 1)
    expected, found = 0.0, []
    for n in nodes:
        if len(n.users) != 1 or not launches_early(n, order, local_op_targets()):
            continue
        user = next(iter(n.users))
        src = parse_placement(on.node_output[n.name])
        need = parse_placement(on.node_inputs[user.name][tensor_args(user).index(n)])
        val = n.meta["val"]
        fwd = redistribute_time(src, need, val.numel() * val.element_size(), 2, link)
        if fwd:
            found.append((n.name, user.name, src, need))
            expected += fwd - redistribute_time(src, need, 1.0, 2, link)
    assert found, "no collective launched early in the parallel block"
    assert any(src.is_partial() for _, _, src, _ in found)  # the down projection's sum
    assert on.hidden_communication.get("comm_tp") == pytest.approx(expected, rel=1e-6)
    assert "comm_tp" not in off.hidden_communication
    # both choose one layout here: the difference in what the step waits for is what hides
    assert (on.node_output, on.node_inputs) == (off.node_output, off.node_inputs)
    assert on.time_breakdown["comm_tp"] + expected == pytest.approx(off.time_breakdown["comm_tp"], rel=1e-6)

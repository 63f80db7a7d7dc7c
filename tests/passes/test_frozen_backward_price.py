"""A matrix product whose weight is frozen is priced without its weight-gradient GEMM: its backward is dX = dY·Wᵀ
alone (`cost_model.compute.input_gradient_only`, `passes.sharding.graph.frozen_weight_matmuls`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.cost_model.compute import AnalyticEstimator
from autopar.cost_model.devices import DType
from autopar.ir import OpGraph
from autopar.passes.sharding.graph import frozen_weight_matmuls
from autopar.passes.sharding.groups import MeshGroups
from autopar.trace import trace_model

ROWS, IN, HIDDEN, OUT = 256, 512, 1024, 256


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN, bias=False)
        self.b = nn.Linear(HIDDEN, OUT, bias=False)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


def _groups(frozen: frozenset[str]):
    model = TwoLinears()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    graph = OpGraph.from_traced(trace_model(model, (torch.randn(ROWS, IN),), {}), frozen_params=frozen)
    cluster = autopar.ClusterSpec.parse("1xA100-40GB")
    estimator = AnalyticEstimator(cluster.device, DType("fp32"))
    groups = MeshGroups(
        graph,
        tp=1,
        tp_link=cluster.intra_node_link,
        data_ranks=1,
        batch=ROWS,
        num_microbatches=1,
        estimator=estimator,
    )
    return graph, groups, cluster.device


def _product_reading(graph: OpGraph, weight: str):
    """The linear node that reads parameter `weight` (the graph holds two: `x·Aᵀ`, then `·Bᵀ`)."""
    placeholder = next(info.node_name for info in graph.params.values() if info.name == weight)
    return next(n for n in graph.graph.nodes if n.op == "call_function" and n.args[1].name == placeholder)


def test_a_frozen_linear_backward_is_the_input_gradient_gemm_alone():
    graph, groups, device = _groups(frozenset({"b.weight"}))
    frozen = _product_reading(graph, "b.weight")
    assert frozen_weight_matmuls(graph) == {frozen.name}
    fwd, bwd = groups.op_times(frozen, 1)
    # by hand: dX [ROWS, HIDDEN] = dY [ROWS, OUT] · W [OUT, HIDDEN], 2·ROWS·HIDDEN·OUT FLOPs at the fp32 matrix peak
    # times the efficiency of that GEMM's shape (m=ROWS, n=HIDDEN, k=OUT); reading dY and W, writing dX (4 bytes each)
    flops = 2 * ROWS * HIDDEN * OUT
    rate = device.peak_matmul_flops(DType("fp32")) * device.matmul_efficiency_at(DType("fp32"), (1, ROWS, HIDDEN, OUT))
    moved = 4 * (ROWS * OUT + OUT * HIDDEN + ROWS * HIDDEN)
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    expected = max(flops / rate, moved / bandwidth) + device.kernel_overhead_s
    assert bwd == pytest.approx(expected, rel=1e-12)  # the same arithmetic: float rounding only

    # trained, the same product's backward adds dW: dearer; the trained first layer is priced as before
    graph_t, groups_t, _ = _groups(frozenset())
    trained = _product_reading(graph_t, "b.weight")
    assert frozen_weight_matmuls(graph_t) == frozenset()
    fwd_t, bwd_t = groups_t.op_times(trained, 1)
    assert fwd_t == fwd and bwd_t > 1.5 * bwd  # dW is a GEMM of the same FLOPs as dX
    first, first_t = _product_reading(graph, "a.weight"), _product_reading(graph_t, "a.weight")
    assert groups.op_times(first, 1) == groups_t.op_times(first_t, 1)

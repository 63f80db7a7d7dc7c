"""A mesh's prices with experts split over an ep group (`MeshPrices`, `cost_model.experts.ExpertSplit`): an expert
weight's states and optimizer step are 1 / ep of its own, its gradient is all-reduced over the dp / ep ranks holding
the same experts on their link; the dense weights keep the whole data axis. Against the collective pricing
functions, by hand."""

from __future__ import annotations

import pytest
import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.compute import optimizer_step_time_s
from autopar.cost_model.experts import ExpertSplit
from autopar.input_validation import resolve_estimator
from autopar.ir import OpGraph
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.program import ShardingProgram
from autopar.trace import trace_model
from autopar.units import PRICED_BUCKET_BYTES
from tests.families import family_batch, make_family

BF16 = Precision.get("bf16")  # weights 2 B, ZeRO-0 gradients reduced in fp32 (4 B), fp32 master and moments 12 B


@pytest.fixture(scope="module")
def mixtral_graph():
    model = make_family("mixtral")  # 4 experts a layer, 2 MoE layers
    args, kwargs = family_batch("mixtral", batch=8)
    graph = OpGraph.from_traced(trace_model(model, args, kwargs, compute_dtype=torch.bfloat16))
    experts = frozenset(n for n, _ in model.named_parameters() if ".experts." in n)
    return graph, experts


def _program(graph, cluster: str, dp: int, experts: ExpertSplit | None) -> ShardingProgram:
    spec = ClusterSpec.parse(cluster)
    prog = ShardingProgram(
        graph,
        spec,
        dp,
        1,
        estimator=resolve_estimator(None, spec, "bf16"),
        precision=BF16,
        zero_stage=0,
        memory_budget_bytes=float("inf"),
        batch_dim_size=8,
        overlap=False,  # every sync paid whole: the step's sync is the sum of the rows below
        experts=experts,
    )
    prog.build()
    return prog


def _bucketed(nbytes: float, ranks: int, link) -> float:
    """A gradient's share of bucketed all-reduces: its bytes at full bandwidth, the latency pro rata."""

    def t(b):
        return estimate_collective_time(Collective.ALL_REDUCE, b, ranks, link)

    return t(nbytes) - t(1.0) + t(1.0) * nbytes / PRICED_BUCKET_BYTES


def test_expert_gradients_reduce_over_the_ranks_holding_the_same_experts(mixtral_graph):
    """2 nodes of 4: dp=8, ep=4. The ep groups are the nodes; rank j's replicas are j and j + 4, one per node (the
    link of an axis of 2 with stride 4). An expert weight of N elements syncs N/4 fp32 gradients over those 2 ranks;
    a dense weight its N over all 8; the step pays one bucket's latency on each group."""
    graph, names = mixtral_graph
    cluster = ClusterSpec.parse("2x4xH100-80GB")
    prog = _program(graph, "2x4xH100-80GB", 8, ExpertSplit(4, names))
    dense_link, replica_link = cluster.link_for_axis(8, 1), cluster.link_for_axis(2, 4)
    params = prog.mesh_groups.param_groups()
    experts = [w for w in params if graph.params[w].name in names]
    dense = [w for w in params if w not in experts and graph.params[w].requires_grad]
    assert len(experts) == 2 and dense  # gate_up_proj and down_proj, the layers deduplicated
    total = 0.0
    for w in experts + dense:
        numel, count = graph.params[w].meta.numel, prog.groups[w].count
        want = _bucketed(numel / 4 * 4, 2, replica_link) if w in experts else _bucketed(numel * 4, 8, dense_link)
        assert prog.prices.sync_time(w, 0, 0) == pytest.approx(want, rel=1e-12)  # float rounding only
        total += count * want
    floors = estimate_collective_time(Collective.ALL_REDUCE, 1.0, 8, dense_link) + estimate_collective_time(
        Collective.ALL_REDUCE, 1.0, 2, replica_link
    )
    assert prog.prices.sync_floor(0) == pytest.approx(floors, rel=1e-12)
    solved = prog.solve(stage=0, memory=False)
    assert solved.grad_sync_s == pytest.approx(total + floors, rel=1e-6)  # the solver's sums of the same figures


def test_expert_states_and_optimizer_step_are_one_ep_th(mixtral_graph):
    graph, names = mixtral_graph
    prog = _program(graph, "8xH100-80GB", 8, ExpertSplit(4, names))
    device = ClusterSpec.parse("8xH100-80GB").device
    for w in prog.mesh_groups.param_groups():
        numel = graph.params[w].meta.numel
        local = numel / 4 if graph.params[w].name in names else numel
        assert prog.prices.state_bytes(w, 0, 0) == (local * 2, local * 4, local * 12)
        want = optimizer_step_time_s(prog.estimator, device, 1, local * 4)
        assert prog.prices.optimizer_time(w, 0, 0) == pytest.approx(want, rel=1e-12)


def test_experts_held_by_one_rank_each_sync_nothing(mixtral_graph):
    """ep = dp = 4: every expert on one rank only; its gradient is not reduced, and no expert bucket is paid."""
    graph, names = mixtral_graph
    split = _program(graph, "4xH100-80GB", 4, ExpertSplit(4, names))
    whole = _program(graph, "4xH100-80GB", 4, None)
    for w in split.mesh_groups.param_groups():
        if graph.params[w].name in names:
            assert split.prices.sync_time(w, 0, 0) == 0.0 and whole.prices.sync_time(w, 0, 0) > 0
        else:
            assert split.prices.sync_time(w, 0, 0) == whole.prices.sync_time(w, 0, 0)
    assert split.prices.sync_floor(0) == whole.prices.sync_floor(0)


def test_ep_must_divide_the_data_axis(mixtral_graph):
    graph, names = mixtral_graph
    with pytest.raises(ValueError, match="ep=4 does not divide the data axis"):
        _program(graph, "2xH100-80GB", 2, ExpertSplit(4, names))

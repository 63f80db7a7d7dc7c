"""The pipeline search's price of overlap, against hand-computed cases: a transfer's exposed part, the dp sync of
each stage hidden behind its own last backward (all but the bucket it fills last) and the backwards that the stages
before it still run, and the old price with overlap off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.devices import LinkSpec
from autopar.input_validation import resolve_estimator
from autopar.ir import OpGraph
from autopar.passes.pipeline.schedules import Schedule, schedule_slots
from autopar.passes.pipeline.search import search_pipeline
from autopar.passes.pipeline.stage_cost import PricedStage
from autopar.passes.pipeline.step_cost import (
    BACKWARD_SHARE,
    Overlap,
    Transfer,
    hidden_part,
    overlap_efficiency,
    step_price,
    sync_windows,
    transfer_time,
)
from autopar.trace import trace_model
from tests.passes.test_pipeline_search import Stack

MS = 1e-3
# the figures below are sums of a few milliseconds: float rounding only
TOL = 1e-12


def test_a_transfer_hides_its_bandwidth_time_behind_one_micro_batch_and_never_its_latency():
    c = Transfer(total_s=10 * MS, fixed_s=1 * MS)  # 9 ms on the wire, 1 ms of latency
    on = Overlap(on=True, eta=1.0)
    assert on.transfer_exposed(c, 4 * MS) == pytest.approx(6 * MS, abs=TOL)  # 9 - 4 of it waits, plus 1
    assert on.transfer_exposed(c, 20 * MS) == pytest.approx(1 * MS, abs=TOL)  # the latency alone
    assert Overlap(on=True, eta=0.5).transfer_exposed(c, 20 * MS) == pytest.approx(5.5 * MS, abs=TOL)  # 10 - 9/2
    assert Overlap(on=False).transfer_exposed(c, 20 * MS) == 10 * MS


def test_a_transfer_splits_into_the_wire_and_its_latency():
    link = LinkSpec("test", bandwidth_bytes_per_s=1e9, latency_s=1e-5)
    cluster = ClusterSpec.parse("8xA100-80GB")
    t = transfer_time(cluster, bytes_per_sample=1e6, link=link, b=2, tp=1)
    # alpha-beta: one step of 10 us, then 2 MB at 1 GB/s
    assert t.total_s == pytest.approx(1e-5 + 2e-3, abs=TOL)
    assert t.fixed_s == pytest.approx(1e-5, abs=TOL)


def test_hidden_part_is_eta_times_what_fits_the_window():
    assert hidden_part(5 * MS, 2 * MS, 1.0) == pytest.approx(2 * MS)
    assert hidden_part(1 * MS, 2 * MS, 0.8) == pytest.approx(0.8 * MS)
    assert hidden_part(1 * MS, -1.0, 1.0) == 0.0
    assert overlap_efficiency(SimpleNamespace(device=SimpleNamespace(overlap_efficiency=0.7))) == 0.7
    assert overlap_efficiency(SimpleNamespace(device=SimpleNamespace())) == 1.0


def test_sync_windows_are_the_backwards_of_the_stages_before():
    # stage s's sync runs while stages s-1 .. 0 run their last backward (2/3 of a micro-batch's compute)
    assert sync_windows([3 * MS, 6 * MS, 3 * MS], 1) == pytest.approx([0.0, 2 * MS, 6 * MS])
    assert sync_windows([3 * MS, 6 * MS], 2) == pytest.approx([0.0, 1 * MS])  # a chunk is half the device's
    assert BACKWARD_SHARE == pytest.approx(2 / 3)


def _stage(t_mb: float, sync: float, last: float = 0.0) -> PricedStage:
    return PricedStage(True, t_mb, sync, last_bucket_s=last)  # no optimizer step: S_s = G_s


def test_a_sync_hides_behind_its_own_backward_all_but_its_last_bucket():
    on = Overlap(True, 1.0)
    # own backward b = 2 ms, no later window: all of a 3 ms sync but the 1 ms bucket filled last could go out
    # during it, of which 2 ms fit
    assert on.sync_hidden(3 * MS, 0.0, 2 * MS, 1 * MS) == pytest.approx(2 * MS, abs=TOL)
    assert on.sync_hidden(1.5 * MS, 0.0, 2 * MS, 1 * MS) == pytest.approx(0.5 * MS, abs=TOL)  # 1.5 - 1
    assert on.sync_hidden(1 * MS, 0.0, 2 * MS, 1 * MS) == 0.0  # one bucket: it waits for the backward's end
    # a later window of 2 ms takes what is left after the own backward: 2 + 2 of a 5 ms sync
    assert on.sync_hidden(5 * MS, 2 * MS, 2 * MS, 1 * MS) == pytest.approx(4 * MS, abs=TOL)
    assert on.sync_hidden(1 * MS, 2 * MS, 2 * MS, 1 * MS) == pytest.approx(1 * MS, abs=TOL)  # all of it
    assert Overlap(True, 0.5).sync_hidden(5 * MS, 2 * MS, 2 * MS, 1 * MS) == pytest.approx(2 * MS, abs=TOL)
    assert Overlap(False).sync_hidden(5 * MS, 2 * MS, 2 * MS, 1 * MS) == 0.0


@pytest.mark.parametrize(
    "syncs,last,expect_hidden,expect_tail",
    [
        # G = 5, 5, 1 ms; own backwards 2 ms each, later windows 0, 2, 4 ms: hidden 2, 4, 1, exposed 3, 1, 0 ->
        # stage 0's sync ends the step
        ((5 * MS, 5 * MS, 1 * MS), 0.0, (2 * MS, 4 * MS, 1 * MS), 3 * MS),
        # G = 1, 5, 0 ms: stage 0 hides all of its 1 ms during its own backward; stage 1's 1 ms is left
        ((1 * MS, 5 * MS, 0.0), 0.0, (1 * MS, 4 * MS, 0.0), 1 * MS),
        # G = 3, 5, 0 ms with a last bucket of 2 ms: stage 0 hides 3 - 2 = 1 ms and waits for 2
        ((3 * MS, 5 * MS, 0.0), 2 * MS, (1 * MS, 4 * MS, 0.0), 2 * MS),
    ],
)
def test_step_of_three_stages_by_hand(syncs, last, expect_hidden, expect_tail):
    stages = [_stage(3 * MS, g, min(g, last)) for g in syncs]
    transfers = [Transfer(1 * MS, 0.2 * MS)] * 3  # each hides its 0.8 ms of wire behind the 3 ms of compute
    slots = schedule_slots(Schedule.ONE_F_ONE_B, 3, 4, 1)  # m + p - 1 = 6
    on = step_price(slots, stages, transfers, Overlap(True, 1.0), 1)
    assert on.transfer_exposed == pytest.approx((0.2 * MS,) * 3)
    assert on.sync_hidden == pytest.approx(expect_hidden, abs=TOL)
    assert on.step_s == pytest.approx(6 * (3 + 0.2) * MS + expect_tail, abs=TOL)
    off = step_price(slots, stages, transfers, Overlap(False), 1)
    assert off.step_s == pytest.approx(6 * (3 + 1) * MS + max(syncs), abs=TOL)  # today's price
    assert off.sync_hidden == (0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def searched():
    """A 2-stage pipeline pinned on two nodes, dp=8 per stage (a dp sync worth hiding), with and without overlap."""
    with torch.device("meta"):
        model = Stack(2048, 4).to(torch.bfloat16)
    graph = OpGraph.from_traced(trace_model(model, (torch.zeros(32, 512, dtype=torch.long, device="meta"),), {}))
    cluster = ClusterSpec.parse("2x8xA100-40GB")
    est = resolve_estimator(None, cluster, "bf16")
    pins = {"pp": 2, "dp": 8, "tp": 1, "schedule": "1f1b", "num_microbatches": 4, "zero": 0}
    return {
        on: search_pipeline(
            graph, cluster, estimator=est, precision="bf16", batch_size=32, constraints={**pins, "overlap": on}
        )
        for on in (True, False)
    }


@pytest.mark.integration
def test_the_search_prices_its_stages_as_the_formula_says(searched):
    for on, sol in searched.items():
        slots = schedule_slots(sol.schedule, sol.pp, sol.num_microbatches, sol.virtual_stages)
        st = sol.stages
        busy = slots * max(s.time_per_microbatch_s + s.transfer_exposed_per_microbatch_s for s in st)
        tail = max(s.grad_sync_exposed_s + s.optimizer_s for s in st)
        assert sol.step_time_s == pytest.approx(busy + tail, rel=1e-9)
        if not on:  # nothing hidden: the price without overlap
            assert all(s.transfer_exposed_per_microbatch_s == s.transfer_per_microbatch_s for s in st)
            assert all(s.grad_sync_hidden_s == 0.0 for s in st)
    on, off = searched[True], searched[False]
    # each stage's sync hides behind its own last backward (2/3 of its micro-batch) but its last bucket, and stage
    # 1's also behind stage 0's last backward
    window = [0.0, BACKWARD_SHARE * on.stages[0].time_per_microbatch_s]
    for st, w in zip(on.stages, window, strict=True):
        g, last = st.grad_sync_s, st.last_bucket_s
        assert 0 < last < g  # several buckets (one all-reduce of 25 MiB at most)
        own = min(BACKWARD_SHARE * st.time_per_microbatch_s, g - last)
        assert st.grad_sync_hidden_s == pytest.approx(min(g, w + own), rel=1e-9)
        assert st.grad_sync_hidden_s > 0
    assert on.step_time_s < off.step_time_s


def test_a_zero1_stage_hides_its_reduce_scatter_and_not_its_gathers():
    """A ZeRO-1 stage with overlap gathers its weights before the schedule (A_s) and reduce-scatters during its own
    last backward and the later ones: the hidden part is H(G_s - A_s, w_s + b_s) here (no last bucket). Stage 1 of
    two: 5 ms of which A = 2 ms, own backward 2 ms and window 2 ms (2/3 of the stages' 3 ms micro-batch): all of the
    3 ms reduce-scatter hides; with A = 4.5 ms only its 0.5 ms may; with no gathers, 4 of the 5 ms. Stage 0's 1 ms
    hides behind its own backward."""
    transfers = [Transfer(0.0, 0.0)] * 2
    slots = schedule_slots(Schedule.ONE_F_ONE_B, 2, 4, 1)
    for gathers, hidden in ((2 * MS, 3 * MS), (4.5 * MS, 0.5 * MS), (0.0, 4 * MS)):
        result = SimpleNamespace(optimizer_s=0.0, step_gather_s=gathers, sync_fixed_s=0.0)
        nothing = SimpleNamespace(optimizer_s=0.0, step_gather_s=0.0, sync_fixed_s=0.0)
        stages = [PricedStage(True, 3 * MS, 1 * MS, result=nothing), PricedStage(True, 3 * MS, 5 * MS, result=result)]
        on = step_price(slots, stages, transfers, Overlap(True, 1.0), 1)
        assert on.sync_hidden == pytest.approx((1 * MS, hidden), abs=TOL)
        assert on.step_s == pytest.approx(slots * 3 * MS + 5 * MS - hidden, abs=TOL)


@pytest.fixture(scope="module")
def zero1_stage():
    """One pipeline stage's program: the Stack's two layers on dp=2 at ZeRO-1, four micro-batches, bf16."""
    from autopar.passes.sharding.precision import Precision
    from autopar.passes.sharding.program import ShardingProgram

    model = Stack(256, 2)
    graph = OpGraph.from_traced(
        trace_model(model, (torch.zeros(8, 16, dtype=torch.long),), {}, compute_dtype=torch.bfloat16)
    )
    cluster = ClusterSpec.parse("2xA100-80GB")
    est = resolve_estimator(None, cluster, "bf16")
    out = {}
    for once in (True, False):
        prog = ShardingProgram(
            graph,
            cluster,
            2,
            1,
            estimator=est,
            precision=Precision.get("bf16"),
            zero_stage=1,
            memory_budget_bytes=float("inf"),
            batch_dim_size=8,
            num_microbatches=4,
            overlap=False,
            pipeline_stage=True,
            step_gathers=once,
        )
        prog.build()
        out[once] = (prog, prog.solve(stage=1, memory=False))
    return graph, cluster, out


def test_a_zero1_stage_gathers_and_reduce_scatters_once_a_step(zero1_stage):
    """Priced by hand from the link: once a step, each weight's gather (a collective of its own, and the copy that
    concatenates its pieces) and its share of the bucketed reduce-scatter (bandwidth whole, latency pro rata, one bucket's latency at least); without overlap, both
    per micro-batch, per weight.
    The step's memory holds each weight's whole fp32 gradient sum (4 bytes an element) where the synchronous
    stage counts the bf16 gradient (2)."""
    from autopar.cost_model.comm import Collective, estimate_collective_time
    from autopar.units import PRICED_BUCKET_BYTES as BUCKET_BYTES

    graph, cluster, out = zero1_stage
    link = cluster.link_for_axis(2, 1)

    def t(kind, nbytes):
        return estimate_collective_time(kind, nbytes, 2, link)

    rs, ag = Collective.REDUCE_SCATTER, Collective.ALL_GATHER
    sizes = [
        (info.meta.numel * 2, graph.layer_count.get(name, 1))
        for name, info in graph.params.items()
        if graph.layer_count.get(name, 1)
    ]
    # each gathered weight is concatenated from its pieces: its bytes read and written at the device's HBM bandwidth
    hbm = cluster.device.memory_bandwidth_bytes_per_s * cluster.device.memory_efficiency
    gathers = sum(n * (t(ag, b) + 2 * b / hbm) for b, n in sizes)
    # a step pays at least one bucket's latency (`sync_floor`)
    once = sum(n * (t(rs, b) - t(rs, 1.0) + t(rs, 1.0) * b / BUCKET_BYTES) for b, n in sizes) + gathers + t(rs, 1.0)
    every = 4 * sum(n * (t(rs, b) + t(ag, b) + 2 * b / hbm) for b, n in sizes)
    (_, on), (_, off) = out[True], out[False]
    assert on.grad_sync_s == pytest.approx(once, rel=1e-6)
    assert on.step_gather_s == pytest.approx(gathers, rel=1e-6)
    # of which the buckets' latencies, which nothing hides (the sync the later backwards may hide is the rest)
    fixed = sum(n * t(rs, 1.0) * b / BUCKET_BYTES for b, n in sizes) + t(rs, 1.0)
    assert on.sync_fixed_s == pytest.approx(fixed, rel=1e-6)
    assert off.grad_sync_s == pytest.approx(every, rel=1e-6) and off.step_gather_s == 0.0 == off.sync_fixed_s
    elements = sum(b // 2 * n for b, n in sizes)
    assert on.memory["grads"] - off.memory["grads"] == pytest.approx(2 * elements, rel=1e-9)
    # L_s: the bucket filled last is one reduce-scatter of min(BUCKET_BYTES, the stage's gradient bytes), less its
    # latency (in the fixed part above)
    from autopar.passes.sharding.precision import Precision

    grad_bytes = elements * Precision.get("bf16").grad_bytes_at(1)
    last = t(rs, min(BUCKET_BYTES, grad_bytes)) - t(rs, 1.0)
    assert out[True][0].last_bucket_s(1) == pytest.approx(last, rel=1e-12)


def test_a_stage_recomputing_at_zero1_gathers_no_weight_again_once_a_step(zero1_stage):
    # per micro-batch, a recomputed forward gathers its weights again; gathered once a step, it reads the kept ones
    _, _, out = zero1_stage
    (once, _), (every, _) = out[True], out[False]
    weight = next(n for n in once.mesh_groups.param_groups() if once.graph.params[n].requires_grad)
    assert every.prices.regather_s(weight, 0, 1) > 0
    assert once.prices.regather_s(weight, 0, 1) == 0.0


def test_every_pipeline_stage_pays_the_dtensor_runtime_and_buckets_its_all_reduce(zero1_stage):
    """A stage runs its graph on DTensors whatever its layout, so even at ZeRO-0 without a tensor axis it pays the
    per-op cost the estimator gives the sharded runtime, and its dp-replicated gradients are summed in buckets once
    a step (one bucket's latency at least), as the data-parallel program's are."""
    from autopar.cost_model import AnalyticEstimator, DType
    from autopar.cost_model.comm import Collective, estimate_collective_time
    from autopar.passes.sharding.precision import Precision
    from autopar.passes.sharding.program import ShardingProgram
    from autopar.units import PRICED_BUCKET_BYTES as BUCKET_BYTES

    graph, cluster, _ = zero1_stage
    per_op = 1e-5

    class _WithOverhead(AnalyticEstimator):
        def sharded_op_overhead_s(self):
            return per_op

    est = _WithOverhead(cluster.device, DType("bf16"))
    res = {}
    for stage_kind in (True, False):
        prog = ShardingProgram(
            graph,
            cluster,
            2,
            1,
            estimator=est,
            precision=Precision.get("bf16"),
            zero_stage=0,
            memory_budget_bytes=float("inf"),
            batch_dim_size=8,
            num_microbatches=4,
            overlap=False,
            pipeline_stage=stage_kind,
        )
        prog.build()
        res[stage_kind] = prog.solve(stage=0, memory=False)
    on, plain = res[True], res[False]
    ops = sum(graph.layer_count.get(n.name, 1) for n in graph.graph.nodes if n.op == "call_function")
    assert on.compute_s - plain.compute_s == pytest.approx(per_op * ops * 4, rel=1e-9)
    link = cluster.link_for_axis(2, 1)

    def t(nbytes):
        return estimate_collective_time(Collective.ALL_REDUCE, nbytes, 2, link)

    grads = [
        (info.meta.numel * Precision.get("bf16").grad_bytes_at(0), graph.layer_count.get(name, 1))
        for name, info in graph.params.items()
        if graph.layer_count.get(name, 1)
    ]
    bucketed = sum(n * (t(b) - t(1.0) + t(1.0) * b / BUCKET_BYTES) for b, n in grads)
    assert on.grad_sync_s == pytest.approx(bucketed + t(1.0), rel=1e-6)

"""The pipeline search's price of overlap, against hand-computed cases: a transfer's exposed part, the dp sync of
each stage hidden behind the backwards that the stages before it still run, and the old price with overlap off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar import api
from autopar.cluster import ClusterSpec
from autopar.cost_model.devices import LinkSpec
from autopar.ir import OpGraph
from autopar.passes.pipeline_search import (
    BACKWARD_SHARE,
    Overlap,
    Schedule,
    Transfer,
    _Priced,
    _slots,
    _transfer_s,
    hidden_part,
    overlap_efficiency,
    search_pipeline,
    step_price,
    sync_windows,
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
    t = _transfer_s(cluster, bytes_per_sample=1e6, link=link, b=2, tp=1)
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


def _stage(t_mb: float, sync: float) -> _Priced:
    return _Priced(True, t_mb, sync)  # no optimizer step: S_s = G_s


@pytest.mark.parametrize(
    "syncs,expect_tail",
    [
        # G = 5, 5, 1 ms; windows 0, 2, 4 ms: exposed 5, 3, 0 -> stage 0's sync, exposed whole, ends the step
        ((5 * MS, 5 * MS, 1 * MS), 5 * MS),
        # G = 1, 5, 0 ms: exposed 1, 3, 0 -> stage 1's, less the 2 ms stage 0's last backward hides
        ((1 * MS, 5 * MS, 0.0), 3 * MS),
    ],
)
def test_step_of_three_stages_by_hand(syncs, expect_tail):
    stages = [_stage(3 * MS, g) for g in syncs]
    transfers = [Transfer(1 * MS, 0.2 * MS)] * 3  # each hides its 0.8 ms of wire behind the 3 ms of compute
    slots = _slots(Schedule.ONE_F_ONE_B, 3, 4, 1)  # m + p - 1 = 6
    on = step_price(slots, stages, transfers, Overlap(True, 1.0), 1)
    assert on.transfer_exposed == pytest.approx((0.2 * MS,) * 3)
    assert on.sync_hidden[0] == 0.0  # the stage that finishes last hides nothing
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
    est = api._estimator(None, cluster, "bf16")
    pins = {"pp": 2, "dp": 8, "tp": 1, "schedule": "1f1b", "num_microbatches": 4, "zero": 0}
    return {on: search_pipeline(graph, cluster, estimator=est, precision="bf16", batch_size=32,
                                constraints={**pins, "overlap": on}) for on in (True, False)}  # fmt: skip


def test_the_search_prices_its_stages_as_the_formula_says(searched):
    for on, sol in searched.items():
        slots = _slots(sol.schedule, sol.pp, sol.num_microbatches, sol.virtual_stages)
        st = sol.stages
        busy = slots * max(s.time_per_microbatch_s + s.transfer_exposed_per_microbatch_s for s in st)
        tail = max(s.grad_sync_exposed_s + s.optimizer_s for s in st)
        assert sol.step_time_s == pytest.approx(busy + tail, rel=1e-9)
        if not on:  # nothing hidden: the price without overlap
            assert all(s.transfer_exposed_per_microbatch_s == s.transfer_per_microbatch_s for s in st)
            assert all(s.grad_sync_hidden_s == 0.0 for s in st)
    on, off = searched[True], searched[False]
    assert on.stages[0].grad_sync_hidden_s == 0.0  # stage 0 ends the step
    # stage 1's sync hides behind stage 0's last backward: 2/3 of its micro-batch, or the whole sync
    window = BACKWARD_SHARE * on.stages[0].time_per_microbatch_s
    assert on.stages[1].grad_sync_hidden_s == pytest.approx(min(on.stages[1].grad_sync_s, window), rel=1e-9)
    assert on.stages[1].grad_sync_hidden_s > 0
    assert on.step_time_s < off.step_time_s

"""The price of overlap: the data-parallel program's gradient all-reduces run while the last micro-batch's
backward goes on; the plan's exposed sync is what does not fit behind it (the last bucket never does), and of
the backward it overlaps, only the device's overlap efficiency eta hides it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar import units
from autopar.cost_model import AnalyticEstimator, DType
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.passes.sharding.precision import Precision
from autopar.trace import trace_model
from tests.models import MLPBlock

FWD_S, BWD_S = 1e-4, 2e-4  # every op's forward and backward, whatever its shape


class _Fixed(AnalyticEstimator):
    """Known compute: each op takes FWD_S forward and BWD_S backward (optimizer and links as the device says)."""

    def forward_time_s(self, node, divisor=1):
        return FWD_S

    def backward_time_s(self, node, divisor=1):
        return BWD_S


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(256) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Stack(), torch.randn(8, 16, 256)


def _plan(model, x, traced, cluster="2xA100-80GB", **pins):
    cluster = autopar.ClusterSpec.parse(cluster) if isinstance(cluster, str) else cluster
    est = _Fixed(cluster.device, DType("bf16"))
    return autopar.plan(
        model,
        cluster,
        (x,),
        constraints={"dp": 2, "tp": 1, "zero": 0, "num_microbatches": 1, **pins},
        estimator=est,
        _traced=traced,
        alternatives=False,
    )


def _two_buckets(monkeypatch, model, traced) -> tuple[int, float]:
    """Prices gradients in two buckets; returns the bucket size and the backward time of the one micro-batch
    (every floating-point op takes BWD_S)."""
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())  # fp32 reduction of every gradient
    bucket = grad_bytes // 2 + 1
    monkeypatch.setattr(units, "PRICED_BUCKET_BYTES", bucket)
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    return bucket, ops * BWD_S


def _latencies(model, bucket: int, link) -> float:
    """The buckets' latencies, which no compute hides: each gradient's share of its bucket's all-reduce latency
    (bytes / bucket of one latency) and the one latency every step pays (`sync_floor`)."""
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    return estimate_collective_time(Collective.ALL_REDUCE, 1.0, 2, link) * (grad_bytes / bucket + 1)


def _bandwidth(bucket: int, link) -> float:
    """One bucket's all-reduce less its latency."""
    return estimate_collective_time(Collective.ALL_REDUCE, bucket, 2, link) - estimate_collective_time(
        Collective.ALL_REDUCE, 1.0, 2, link
    )


def test_two_buckets_exposed_time_is_what_backward_does_not_hide(monkeypatch):
    model, x = _stack()
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    bucket, backward = _two_buckets(monkeypatch, model, traced)
    off = _plan(model, x, traced, overlap=False)
    on = _plan(model, x, traced)
    assert off.overlap is False and on.overlap is True
    total = off.predicted.grad_sync_s  # every bucket's all-reduce, exposed
    assert off.predicted.grad_sync_hidden_s == 0.0
    # the formula by hand: backward of the one micro-batch hides what it can of the buckets' bandwidth time; the
    # last bucket never hides, nor does any bucket's latency
    link = on.cluster.link_for_axis(2, 1)
    fixed = _latencies(model, bucket, link)
    expected = fixed + max(_bandwidth(bucket, link), total - fixed - backward)
    assert on.predicted.grad_sync_s == pytest.approx(expected, rel=1e-6)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(total - expected, rel=1e-6)
    assert on.predicted.step_time_s == pytest.approx(off.predicted.step_time_s - (total - expected), rel=1e-6)
    assert autopar.Plan.from_json(on.to_json()).predicted.grad_sync_hidden_s == on.predicted.grad_sync_hidden_s


def _with_eta(cluster: str, eta: float) -> autopar.ClusterSpec:
    spec = autopar.ClusterSpec.parse(cluster)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, overlap_efficiency=eta))


# each case binds on eta: (1 - eta) sync on the A100s and at cpu 0.25, sync - eta B at cpu 0.6 (two buckets of
# equal size: from eta 0.5 up, (1 - eta) sync is one bucket's time at most, and the last bucket's floor binds)
@pytest.mark.parametrize(("cluster", "eta"), [("2xA100-80GB", 0.3), ("cpu:2", 0.25), ("cpu:2", 0.6)])
def test_two_buckets_hide_eta_of_the_backward_they_overlap(monkeypatch, cluster, eta):
    """exposed = F + max(T_last, sync - eta B, (1 - eta) sync) (sync: the buckets' bandwidth time, F and T_last
    their latencies and the last one's bandwidth time): on every device kind, at the device's eta."""
    model, x = _stack()
    spec = _with_eta(cluster, eta)
    # the plan's compute format: bf16 on GPUs, fp32 on CPUs (gradients are reduced in fp32 either way)
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16 if spec.device.kind == "gpu" else torch.float32)
    bucket, backward = _two_buckets(monkeypatch, model, traced)
    off = _plan(model, x, traced, spec, overlap=False)
    on = _plan(model, x, traced, spec)
    total = off.predicted.grad_sync_s
    link = spec.link_for_axis(2, 1)
    fixed, last = _latencies(model, bucket, link), _bandwidth(bucket, link)
    sync = total - fixed
    expected = fixed + max(last, sync - eta * backward, (1 - eta) * sync)
    assert expected > fixed + last  # the case prices eta, not only the last bucket
    assert on.predicted.grad_sync_s == pytest.approx(expected, rel=1e-6)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(total - expected, rel=1e-6)
    # overlap off: the old price, every bucket exposed
    assert off.predicted.grad_sync_hidden_s == 0.0
    assert on.predicted.step_time_s == pytest.approx(off.predicted.step_time_s - (total - expected), rel=1e-6)


@pytest.mark.integration
def test_overlap_is_not_priced_at_eta_zero_or_with_recompute(monkeypatch):
    """A device whose communication hides nothing behind compute (eta = 0), and a recomputed layout, which runs
    on the sharded program (it reduces each gradient in its from_local's backward): neither hides anything;
    the cpu preset's eta does hide some (of two buckets: with one, it is the last, which nothing hides)."""
    model, x = _stack()
    monkeypatch.setattr(units, "PRICED_BUCKET_BYTES", 2 * sum(p.numel() for p in model.parameters()) + 1)
    cpu = autopar.plan(model, "cpu:2", (x,), constraints={"dp": 2, "tp": 1, "zero": 0}, alternatives=False)
    assert cpu.cluster.device.overlap_efficiency < 1 and cpu.predicted.grad_sync_hidden_s > 0.0
    none = autopar.plan(
        model, _with_eta("cpu:2", 0.0), (x,), constraints={"dp": 2, "tp": 1, "zero": 0}, alternatives=False
    )
    assert none.predicted.grad_sync_hidden_s == 0.0
    assert none.predicted.grad_sync_s == pytest.approx(cpu.predicted.grad_sync_s + cpu.predicted.grad_sync_hidden_s)
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    full = _plan(model, x, traced, recompute="full")
    assert full.recompute == "full" and full.program == "sharded"
    assert full.predicted.grad_sync_hidden_s == 0.0


# ------------------------------------------------------------- the sharded program: ZeRO buckets and prefetch


class _Tiny(_Fixed):
    """Compute far shorter than any collective: overlap hides almost nothing, the first branch of each max binds."""

    def forward_time_s(self, node, divisor=1):
        return FWD_S * 1e-6

    def backward_time_s(self, node, divisor=1):
        return BWD_S * 1e-6


# gathers and reduce-scatters priced on figures of their own, off the link's all-reduce ones, as `bench run` fits
# them for gloo: the hand formulas below take each collective's time from the link, so they hold either way
_PER_COLLECTIVE = {
    "all_gather": {"latency_s": 9e-6, "bandwidth_bytes_per_s": 150e9},
    "reduce_scatter": {"latency_s": 14e-6, "bandwidth_bytes_per_s": 60e9},
}


def _sharded_plan(model, x, traced, estimator, per_collective=None, **pins):
    cluster = autopar.ClusterSpec.parse("2xA100-80GB")
    if per_collective:
        cluster = autopar.ClusterSpec.from_overrides(
            {"cluster": "2xA100-80GB", "intra_node_link": {"per_collective": per_collective}}, source="test"
        )
    est = estimator(cluster.device, DType("bf16"))
    constraints = {"dp": 2, "tp": 1, "zero": 1, "num_microbatches": 1, **pins}
    return autopar.plan(
        model,
        cluster,
        (x,),
        constraints=constraints,
        estimator=est,
        _traced=traced,
        alternatives=False,
        precision="bf16",
    )


@pytest.mark.parametrize("per_collective", [None, _PER_COLLECTIVE], ids=["ring", "per-collective"])
@pytest.mark.parametrize("estimator", [_Fixed, _Tiny], ids=["compute-bound", "link-bound"])
def test_zero1_two_buckets_and_prefetch_price_what_compute_does_not_hide(monkeypatch, estimator, per_collective):
    """ZeRO-1 on dp=2, two gradient buckets: the formula by hand, from the link's collective times and the known
    op times. Gradients: E_g = max(sum RS_bw - B, T_last) (the backward after each bucket hides it, the last
    bucket nothing); gathers (prefetch depth 1): E_a = max(sum AG_bw - F, T_first) (the forward of the layers
    before each gather); every collective's latency stays exposed, the gathers' one per layer (the program gathers
    a layer's weights in one all-gather), and so does each weight's copy out of the gathered buffer. With overlap off,
    the synchronous price."""
    model, x = _stack()
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    params = list(model.parameters())
    prec = Precision.get("bf16")
    grad_bytes = [p.numel() * prec.grad_bytes_at(1) for p in params]
    param_bytes = [p.numel() * prec.param_bytes for p in params]
    bucket = sum(grad_bytes) // 2 + 1  # two buckets
    monkeypatch.setattr(units, "PRICED_BUCKET_BYTES", bucket)
    off = _sharded_plan(model, x, traced, estimator, per_collective, overlap=False)
    on = _sharded_plan(model, x, traced, estimator, per_collective)
    assert (off.program, on.program, on.zero_stage, on.prefetch_depth) == ("sharded", "sharded", 1, 1)
    link = on.cluster.link_for_axis(2, 1)
    assert bool(link.per_collective) == bool(per_collective)

    def t(kind, nbytes):
        return estimate_collective_time(kind, nbytes, 2, link)

    rs, ag = Collective.REDUCE_SCATTER, Collective.ALL_GATHER
    layers = len(model.layers)  # every weight is in one of them: one gather's latency per layer
    # each weight copied out of its layer's gathered buffer (several weights a layer): its bytes read and written
    device = on.cluster.device
    unpack = sum(2 * p for p in param_bytes) / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    # overlap off: one reduce-scatter per parameter, paying its whole latency, and one gather per layer
    old = sum(t(rs, g) + t(ag, p) - t(ag, 1.0) for g, p in zip(grad_bytes, param_bytes, strict=True))
    old += layers * t(ag, 1.0) + unpack
    assert off.predicted.grad_sync_s == pytest.approx(old, rel=1e-6) and off.predicted.grad_sync_hidden_s == 0.0
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    est = estimator(on.cluster.device, DType("bf16"))
    forward, backward = ops * est.forward_time_s(None), ops * est.backward_time_s(None)
    rs_bw = sum(t(rs, g) - t(rs, 1.0) for g in grad_bytes)
    ag_bw = sum(t(ag, p) - t(ag, 1.0) for p in param_bytes)
    fixed = sum(t(rs, 1.0) * g / bucket for g in grad_bytes) + layers * t(ag, 1.0) + t(rs, 1.0) + unpack
    last = t(rs, bucket) - t(rs, 1.0)
    first = t(ag, param_bytes[0]) - t(ag, 1.0)
    e_g, e_a = max(rs_bw - backward, last), max(ag_bw - forward, first)
    # HiGHS meets a row to its feasibility tolerance, 1e-7 (seconds here): the first gather of this model (a norm's
    # 512 bytes, ~1e-9 s) is below it; a bucket (~3e-6 s) or the gathers' sum is not
    assert on.predicted.grad_sync_s == pytest.approx(e_g + e_a + fixed, rel=1e-6, abs=1e-7)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(rs_bw + ag_bw - e_g - e_a, rel=1e-6, abs=1e-7)
    hidden = on.predicted.grad_sync_hidden_s
    assert on.hidden_communication == ({"comm_dp": hidden} if hidden > 0 else {})
    # depth 0: the gathers wait where they are used, whole; the gradient buckets still hide
    flat = _sharded_plan(model, x, traced, estimator, per_collective, prefetch_depth=0)
    gathers = sum(t(ag, p) - t(ag, 1.0) for p in param_bytes) + layers * t(ag, 1.0)
    depth0 = e_g + gathers + fixed - layers * t(ag, 1.0)
    assert flat.predicted.grad_sync_s == pytest.approx(depth0, rel=1e-6, abs=1e-7)
    # the gathered weights in flight ahead of use: one layer's (the largest), in the compute format
    layer = sum(p.numel() for p in model.layers[0].parameters()) * prec.param_bytes
    assert on.predicted.memory_breakdown["prefetch"] == pytest.approx(layer)
    assert "prefetch" not in flat.predicted.memory_breakdown or not flat.predicted.memory_breakdown["prefetch"]


# ------------------------------------------------------------- ZeRO-2/3: the gradient buckets in flight


class _Chain(nn.Module):
    """Three bias-free linears of known sizes: backward completes their gradients last layer first."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(64, 256, bias=False), nn.Linear(256, 256, bias=False), nn.Linear(256, 64, bias=False)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero23_memory_counts_the_buckets_in_flight(monkeypatch, stage):
    """ZeRO-2/3 with overlap hold, beyond the synchronous plan's gradients, the buckets of one backward: the one
    being filled (its bf16 send buffer B, which backward writes the gradients into) and at most 2 launched ones (B
    and this rank's received piece B / dp each); launching a third waits for the oldest first. By hand, buckets in
    backward's order (the last layer's first), dp = 2:
    max over bucket j of max(B_j + 1.5 (B_{j-1} + B_{j-2}), 1.5 (B_j + B_{j-1}))."""
    torch.manual_seed(0)
    model, x = _Chain(), torch.randn(8, 16, 64)
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    last, middle, first = (p.numel() * 2 for p in reversed(list(model.parameters())))  # bf16 bytes, backward order

    def extra(bucket_bytes):
        monkeypatch.setattr(units, "PRICED_BUCKET_BYTES", bucket_bytes)
        on, off = (_sharded_plan(model, x, traced, _Fixed, zero=stage, overlap=o) for o in (True, False))
        assert on.overlap and not off.overlap
        return on.predicted.memory_breakdown["grads"] - off.predicted.memory_breakdown["grads"]

    # one parameter a bucket: the first layer's filling, the two others in flight
    one_each = max(1.5 * last, middle + 1.5 * last, 1.5 * (last + middle), first + 1.5 * (last + middle))
    assert one_each == first + 1.5 * (last + middle)
    assert extra(1) == pytest.approx(one_each, rel=1e-12)
    # the last two layers in one bucket (closed once it holds BUCKET_BYTES), the first in another: both launched
    two = last + middle
    assert extra(two) == pytest.approx(max(1.5 * two, first + 1.5 * two, 1.5 * (two + first)), rel=1e-12)
    assert extra(two) == pytest.approx(1.5 * (two + first), rel=1e-12)
    # the formulas above take the window of buckets in flight, which the runtime runs and the solver prices, as two
    from autopar.runtime import overlap

    assert units.BUCKETS_IN_FLIGHT == overlap.WINDOW == 2


def _balanced(backward_s: float):
    """Ops whose backwards take `backward_s` in all (forwards half of it), for `ops` ops of one micro-batch."""

    class _Balanced(_Fixed):
        def forward_time_s(self, node, divisor=1):
            return backward_s / 2

        def backward_time_s(self, node, divisor=1):
            return backward_s

    return _Balanced


@pytest.mark.parametrize("kind", ["compute-bound", "link-bound", "balanced"])
def test_zero2_each_micro_batch_hides_its_own_buckets(monkeypatch, kind):
    """ZeRO-2 on dp=2 with m = 2 micro-batches and two gradient buckets: each micro-batch's backward reduce-scatters
    its buckets (2 x the reduce-scatters of a step at ZeRO-1) and hides them behind its own backward, so the step's
    whole backward B hides them: E_g = max(m sum RS_bw - B, m T_last); every bucket's latency, m times. The gathers
    are priced as at ZeRO-1 (once per step, behind the step's forward, one latency per layer)."""
    model, x = _stack()
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    params = list(model.parameters())
    prec = Precision.get("bf16")
    grad_bytes = [p.numel() * prec.grad_bytes_at(2) for p in params]
    param_bytes = [p.numel() * prec.param_bytes for p in params]
    bucket = sum(grad_bytes) // 2 + 1  # two buckets
    monkeypatch.setattr(units, "PRICED_BUCKET_BYTES", bucket)
    m = 2
    link = autopar.ClusterSpec.parse("2xA100-80GB").link_for_axis(2, 1)

    def t(kind, nbytes):
        return estimate_collective_time(kind, nbytes, 2, link)

    rs, ag = Collective.REDUCE_SCATTER, Collective.ALL_GATHER
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    rs_bw = m * sum(t(rs, g) - t(rs, 1.0) for g in grad_bytes)
    # balanced: the step's backward is a quarter of the reduce-scatters, so hiding them behind the whole backward
    # (not the last micro-batch's alone) and paying the last bucket of each micro-batch give different prices
    estimator = {"compute-bound": _Fixed, "link-bound": _Tiny, "balanced": _balanced(rs_bw / 4 / (m * ops))}[kind]
    on = _sharded_plan(model, x, traced, estimator, zero=2, num_microbatches=m, overlap=True)
    assert (on.zero_stage, on.num_microbatches, on.overlap) == (2, m, True)
    est = estimator(on.cluster.device, DType("bf16"))
    # every op runs once per micro-batch (the estimators' times do not depend on the shape)
    forward, backward = m * ops * est.forward_time_s(None), m * ops * est.backward_time_s(None)
    ag_bw = sum(t(ag, p) - t(ag, 1.0) for p in param_bytes)
    # the gathers' latency: one per layer (a layer's weights in one all-gather); each weight's copy out of it
    device = on.cluster.device
    unpack = sum(2 * p for p in param_bytes) / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    fixed = m * sum(t(rs, 1.0) * g / bucket for g in grad_bytes) + len(model.layers) * t(ag, 1.0) + m * t(rs, 1.0)
    fixed += unpack
    last = t(rs, bucket) - t(rs, 1.0)
    first = m * (t(ag, param_bytes[0]) - t(ag, 1.0))
    e_g, e_a = max(rs_bw - backward, m * last), max(ag_bw - forward, first)
    # HiGHS's feasibility tolerance, 1e-7 s (see the ZeRO-1 case)
    assert on.predicted.grad_sync_s == pytest.approx(e_g + e_a + fixed, rel=1e-6, abs=1e-7)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(rs_bw + ag_bw - e_g - e_a, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------- the offload program: ZeRO-3 over chunks


@pytest.mark.parametrize("per_collective", [None, _PER_COLLECTIVE], ids=["ring", "per-collective"])
@pytest.mark.parametrize("estimator", [_Fixed, _Tiny], ids=["compute-bound", "link-bound"])
def test_offload_chunks_price_what_compute_does_not_hide(estimator, per_collective):
    """The offload program (offload pinned, ZeRO-3 on dp=2, m = 1) reduce-scatters and gathers whole chunks, the
    ones its runtime packs the model into: per chunk c, RS_c (its fp32 gradient staging) and two gathers AG_c (bf16
    payload, forward and backward), each paying one latency. Overlap off: all of it waits. On: the backward hides
    the reduce-scatters and the backward's gathers, E_g = max(sum RS_bw + sum AG_bw - B, RS_bw,first + AG_bw,last)
    (the first chunk's gradients come last, and backward starts by gathering the last chunk); the forward hides
    the prefetched gathers, E_a = max(sum AG_bw - F, AG_bw,first); every latency stays exposed."""
    from autopar.memory.layout import ALIGN_NUMEL, offload_chunk_numel, pack
    from autopar.memory.store import module_params

    model, x = _stack()
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    cluster = autopar.ClusterSpec.from_overrides(
        {"cluster": "2xA100-80GB", "intra_node_link": {"per_collective": per_collective or {}}}, source="test"
    )
    est = estimator(cluster.device, DType("bf16"))
    budget = 30e6  # chunks of at most 1/16 of it (payload and fp32 staging): several chunks for this model

    def plan(**pins):
        constraints = {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 1, "recompute": "none", **pins}
        return autopar.plan(
            model,
            cluster,
            (x,),
            constraints=constraints,
            estimator=est,
            _traced=traced,
            alternatives=False,
            precision="bf16",
            offload=True,
            memory_budget=budget,
        )

    on, off = plan(), plan(overlap=False)
    assert (on.program, off.program, on.overlap, off.overlap) == ("offload", "offload", True, False)
    specs = module_params(model)[0]
    numel = offload_chunk_numel([sp.numel for sp in specs], dp=2, budget_bytes=budget, compute_itemsize=2)
    chunks = pack(specs, numel, multiple=ALIGN_NUMEL * 2)
    assert len(chunks) >= 3
    link = cluster.link_for_axis(2, 1)
    assert bool(link.per_collective) == bool(per_collective)

    def t(kind, nbytes):
        return estimate_collective_time(kind, nbytes, 2, link)

    rs, ag = Collective.REDUCE_SCATTER, Collective.ALL_GATHER
    rs_bw = [t(rs, 4 * c.capacity) - t(rs, 0) for c in chunks]
    ag_bw = [t(ag, 2 * c.capacity) - t(ag, 0) for c in chunks]
    fixed = len(chunks) * (t(rs, 0) + 2 * t(ag, 0))
    total = sum(rs_bw) + 2 * sum(ag_bw) + fixed
    assert off.predicted.grad_sync_s == pytest.approx(total, rel=1e-6) and off.predicted.grad_sync_hidden_s == 0.0
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    forward, backward = ops * est.forward_time_s(None), ops * est.backward_time_s(None)
    e_g = max(sum(rs_bw) + sum(ag_bw) - backward, rs_bw[0] + ag_bw[-1])
    e_a = max(sum(ag_bw) - forward, ag_bw[0])
    # HiGHS's feasibility tolerance, 1e-7 s (see the ZeRO-1 case)
    assert on.predicted.grad_sync_s == pytest.approx(e_g + e_a + fixed, rel=1e-6, abs=1e-7)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(total - fixed - e_g - e_a, rel=1e-6, abs=1e-7)
    # one chunk gathered ahead: the largest one's payload
    assert on.predicted.memory_breakdown["prefetch"] == pytest.approx(2 * max(c.capacity for c in chunks))

"""The price of overlap: the data-parallel program's gradient all-reduces run while the last micro-batch's
backward goes on; the plan's exposed sync is what does not fit behind it (the last bucket never does), and of
the backward it overlaps, only the device's overlap efficiency eta hides it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.cost_model import AnalyticEstimator, DType
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.passes import sharding_solver
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
    return autopar.plan(model, cluster, (x,), constraints={"dp": 2, "tp": 1, "zero": 0, "num_microbatches": 1, **pins},
                        estimator=est, _traced=traced, alternatives=False)  # fmt: skip


def test_two_buckets_exposed_time_is_what_backward_does_not_hide(monkeypatch):
    model, x = _stack()
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())  # fp32 reduction of every gradient
    bucket = grad_bytes // 2 + 1  # two buckets
    monkeypatch.setattr(sharding_solver, "BUCKET_BYTES", bucket)
    off = _plan(model, x, traced, overlap=False)
    on = _plan(model, x, traced)
    assert off.overlap is False and on.overlap is True
    total = off.predicted.grad_sync_s  # every bucket's all-reduce, exposed
    assert off.predicted.grad_sync_hidden_s == 0.0
    # the formula by hand: backward of the one micro-batch hides what it can; the last bucket never hides
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    backward = ops * BWD_S
    link = on.cluster.link_for_axis(2, 1)
    last = estimate_collective_time(Collective.ALL_REDUCE, bucket, 2, link)
    expected = max(last, total - backward)
    assert on.predicted.grad_sync_s == pytest.approx(expected, rel=1e-6)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(total - expected, rel=1e-6)
    assert on.predicted.step_time_s == pytest.approx(off.predicted.step_time_s - (total - expected), rel=1e-6)
    assert autopar.Plan.from_json(on.to_json()).predicted.grad_sync_hidden_s == on.predicted.grad_sync_hidden_s


def _with_eta(cluster: str, eta: float) -> autopar.ClusterSpec:
    spec = autopar.ClusterSpec.parse(cluster)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, overlap_efficiency=eta))


@pytest.mark.parametrize(("cluster", "eta"), [("2xA100-80GB", 0.5), ("cpu:2", 0.25), ("cpu:2", 0.9)])
def test_two_buckets_hide_eta_of_the_backward_they_overlap(monkeypatch, cluster, eta):
    """exposed = max(T_last, sync - eta B, (1 - eta) sync): on every device kind, at the device's eta."""
    model, x = _stack()
    spec = _with_eta(cluster, eta)
    # the plan's compute format: bf16 on GPUs, fp32 on CPUs (gradients are reduced in fp32 either way)
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16 if spec.device.kind == "gpu" else torch.float32)
    ops = sum(
        1 for n in traced.exported.graph.nodes if n.op == "call_function" and n.meta["val"].dtype.is_floating_point
    )
    backward = ops * BWD_S
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    bucket = grad_bytes // 2 + 1  # two buckets
    monkeypatch.setattr(sharding_solver, "BUCKET_BYTES", bucket)
    off = _plan(model, x, traced, spec, overlap=False)
    on = _plan(model, x, traced, spec)
    total = off.predicted.grad_sync_s
    last = estimate_collective_time(Collective.ALL_REDUCE, bucket, 2, spec.link_for_axis(2, 1))
    expected = max(last, total - eta * backward, (1 - eta) * total)
    assert expected > last  # the case prices eta, not only the last bucket
    assert on.predicted.grad_sync_s == pytest.approx(expected, rel=1e-6)
    assert on.predicted.grad_sync_hidden_s == pytest.approx(total - expected, rel=1e-6)
    # overlap off: the old price, every bucket exposed
    assert off.predicted.grad_sync_hidden_s == 0.0
    assert on.predicted.step_time_s == pytest.approx(off.predicted.step_time_s - (total - expected), rel=1e-6)


def test_overlap_is_not_priced_at_eta_zero_or_with_recompute():
    """A device whose communication hides nothing behind compute (eta = 0), and a recomputed layout, which runs
    on the sharded program (it reduces each gradient in its from_local's backward): neither hides anything;
    the cpu preset's eta does hide some."""
    model, x = _stack()
    cpu = autopar.plan(model, "cpu:2", (x,), constraints={"dp": 2, "tp": 1, "zero": 0}, alternatives=False)
    assert cpu.cluster.device.overlap_efficiency < 1 and cpu.predicted.grad_sync_hidden_s > 0.0
    none = autopar.plan(model, _with_eta("cpu:2", 0.0), (x,), constraints={"dp": 2, "tp": 1, "zero": 0},
                        alternatives=False)  # fmt: skip
    assert none.predicted.grad_sync_hidden_s == 0.0
    assert none.predicted.grad_sync_s == pytest.approx(cpu.predicted.grad_sync_s + cpu.predicted.grad_sync_hidden_s)
    traced = trace_model(model, (x,), compute_dtype=torch.bfloat16)
    full = _plan(model, x, traced, recompute="full")
    assert full.recompute == "full" and full.program == "sharded"
    assert full.predicted.grad_sync_hidden_s == 0.0

"""Numerics: a Megatron-style sequence-parallel placement on the tensor axis trains as one process does.

The placement comes from the planner on a GPU cluster (2xA100-80GB, fp32, tp=2) under a budget just below its
memory-free plan's peak: there the MLP norms and the residual adds run split over the sequence (S(1)), with a
reduce-scatter after each row-parallel matmul and an all-gather before the column-parallel ones. The CPU
planner prices gloo and prefers other layouts for a model this small, so the GPU plan's placements are put
into a cpu:2 plan of the same model (same pinned tp, ZeRO stage, micro-batches and recompute; the traced graphs
name the same nodes) and that plan is compiled on two gloo ranks.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import PreNormStack

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # about 23 s on two cores

HIDDEN, HEADS, SEQ = 256, 4, 256
PINS = {"tp": 2, "num_microbatches": 1, "recompute": "none", "zero": 0}
# fp32 on CPU: the collectives change the order of summation, so results agree to rounding (~1e-6 relative);
# a norm or residual run on the wrong rows, or a missing reduction, moves them by the order of the values.
LOSS_RTOL = 1e-4
STATE_TOL = 1e-5  # of max(|reference|, 1e-2), elementwise


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return PreNormStack(HIDDEN, HEADS, 2)


def _batch() -> torch.Tensor:
    return torch.randn(1, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))


def _optimizer(params):
    # SGD with momentum: its update scales with the gradient, so a wrong gradient scale shows
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _sequence_parallel_plan() -> autopar.Plan:
    with torch.device("meta"):
        meta = PreNormStack(HIDDEN, HEADS, 2)
    x = _batch().to("meta")
    kw = dict(constraints=PINS, alternatives=False, precision="fp32", fuse_kernels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loss's mean has no rule: not what this test is about
        free = autopar.plan(meta, "2xA100-80GB", (x,), **kw)
        gpu = autopar.plan(meta, "2xA100-80GB", (x,), memory_budget=int(free.predicted.peak_memory_bytes * 0.95), **kw)
        cpu = autopar.plan(_model(), "cpu:2", (_batch(),), **kw)
    assert set(cpu.node_output) == set(gpu.node_output), "both plans name the nodes of one traced graph"
    return dataclasses.replace(
        cpu,
        node_output=gpu.node_output,
        node_inputs=gpu.node_inputs,
        node_strategy=gpu.node_strategy,
        param_placements=gpu.param_placements,
    )


def _train(rank: int, world_size: int, plan_json: str):
    model, x = _model(), _batch()
    pm = autopar.compile(model, f"cpu:{world_size}", (x,), optimizer=_optimizer, plan=autopar.Plan.from_json(plan_json))
    losses = [pm.train_step(x) for _ in range(2)]
    state = pm.state_dict()  # a collective: every rank gathers
    return {"losses": losses, "state": state if rank == 0 else None, "node_output": dict(pm.plan.node_output)}


def test_sequence_parallel_placement_trains_like_one_process():
    plan = _sequence_parallel_plan()
    sp = {n: plan.node_output[n] for n in ("layer_norm_1", "layer_norm_3", "add", "add_1", "add_2", "add_3")}
    assert set(sp.values()) == {"S(1)"}, sp  # the MLP norms and every residual add split over the sequence
    assert plan.node_strategy["linear_5"] == "row parallel" and plan.node_strategy["linear_4"] == "column parallel"

    results = run_distributed(_train, 2, plan.to_json())
    model, x = _model(), _batch()
    opt = _optimizer(model.parameters())
    ref_losses = []
    for _ in range(2):
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    got = results[0]
    assert got["node_output"]["layer_norm_1"] == "S(1)", "compile ran the plan's placements, not a new solve"
    assert results[1]["losses"] == pytest.approx(got["losses"], rel=1e-6)  # every rank reports one loss
    assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    assert got["losses"][1] != pytest.approx(got["losses"][0], rel=1e-3), "the first step changed the model"
    ref_state = model.state_dict()
    assert set(got["state"]) == set(ref_state)
    for key, ref in ref_state.items():
        scale = max(ref.abs().max().item(), 1e-2)
        torch.testing.assert_close(
            got["state"][key], ref, atol=STATE_TOL * scale, rtol=0, msg=lambda m, k=key: f"{k}: {m}"
        )

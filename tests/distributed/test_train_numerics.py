"""Numerics: parallel training on 2 and 4 gloo ranks gives the single-process losses and parameters."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
MODELS = ("llama", "gpt2", "bert")
# fp32 on CPU: collectives change the order of summation, so losses agree to rounding (~1e-6 relative),
# well inside the 1e-4.
LOSS_RTOL = 1e-4
# AdamW divides each gradient by its running RMS: for gradients near eps, rounding-level differences
# (from a different summation order) become update differences. eps=1e-6 (instead of 1e-8) keeps that
# amplification below 1e-5 at lr=1e-2 for these models; a wrong shard or a missing reduction moves
# parameters by ~lr = 1e-2, a thousand times the tolerance.
ADAM_EPS = 1e-6
PARAM_ATOL, PARAM_RTOL = 2e-5, 1e-4


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _reference(name: str) -> tuple[list[float], dict]:
    model = make_model(name)
    args, kwargs = make_batch(name)
    opt = _optimizer(model.parameters())
    losses = []
    for _ in range(2):
        loss = model(*args, **kwargs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_cases(rank: int, world_size: int, cases):
    out = []
    for name, constraints in cases:
        model = make_model(name)
        args, kwargs = make_batch(name)
        pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=_optimizer,
                             constraints=constraints)  # fmt: skip
        losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
        state = pm.state_dict()
        local = sum(p.numel() for p in pm.parameters())
        out.append({"losses": losses, "state": state if rank == 0 else None, "mesh": dict(pm.plan.mesh),
                    "local_numel": local, "full_numel": sum(p.numel() for p in model.parameters())})  # fmt: skip
    return out


def _check(world_size: int, cases) -> None:
    results = run_distributed(_train_cases, world_size, cases)
    for i, (name, constraints) in enumerate(cases):
        ref_losses, ref_state = _reference(name)
        got = results[0][i]
        for r in range(world_size):  # every rank reports the same loss
            assert results[r][i]["losses"] == pytest.approx(got["losses"], rel=1e-6)
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (name, constraints, got["mesh"])
        if "tp" in constraints:
            assert got["mesh"]["tp"] == constraints["tp"]
        assert set(got["state"]) == set(ref_state)
        for key, ref in ref_state.items():
            torch.testing.assert_close(got["state"][key], ref, atol=PARAM_ATOL, rtol=PARAM_RTOL,
                                       msg=lambda m, k=key: f"{name} {constraints} {k}: {m}")  # fmt: skip
        if got["mesh"]["tp"] > 1:  # parameters() holds this rank's shards, not full copies
            assert results[0][i]["local_numel"] < got["full_numel"]


def test_cpu2_free_and_tp2():
    _check(2, [(m, c) for m in MODELS for c in ({}, {"tp": 2})])


def test_cpu4_free_tp2_tp4():
    _check(4, [(m, c) for m in MODELS for c in ({}, {"tp": 2}, {"tp": 4})])

"""Expert parallelism trains a tiny Hugging Face Mixtral on gloo ranks as it trains in one process.

ep=2 on two ranks (each rank holds 2 of the 4 experts of each layer, tokens dispatched and combined by
all-to-all), and ep=2 on four ranks (two ep groups; each expert's gradient all-reduced over the two ranks holding
it, not the whole data axis: a reduction over the wrong group mixes different experts' gradients and moves the
weights by about lr). Two steps of SGD with momentum against the single-process reference (the second step's update
carries the first gradient through the momentum, so a wrong gradient scale shows), and of AdamW on two ranks.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.plan import Plan
from tests.distributed.harness import run_distributed
from tests.distributed.test_train_numerics import ADAM_EPS, PARAM_ATOL, PARAM_MEAN_ATOL
from tests.families import family_batch, make_family
from tests.models import train_locally

pytestmark = pytest.mark.distributed

STEPS = 2
LR = 1e-2
# fp32: the ranks sum each token's k expert outputs, and each expert's gradient over its tokens, in another order
# than one process does (~1e-7 relative per step, as in tests/distributed/test_family_matrix.py). Two steps at lr
# 1e-2 move the loss little: halving the gradients that come back through the all-to-alls moved the second loss by
# 1.6e-4 relative but the embedding by 3.9e-2 (seen): the weights, checked first, decide; the losses are held to 1e-4
LOSS_RTOL = 1e-4
# parameters relative to max(|reference|, 1e-2): rounding moves them by ~1e-6 of lr-sized steps, a wrong update ~lr
PARAM_RTOL, PARAM_FLOOR = 1e-4, 1e-2


def _optimizer(name: str):
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)


def _train(rank: int, world_size: int, plan_json: str, batch: int, optimizer: str) -> dict:
    del rank
    model = make_family("mixtral")
    args, kwargs = family_batch("mixtral", batch=batch)
    make = _optimizer(optimizer)
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=make, plan=Plan.from_json(plan_json))
    losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
    eval_loss = pm.eval_step(*args, **kwargs)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "losses": losses,
        "eval_loss": eval_loss,
        "state": pm.state_dict(),
        "program": str(pm.plan.program),
        "held": sum(p.numel() for p in pm.parameters()),
        "full": sum(p.numel() for p in model.parameters()),
        "experts": experts,
    }


# ep2 on SGD stays in `make test` (the issue asks for its smallest form there): on the warm pool of two ranks it took
# 14 s, plus 3.5 s of planning (44 s on a cold pool: spawning the ranks); the others are slow
CASES = [
    pytest.param(2, 4, "sgd", id="ep2"),
    pytest.param(2, 4, "adamw", id="ep2-adamw", marks=pytest.mark.slow),
    pytest.param(4, 8, "sgd", id="ep2xdp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world, batch, optimizer", CASES)
def test_expert_parallel_trains_as_in_one_process(world, batch, optimizer):
    args, kwargs = family_batch("mixtral", batch=batch)
    plan = autopar.plan(make_family("mixtral"), f"cpu:{world}", args, kwargs, constraints={"ep": 2}, alternatives=False)
    assert plan.program == "expert-parallel" and plan.mesh["dp"] == world
    ranks = run_distributed(_train, world, plan.to_json(), batch, optimizer, timeout_s=600)
    model = make_family("mixtral")
    ref_losses, ref_state = train_locally(model, args, kwargs, _optimizer(optimizer)(model.parameters()), STEPS)
    with torch.no_grad():
        ref_eval = float(model.eval()(*args, **kwargs).loss)
    for res in ranks:
        assert res["program"] == "expert-parallel"
        # each rank holds half of the experts and the whole rest of the model
        assert res["held"] == res["full"] - res["experts"] // 2
        assert set(res["state"]) == set(ref_state)
        for key, ref in ref_state.items():
            if optimizer == "adamw":  # AdamW's tolerances and their reason: tests/distributed/test_train_numerics.py
                torch.testing.assert_close(res["state"][key], ref, atol=PARAM_ATOL, rtol=PARAM_RTOL)
                assert (res["state"][key] - ref).abs().mean().item() <= PARAM_MEAN_ATOL, key
                continue
            err = ((res["state"][key] - ref).abs() / ref.abs().clamp_min(PARAM_FLOOR)).max().item()
            assert err <= PARAM_RTOL, (key, err)
        assert res["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
        assert res["eval_loss"] == pytest.approx(ref_eval, rel=LOSS_RTOL)  # the trained weights, the eval graph


# clipping: the norm of the step guard counts each expert's gradient once (held by dp/ep ranks) and the rest of
# the model once (held by every rank); `clip_grad_norm_` in one process is the reference. Same bounds as
# tests/distributed/test_step_guard.py: float32 rounding of the norm (~1e-7 relative; a missed or doubly counted
# half of the experts moves it by far more), SGD updates after two clipped steps equal to rounding.
MAX_NORM = 0.05
NORM_RTOL = 1e-6


def _train_clipped(rank: int, world_size: int, plan_json: str, batch: int) -> dict:
    del rank
    args, kwargs = family_batch("mixtral", batch=batch)
    pm = autopar.compile(
        make_family("mixtral"),
        f"cpu:{world_size}",
        args,
        kwargs,
        optimizer=_optimizer("sgd"),
        plan=Plan.from_json(plan_json),
        max_grad_norm=MAX_NORM,
    )
    norms = []
    for _ in range(STEPS):
        pm.train_step(*args, **kwargs)
        norms.append(pm.last_step.grad_norm)
    return {"norms": norms, "state": pm.state_dict()}


def test_expert_parallel_clips_by_the_global_norm_of_one_process():
    args, kwargs = family_batch("mixtral", batch=4)
    plan = autopar.plan(make_family("mixtral"), "cpu:2", args, kwargs, constraints={"ep": 2}, alternatives=False)
    ranks = run_distributed(_train_clipped, 2, plan.to_json(), 4, timeout_s=600)
    model = make_family("mixtral")
    opt = _optimizer("sgd")(model.parameters())
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        model(*args, **kwargs).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    assert norms[0] > 2 * MAX_NORM  # the clip is active, so a wrong norm changes the update
    ref_state = model.state_dict()
    for res in ranks:
        assert res["norms"] == pytest.approx(norms, rel=NORM_RTOL)
        for key, ref in ref_state.items():
            err = ((res["state"][key] - ref).abs() / ref.abs().clamp_min(PARAM_FLOOR)).max().item()
            assert err <= PARAM_RTOL, (key, err)

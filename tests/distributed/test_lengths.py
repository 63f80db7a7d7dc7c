"""Sequence lengths up to the planned one run on the plan's layout (each traced once and kept), pipelines included;
longer ones are refused with what to do."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.families import family_batch, make_family
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
LENGTHS = (16, 8, 12, 8, 16)  # planned at 16; 8 and 12 traced once each, then reused
LOSS_RTOL = 1e-6  # fp32: the same sums in another order (rounding only)
PARAM_ATOL = 1e-6  # SGD with momentum over five steps: rounding only


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _runs(rank: int, world_size: int, cases):
    out = []
    for _, constraints, offload in cases:
        args, kwargs = make_batch("llama", seq=LENGTHS[0])
        pm = autopar.compile(
            make_model("llama"),
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_sgd if not offload else None,
            constraints=constraints,
            offload=offload,
        )
        losses = []
        for seq in LENGTHS:
            a, k = make_batch("llama", seq=seq)
            losses.append(pm.train_step(*a, **k))
        longer = make_batch("llama", seq=32)
        try:
            pm.train_step(*longer[0], **longer[1])
            refused = None
        except autopar.ConfigError as e:
            refused = str(e)
        state = pm.state_dict()
        out.append(
            {
                "kind": str(pm.plan.program),
                "losses": losses,
                "lengths": pm.lengths.traced,
                "refused": refused,
                "state": state if rank == 0 else None,
            }
        )
    return out


def _reference(offload: bool):
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if offload else _sgd(model.parameters())
    losses = []
    for seq in LENGTHS:
        a, k = make_batch("llama", seq=seq)
        opt.zero_grad()
        loss = model(*a, **k).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, model.state_dict()


CASES = [
    ("data-parallel", {"dp": 2, "tp": 1}, None),
    ("sharded", {"tp": 2}, None),
    ("sharded", {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 2}, None),
    ("sharded", {"dp": 1, "cp": 2, "tp": 1}, None),
    ("offload", {"tp": 1}, True),
]


def test_shorter_sequences_run_on_the_planned_layout():
    runs = run_distributed(_runs, 2, CASES)
    refs = {offload: _reference(offload) for offload in (False, True)}
    for i, (kind, constraints, offload) in enumerate(CASES):
        ref_losses, ref_state = refs[bool(offload)]
        for r in range(2):
            got = runs[r][i]
            assert got["kind"] == kind, (kind, constraints)
            # the offload program's AdamW (lr 1e-3, compile's default) against the same: rounding only
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5 if offload else LOSS_RTOL), (kind, r)
            # each length traced once and kept; the offload program runs the model eagerly and traces none
            assert got["lengths"] == ([16] if offload else [8, 12, 16]), (kind, got["lengths"])
            assert got["refused"] is not None and "longer than the 16" in got["refused"], got["refused"]
        if not offload:
            for key, value in ref_state.items():
                torch.testing.assert_close(runs[0][i]["state"][key], value, atol=PARAM_ATOL, rtol=0)


# A pipeline (pp=2, two micro-batches) at 16, 8, 12, 8, 16 tokens: its stages cut again at each new length, the
# activations and gradients between them sent at that length. The LLaMA with SGD with momentum as above, and with
# AdamW (lr 1e-3 and eps 1e-6 on both sides: `ADAM_EPS` of the numerics tests, which damps rounding-level gradients
# near eps); a T5, whose encoder and decoder stacks are cut as one sequence of layers, with SGD.
PIPELINE = {"pp": 2, "tp": 1, "num_microbatches": 2}
ADAM_EPS = 1e-6
# AdamW over five steps: each element's update is about lr = 1e-3 whatever its gradient's size, so a wrong stage
# boundary or scale moves most elements by ~1e-3; rounding-level differences of gradients near eps move single ones
# by far less. 1e-5 (1% of lr) per element.
ADAM_PARAM_ATOL = 1e-5


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=ADAM_EPS)


PIPELINE_CASES = [("llama", _sgd), ("llama", _adamw), ("t5", _sgd)]


def _model_and_batch(name: str):
    if name == "t5":
        return make_family("t5"), lambda seq: family_batch("t5", seq=seq)
    return make_model(name), lambda seq: make_batch(name, seq=seq)


def _pipeline_runs(rank: int, world_size: int):
    out = []
    for name, optimizer in PIPELINE_CASES:
        model, batch = _model_and_batch(name)
        pm = autopar.compile(model, f"cpu:{world_size}", *batch(LENGTHS[0]), optimizer=optimizer, constraints=PIPELINE)
        losses = [pm.train_step(*a, **k) for a, k in map(batch, LENGTHS)]
        short = batch(8)
        evaluated = pm.eval_step(*short[0], **short[1])
        longer = batch(32)
        try:
            pm.train_step(*longer[0], **longer[1])
            refused = None
        except autopar.ConfigError as e:
            refused = str(e)
        out.append(
            {
                "kind": str(pm.plan.program),
                "losses": losses,
                "eval": evaluated,
                "lengths": pm.lengths.traced,
                "refused": refused,
                "state": pm.state_dict(),
            }
        )
    return out


def _pipeline_reference(name: str, optimizer):
    model, batch = _model_and_batch(name)
    opt = optimizer(model.parameters())
    losses = []
    for seq in LENGTHS:
        a, k = batch(seq)
        opt.zero_grad()
        loss = model(*a, **k).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    a, k = batch(8)
    with torch.no_grad():
        evaluated = float(model.eval()(*a, **k).loss)
    return losses, evaluated, model.state_dict()


@pytest.mark.slow
def test_a_pipeline_runs_shorter_sequences_on_its_stages():
    runs = run_distributed(_pipeline_runs, 2)
    for i, (name, optimizer) in enumerate(PIPELINE_CASES):
        case = (name, optimizer.__name__)
        ref_losses, ref_eval, ref_state = _pipeline_reference(name, optimizer)
        for r in range(2):
            got = runs[r][i]
            assert got["kind"] == "pipeline", (case, got["kind"])
            # fp32: the same sums in another order (rounding only), every rank reporting the last stage's loss
            assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (case, r)
            assert got["eval"] == pytest.approx(ref_eval, rel=LOSS_RTOL), (case, r)
            assert got["lengths"] == [8, 12, 16], (case, got["lengths"])
            assert got["refused"] is not None and "longer than the 16" in got["refused"], (case, got["refused"])
        atol = PARAM_ATOL if optimizer is _sgd else ADAM_PARAM_ATOL
        for key, value in ref_state.items():
            torch.testing.assert_close(
                runs[0][i]["state"][key], value, atol=atol, rtol=0, msg=lambda m, k=key, c=case: f"{c} {k}: {m}"
            )


# A pipeline with a cp axis (pp=2 x cp=2 on 4 ranks): each length's trace is cut from one cp rank's share of the
# sequences (zig-zag chunks, so lengths divisible by 2 cp = 4), the stages send that share at the new length.
CP_PIPELINE = {"pp": 2, "cp": 2, "tp": 1, "num_microbatches": 2, "cp_attention": "allgather"}


def _cp_pipeline_runs(rank: int, world_size: int):
    pm = autopar.compile(
        make_model("llama"), f"cpu:{world_size}", *make_batch("llama", batch=4), optimizer=_sgd, constraints=CP_PIPELINE
    )
    losses = [pm.train_step(*a, **k) for a, k in (make_batch("llama", batch=4, seq=seq) for seq in LENGTHS)]
    return {"kind": str(pm.plan.program), "losses": losses, "lengths": pm.lengths.traced, "state": pm.state_dict()}


@pytest.mark.slow
def test_a_pipeline_with_a_cp_axis_runs_shorter_sequences():
    runs = run_distributed(_cp_pipeline_runs, 4, timeout_s=900)
    model = make_model("llama")
    opt = _sgd(model.parameters())
    ref_losses = []
    for seq in LENGTHS:
        a, k = make_batch("llama", batch=4, seq=seq)
        opt.zero_grad()
        loss = model(*a, **k).loss
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    for r, got in enumerate(runs):
        assert got["kind"] == "pipeline" and got["lengths"] == [8, 12, 16], (r, got["kind"], got["lengths"])
        # fp32: the same sums in another order (rounding only)
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), r
    for key, value in model.state_dict().items():
        torch.testing.assert_close(
            runs[0]["state"][key], value, atol=PARAM_ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}"
        )

"""The step guard on every program kind: the global gradient norm and clipping against one process's
`torch.nn.utils.clip_grad_norm_`, non-finite losses raised or skipped with nothing applied, and gradient
accumulation across calls equal to one step over the calls' rows."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
MAX_NORM = 0.5  # below the tiny models' gradient norms (about 1.5 to 3): every step is clipped
STEPS = 2
# The norm is one fp32 gradient per element summed in another order (shards, ranks, micro-batches): its
# relative difference is about a float32 epsilon (seen: up to 6e-8 on 2 ranks); a missed or doubly counted
# replica moves it by a factor sqrt(2) or more.
NORM_RTOL = 1e-6
# SGD with momentum after two clipped steps: the updates differ by rounding only (seen up to 4e-9); a wrong
# clip coefficient moves every element by about lr * |g| * the coefficient's error, above 1e-5.
PARAM_ATOL = 1e-6
# The layouts of each program kind (tiny LLaMA; GPT-2 for weights tied across pipeline stages).
CASES = {
    2: [
        ("data-parallel", "llama", {"dp": 2, "tp": 1}, None),
        ("sharded", "llama", {"tp": 2}, None),
        ("sharded", "llama", {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 2}, None),
        ("sharded", "llama", {"dp": 1, "cp": 2, "tp": 1}, None),
        ("pipeline", "gpt2", {"pp": 2, "num_microbatches": 2}, None),
        ("offload", "llama", {"tp": 1}, True),
    ],
    4: [
        ("sharded", "llama", {"tp": 2, "dp": 2, "zero": 1}, None),
        ("pipeline", "llama", {"pp": 2, "dp": 2, "zero": 1, "num_microbatches": 2}, None),
        ("pipeline", "gpt2", {"pp": 2, "tp": 2, "num_microbatches": 2}, None),
    ],
}


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def _reference(name: str, make_opt, steps: int) -> tuple[list[float], dict]:
    """One process: backward, `clip_grad_norm_`, step; (norms before clipping, final state)."""
    model = make_model(name)
    args, kwargs = make_batch(name)
    opt = make_opt(model.parameters())
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        model(*args, **kwargs).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clipped_runs(rank: int, world_size: int, cases, opt_name: str):
    out = []
    for _, name, constraints, offload in cases:
        args, kwargs = make_batch(name)
        pm = autopar.compile(
            make_model(name),
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_sgd if opt_name == "sgd" else _adamw,
            constraints=constraints,
            offload=offload,
            max_grad_norm=MAX_NORM,
        )
        norms = []
        for _ in range(STEPS):
            pm.train_step(*args, **kwargs)
            norms.append(pm.last_step.grad_norm)
        stats = pm.last_step
        state = pm.state_dict()
        out.append(
            {
                "kind": str(pm.plan.program),
                "norms": norms,
                "clipped": stats.clipped,
                "tokens": stats.tokens,
                "step": stats.step,
                "state": state if rank == 0 else None,
            }
        )
    return out


def _check_clipped(world_size: int, opt_name: str, kinds=None) -> None:
    cases = [c for c in CASES[world_size] if opt_name == "adamw" or c[0] != "offload"]  # offload runs AdamW only
    cases = [c for c in cases if kinds is None or c[0] in kinds]
    runs = run_distributed(_clipped_runs, world_size, cases, opt_name)
    refs = {}
    for i, (kind, name, constraints, _) in enumerate(cases):
        if name not in refs:
            refs[name] = _reference(name, _sgd if opt_name == "sgd" else _adamw, STEPS)
        ref_norms, ref_state = refs[name]
        for r in range(world_size):
            got = runs[r][i]
            assert got["kind"] == kind, (kind, constraints)
            assert got["norms"] == pytest.approx(ref_norms, rel=NORM_RTOL), (kind, constraints, r, got["norms"])
            assert got["clipped"] and got["step"] == STEPS
            assert got["tokens"] == make_batch(name)[0][0].numel()
        if opt_name == "sgd":
            for key, ref in ref_state.items():
                torch.testing.assert_close(
                    runs[0][i]["state"][key], ref, atol=PARAM_ATOL, rtol=0, msg=lambda m, k=key, c=kind: f"{c} {k}: {m}"
                )


# `make test` clips under AdamW the offload program only (it runs no SGD): for the others the norms and the clipping
# are those of the gradients, which the SGD run checks, and it alone compares the parameters (an AdamW update hides a
# wrong clip coefficient); `make test-all` clips every program under AdamW too
@pytest.mark.parametrize(
    "opt_name, kinds",
    [("sgd", None), ("adamw", ("offload",)), pytest.param("adamw", None, marks=pytest.mark.slow)],
    ids=["sgd", "adamw-offload", "adamw"],
)
def test_clipping_matches_clip_grad_norm_on_every_program_2_ranks(opt_name, kinds):
    _check_clipped(2, opt_name, kinds)


@pytest.mark.slow
def test_clipping_matches_clip_grad_norm_on_4_ranks():
    _check_clipped(4, "sgd")


def _poison(pm, value: float):
    """Set one master element to `value` (inf makes the loss and the gradients non-finite); returns an undo."""
    if str(pm.plan.program) == "offload":
        chunk = next(c for c in pm.store.chunks if c.requires_grad)
        saved = chunk.master.detach().clone()
        with torch.no_grad():
            chunk.master.view(-1)[0] = value
        pm.store.refresh_payloads()

        def undo():
            with torch.no_grad():
                chunk.master.copy_(saved)
            pm.store.refresh_payloads()

        return undo
    first = next(iter(pm.parameters()))
    saved = first.detach().clone()
    with torch.no_grad():
        first.view(-1)[0] = value

    def undo():
        with torch.no_grad():
            first.copy_(saved)

    return undo


def _nonfinite_runs(rank: int, world_size: int, cases):
    out = []
    for _, constraints, offload, precision in cases:
        args, kwargs = make_batch("llama")
        got, plan = {}, None
        for policy in ("raise", "skip"):
            # the policy is a training-loop option, not the plan's: the second program takes the first one's plan
            # (`plan=`), so that the ranks solve each layout once
            pm = autopar.compile(
                make_model("llama"),
                f"cpu:{world_size}",
                args,
                kwargs,
                optimizer=_adamw,
                plan=plan,
                on_nonfinite=policy,
                **({} if plan else {"constraints": constraints, "offload": offload, "precision": precision}),
            )
            plan = pm.plan
            pm.train_step(*args, **kwargs)
            before = pm.state_dict()
            undo = _poison(pm, float("inf"))
            try:
                pm.train_step(*args, **kwargs)
                got[policy] = {"raised": None}
            except autopar.NonFiniteError as e:
                got[policy] = {"raised": e.step, "message": str(e)}
            undo()
            after = pm.state_dict()
            got[policy] |= {
                "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                "num_steps": pm.num_steps,
                "last": pm.last_step,
                "kind": str(pm.plan.program),
            }
            pm.train_step(*args, **kwargs)  # the next step trains
            got[policy]["trains"] = any(not torch.equal(before[k], v) for k, v in pm.state_dict().items())
        out.append(got)
    return out


# `make test` runs bf16 (the mixed-precision path: a loss cast up, gradients of another format); fp32 in test-all
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_nonfinite_loss_raises_or_skips_with_no_update_on_every_program(precision):
    cases = [
        ("data-parallel", {"dp": 2, "tp": 1}, None, precision),
        ("sharded", {"tp": 2}, None, precision),
        ("pipeline", {"pp": 2, "num_microbatches": 2}, None, precision),
        ("offload", {"tp": 1}, True, precision),
    ]
    runs = run_distributed(_nonfinite_runs, 2, cases)
    for i, (kind, constraints, _, _) in enumerate(cases):
        for r in range(2):
            raised, skipped = runs[r][i]["raise"], runs[r][i]["skip"]
            assert raised["kind"] == kind, (kind, constraints)
            # every rank raises, naming the step; the step is neither applied nor counted
            assert raised["raised"] == 2 and "step 2" in raised["message"], (kind, r, raised)
            assert raised["unchanged"] and raised["num_steps"] == 1 and raised["trains"], (kind, r)
            assert raised["last"].step == 1 and not raised["last"].skipped
            # skip: nothing applied, the step counted as skipped, the next one trains
            assert skipped["raised"] is None and skipped["unchanged"] and skipped["trains"], (kind, r)
            assert skipped["last"].skipped and skipped["last"].skipped_steps == 1 and skipped["num_steps"] == 2


def _second_batch():
    """Another batch of the same shape with more padding: the two calls weigh differently by kept labels."""
    args, kwargs = make_batch("llama", seed=2)
    kwargs["labels"][:6, 4:] = -100
    return args, kwargs


def _accumulated_runs(rank: int, world_size: int, cases):
    out = []
    (a1, k1), (a2, k2) = make_batch("llama"), _second_batch()
    for _, constraints, offload in cases:
        pm = autopar.compile(
            make_model("llama"),
            f"cpu:{world_size}",
            a1,
            k1,
            optimizer=_sgd if not offload else _adamw,
            constraints=constraints,
            offload=offload,
        )
        first = pm.train_step(*a1, accumulate=True, **k1)
        held = pm.last_step
        pm.train_step(*a2, **k2)
        state = pm.state_dict()  # a collective: every rank gathers
        out.append(
            {
                "kind": str(pm.plan.program),
                "first": first,
                "held": held,
                "last": pm.last_step,
                "state": state if rank == 0 else None,
            }
        )
    return out


def test_accumulating_two_calls_is_one_step_over_their_rows():
    cases = [
        ("data-parallel", {"dp": 2, "tp": 1}, None),
        ("sharded", {"tp": 2}, None),
        ("sharded", {"dp": 2, "tp": 1, "zero": 2, "num_microbatches": 2}, None),
        ("pipeline", {"pp": 2, "num_microbatches": 2}, None),
        ("offload", {"tp": 1}, True),
    ]
    runs = run_distributed(_accumulated_runs, 2, cases)
    (a1, k1), (a2, k2) = make_batch("llama"), _second_batch()
    union = (torch.cat([a1[0], a2[0]]),), {"labels": torch.cat([k1["labels"], k2["labels"]])}
    for i, (kind, constraints, offload) in enumerate(cases):
        model = make_model("llama")
        opt = (_adamw if offload else _sgd)(model.parameters())
        loss = model(*union[0], **union[1]).loss
        loss.backward()
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
        got = runs[0][i]
        assert got["kind"] == kind, (kind, constraints)
        assert got["held"].grad_norm is None and got["held"].accumulated == 1 and got["held"].step == 0
        assert got["last"].accumulated == 2 and got["last"].step == 1
        assert got["last"].tokens == 2 * a1[0].numel()
        # the loss over every kept label of both calls, and the norm of their joint gradient (fp32 rounding)
        assert got["last"].loss == pytest.approx(float(loss.detach()), rel=1e-6), kind
        assert got["last"].grad_norm == pytest.approx(norm, rel=NORM_RTOL), kind
        for key, ref in model.state_dict().items():
            # SGD: rounding only. AdamW (offload) divides each gradient by its RMS, so rounding on a near-zero
            # gradient becomes an update difference: single elements differ by up to ~1.2e-5 after one step at
            # lr=1e-2 (seen), 1e-4 is 1% of lr, far below a wrong weighting (about lr on most elements)
            torch.testing.assert_close(
                got["state"][key],
                ref,
                atol=1e-4 if offload else PARAM_ATOL,
                rtol=0,
                msg=lambda m, k=key, c=kind: f"{c} {k}: {m}",
            )


def _fp16_runs(rank: int, world_size: int, cases):
    out = []
    args, kwargs = make_batch("llama")
    for _, constraints in cases:
        pm = autopar.compile(
            make_model("llama"),
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_sgd,
            constraints=constraints,
            precision="fp16",
            max_grad_norm=MAX_NORM,
        )
        # the scale starts at 2^16: a step whose fp16 gradients overflow is skipped (counted) until one goes through
        for _ in range(24):
            pm.train_step(*args, **kwargs)
            if not pm.last_step.skipped:
                break
        applied = pm.last_step
        # a scale already at its floor: a step still non-finite raises instead of halving it further
        pm.scaler.scale = 1.0
        undo = _poison(pm, float("inf"))
        try:
            pm.train_step(*args, **kwargs)
            raised = None
        except autopar.NonFiniteError as e:
            raised = (e.step, str(e))
        undo()
        out.append({"kind": str(pm.plan.program), "applied": applied, "raised": raised})
    return out


def test_fp16_clips_the_unscaled_norm_and_raises_once_the_scale_is_exhausted():
    cases = [("data-parallel", {"dp": 2, "tp": 1}), ("sharded", {"tp": 2})]
    runs = run_distributed(_fp16_runs, 2, cases)
    ref_norm = _reference("llama", _sgd, 1)[0][0]  # skipped steps leave the weights as they were
    for i, (kind, constraints) in enumerate(cases):
        for r in range(2):
            got = runs[r][i]
            assert got["kind"] == kind, (kind, constraints)
            applied = got["applied"]
            assert not applied.skipped and applied.clipped
            # fp16 gradients against fp32 ones: about 1e-3 apart; a norm left scaled would be 2^k times larger
            assert applied.grad_norm == pytest.approx(ref_norm, rel=2e-2), (kind, applied)
            step, message = got["raised"]
            assert step == applied.step + 1 and "loss scale down to 0.5" in message, message


class _Program:
    """What the guard's reduction reads of a program: where its tensors live and the gradient divisor."""

    device_type = "cpu"

    def _gradient_divisor(self) -> float:
        return 1.0


def _rank_1_never_joins_the_guard(rank: int, world_size: int):
    import os
    import time

    from autopar.errors import LoweringError
    from autopar.runtime.collectives import TIMEOUT_ENV
    from autopar.runtime.step_guard import StepGuard

    os.environ[TIMEOUT_ENV] = "2"
    if rank == 1:
        time.sleep(4)  # past rank 0's limit, well inside the world group's own (the harness's: gloo's 30 minutes)
        return None
    start = time.monotonic()
    try:
        StepGuard()._reduce(_Program(), [(torch.ones(3), 1)], 1.0)
    except LoweringError as e:
        return str(e), time.monotonic() - start
    return None


# slow: a fresh world and a wait (10 s); tests/distributed/test_stopped_rank.py stops a rank of each program kind
@pytest.mark.slow
def test_the_guards_all_reduce_waits_autopars_timeout_not_the_world_groups():
    message, waited = run_distributed(_rank_1_never_joins_the_guard, 2, fresh=True, timeout_s=120)[0]
    assert "rank 0 waited more than 2 s for the step guard's all-reduce" in message, message
    assert waited < 6  # 2 s and the error; the world group's own limit is 30 minutes

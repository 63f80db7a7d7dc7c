"""Every program kind on one base: mixed precision against a single-process mixed-precision reference,
fp32 masters and optimizer states, fp16 loss scaling, evaluation, and one trace beyond the planning one."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from tests.distributed.harness import for_this_run, run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
STEPS = 2
# The layouts of each program kind on 2 and 4 ranks (tiny LLaMA, handed in fp32).
CASES = {
    2: [
        ("data-parallel", {"dp": 2, "tp": 1}, None),
        ("sharded", {"tp": 2}, None),
        ("pipeline", {"pp": 2, "num_microbatches": 2}, None),
        ("offload", {"tp": 1}, True),
        # gradients all-reduced in bf16 (pinned) instead of fp32: bucketed, and in from_local's backward
        ("data-parallel", {"dp": 2, "tp": 1, "grad_reduce": "bf16"}, None),
        ("sharded", {"dp": 2, "tp": 1, "recompute": "full", "grad_reduce": "bf16"}, None),
    ],
    4: [
        ("data-parallel", {"dp": 4, "tp": 1}, None),
        ("sharded", {"tp": 2, "dp": 2, "zero": 0}, None),
        ("pipeline", {"pp": 2, "dp": 2, "num_microbatches": 2}, None),
        ("offload", {"tp": 1}, True),
    ],
}
# bf16 keeps 8 bits of mantissa: the reference and the program round differently wherever the order of a
# sum differs (rows split over ranks, a matmul split over tp, micro-batches accumulated), a few parts in a
# thousand per op on the loss. 2e-2 is that with margin; a missing reduction or a wrong scale moves the
# second step's loss by far more (tested: halving the gradients moves it by more than 5e-2).
BF16_LOSS_RTOL = 2e-2
# SGD's update is lr times the gradient: bf16 gradients differ by ~1% between the two runs, so after two
# steps the masters differ by about 1% of lr * |g|; 1e-3 absolute is 10% of lr, far below a wrong update.
BF16_PARAM_ATOL = 1e-3
# fp32 eval against the reference model in eval mode: only summation order differs.
EVAL_RTOL = 1e-5


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def mixed_reference(model, args, kwargs, make_opt, steps: int, dtype=torch.bfloat16):
    """Single-process mixed precision: a compute copy in `dtype`, fp32 masters updated by the optimizer."""
    compute = copy.deepcopy(model).to(dtype)
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    opt = make_opt(masters)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), masters, strict=True):
                c.copy_(m)
        compute.zero_grad(set_to_none=True)
        loss = compute(*args, **kwargs).loss
        loss.backward()
        for c, m in zip(compute.parameters(), masters, strict=True):
            m.grad = None if c.grad is None else c.grad.float()
        opt.step()
        losses.append(float(loss.detach()))
    names = [n for n, _ in model.named_parameters()]
    return losses, dict(zip(names, (m.detach() for m in masters), strict=True))


def _mixed_cases(rank: int, world_size: int, cases, opt_name: str):
    out = []
    for kind, constraints, offload in cases:
        model = make_model("llama")
        args, kwargs = make_batch("llama")
        make_opt = _sgd if opt_name == "sgd" else _adamw
        pm = autopar.compile(
            model,
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=make_opt,
            constraints=constraints,
            offload=offload,
            precision="bf16",
        )
        losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
        masters = [p.dtype for p in pm.parameters()]
        states = (
            [
                v.dtype
                for st in pm.optimizer.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim
            ]
            if kind != "offload"
            else [c.exp_avg.dtype for c in pm.store.chunks if c.exp_avg is not None]
        )
        state = pm.state_dict()
        out.append(
            {
                "kind": str(pm.plan.program),
                "losses": losses,
                "masters": masters,
                "states": states,
                "state": state if rank == 0 else None,
            }
        )
    return out


def _check_mixed(world_size: int, opt_name: str, cases=None) -> None:
    # the offload program runs AdamW over its chunks only
    cases = [c for c in cases or CASES[world_size] if opt_name == "adamw" or c[0] != "offload"]
    runs = run_distributed(_mixed_cases, world_size, cases, opt_name)
    make_opt = _sgd if opt_name == "sgd" else _adamw
    args, kwargs = make_batch("llama")
    ref_losses, ref_params = mixed_reference(make_model("llama"), args, kwargs, make_opt, STEPS)
    for i, (kind, constraints, _) in enumerate(cases):
        got = runs[0][i]
        assert got["kind"] == kind, (kind, constraints)
        assert set(got["masters"]) == {torch.float32}, (kind, got["masters"])  # fp32 masters on every rank
        for r in range(world_size):
            assert set(runs[r][i]["masters"]) == {torch.float32}
            assert runs[r][i]["states"] and set(runs[r][i]["states"]) == {torch.float32}, (kind, r)
        assert got["losses"] == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL), (kind, got["losses"], ref_losses)
        assert all(v.dtype == torch.float32 for v in got["state"].values() if v.is_floating_point())
        if opt_name == "sgd":
            for name, ref in ref_params.items():
                torch.testing.assert_close(
                    got["state"][name], ref, atol=BF16_PARAM_ATOL, rtol=0, msg=lambda m, k=name, c=kind: f"{c} {k}: {m}"
                )


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_every_program_matches_mixed_reference_sgd(world_size):
    _check_mixed(world_size, "sgd")


@pytest.mark.parametrize("world_size", [2])
def test_bf16_every_program_matches_mixed_reference_adamw(world_size):
    _check_mixed(world_size, "adamw")


@pytest.mark.parametrize("reduce_scatter", ["all_reduce", "native"])
def test_bf16_zero23_overlap_matches_mixed_reference(reduce_scatter, monkeypatch):
    """ZeRO-2/3 with overlap reduce-scatter each micro-batch's bf16 gradients (written into their bucket's bf16 send
    buffer) and add the pieces into fp32 shards: within the bf16 tolerances of the mixed reference. Over gloo
    both ways a reduce-scatter can run: as an all-reduce (the default there) and gloo's own (NCCL's path)."""
    monkeypatch.setenv("AUTOPAR_GLOO_REDUCE_SCATTER", reduce_scatter)  # the spawned ranks inherit it
    cases = [("sharded", {"dp": 2, "tp": 1, "zero": z, "num_microbatches": 2, "overlap": True}, None) for z in (2, 3)]
    _check_mixed(2, "sgd", cases)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_bf16_pipeline_zero1_once_a_step_matches_mixed_reference(opt_name):
    """ZeRO-1 stages with overlap gather each weight once a step in bf16, sum the micro-batches' bf16 gradients in
    fp32 and reduce-scatter the sums in bf16 (`runtime.pipeline`): within the bf16 tolerances of the mixed
    reference."""
    _check_mixed(4, opt_name, [("pipeline", {"pp": 2, "dp": 2, "zero": 1, "num_microbatches": 2}, None)])


def _fp16_skip(rank: int, world_size: int, constraints):
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    pm = autopar.compile(
        model, f"cpu:{world_size}", args, kwargs, optimizer=_sgd, constraints=constraints, precision="fp16"
    )
    scale0 = pm.scaler.scale
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    # a parameter holding inf makes its gradient (and the loss) non-finite: the step must be skipped
    with torch.no_grad():
        first = next(iter(pm.parameters()))
        saved = first.detach().clone()
        first.view(-1)[0] = float("inf")
    pm.train_step(*args, **kwargs)
    with torch.no_grad():
        first.copy_(saved)
    after_skip = pm.state_dict()
    skipped = pm.scaler.skipped_steps
    scale1 = pm.scaler.scale
    # the scale starts high (2^16) and fp16 gradients overflow under it: it halves until a step goes through
    for _ in range(24):
        seen = pm.scaler.skipped_steps
        loss = pm.train_step(*args, **kwargs)
        if pm.scaler.skipped_steps == seen:
            break
    after_step = pm.state_dict()
    changed = any(not torch.equal(after_step[k], before[k]) for k in before if before[k].is_floating_point())
    unchanged = all(torch.equal(after_skip[k], before[k]) for k in before)
    return {
        "scale0": scale0,
        "scale1": scale1,
        "skipped": skipped,
        "unchanged": unchanged,
        "changed": changed,
        "loss": loss,
    }


@pytest.mark.parametrize("constraints", [{"dp": 2, "tp": 1}, {"tp": 2}])
def test_fp16_loss_scaling_skips_a_step_with_an_inf_gradient(constraints):
    for got in run_distributed(_fp16_skip, 2, constraints):
        assert got["skipped"] == 1 and got["scale1"] == got["scale0"] / 2  # halved on overflow
        assert got["unchanged"], "a skipped step must leave every parameter as it was"
        assert got["changed"] and got["loss"] == got["loss"], "a later step trains (finite loss)"


def _eval_cases(rank: int, world_size: int, cases):
    out = []
    for _kind, constraints, offload in cases:
        model = make_model("llama")
        args, kwargs = make_batch("llama")
        pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, constraints=constraints, offload=offload)
        before = {k: v.clone() for k, v in pm.state_dict().items()}
        loss = pm.eval_step(*args, **kwargs)
        grads = [p.grad for p in pm.parameters() if getattr(p, "grad", None) is not None and p.grad.abs().sum() > 0]
        after = pm.state_dict()
        out.append(
            {
                "kind": str(pm.plan.program),
                "loss": loss,
                "grads": len(grads),
                "same": all(torch.equal(before[k], after[k]) for k in before),
            }
        )
    return out


def test_eval_step_of_every_program_is_the_models_eval_loss():
    cases = [c for c in CASES[2] if "grad_reduce" not in c[1]]  # fp32: no reduction format to pin
    runs = run_distributed(_eval_cases, 2, cases)
    model = make_model("llama").eval()
    args, kwargs = make_batch("llama")
    with torch.no_grad():
        ref = float(model(*args, **kwargs).loss)
    for i, (kind, _, _) in enumerate(cases):
        for r in range(2):
            got = runs[r][i]
            assert got["kind"] == kind
            assert got["loss"] == pytest.approx(ref, rel=EVAL_RTOL), (kind, r)
            assert got["grads"] == 0 and got["same"], kind


def _count_traces(rank: int, world_size: int, cases):
    import autopar.trace
    import autopar.tracing

    calls = []
    real = autopar.trace.trace_model

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    autopar.tracing.trace_model = counting
    out = []
    try:
        for constraints in cases:
            calls.clear()
            model = make_model("llama")
            args, kwargs = make_batch("llama")
            pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, constraints=constraints)
            # a pipeline runs the placements its stages were priced with (compile solves none again)
            staged = bool(pm.plan.stage_plans) and all(st.node_output for st in pm.plan.stage_plans)
            out.append((str(pm.plan.program), len(calls), staged and not pm.plan.node_output))
    finally:
        autopar.tracing.trace_model = real
    return out


def test_compile_traces_at_most_once_beyond_planning():
    cases = [{"dp": 2, "tp": 1}, {"tp": 2}, {"tp": 2, "num_microbatches": 2}, {"pp": 2, "num_microbatches": 2}]
    got = run_distributed(_count_traces, 2, cases)[0]
    assert [kind for kind, _, _ in got] == ["data-parallel", "sharded", "sharded", "pipeline"]
    # the planning trace, then one at the program's shape; the sharded program at one micro-batch reuses it
    assert [n for _, n, _ in got] == [2, 1, 2, 2]
    assert [staged for _, _, staged in got] == [False, False, False, True]


def _overlap_order(rank: int, world_size: int, overlap: bool = True):
    import autopar.runtime.data_parallel as dp_program

    for_this_run(dp_program, "BUCKET_BYTES", 16 * 1024)  # several buckets for a tiny model
    events = []
    real = torch.distributed.all_reduce

    def recording(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel()))
        return real(tensor, *args, **kwargs)

    model = make_model("llama")
    args, kwargs = make_batch("llama")
    constraints = {"dp": 2, "tp": 1, "overlap": overlap}
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, constraints=constraints)
    names = list(pm.traced.param_names)
    first = pm.params[names.index("model.embed_tokens.weight")]  # its gradient comes last in backward
    first.register_post_accumulate_grad_hook(lambda p: events.append(("embedding grad", 0)))
    early = pm.params[names.index("model.layers.0.self_attn.q_proj.weight")]  # the first layer's, late in backward
    early.register_post_accumulate_grad_hook(lambda p: events.append(("first layer grad", 0)))
    torch.distributed.all_reduce = recording
    try:
        loss = pm.train_step(*args, **kwargs)
    finally:
        torch.distributed.all_reduce = real
    return {"events": events, "buckets": len(pm._buckets), "loss": loss, "launched": list(pm._launched)}


def _bucket_reductions_before(events: list, gradient: str) -> int:
    """How many bucket all-reduces (every all-reduce after the first, which sums the loss and label count) were
    issued before the test's hook on `gradient` ran."""
    last = [kind for kind, _ in events].index(gradient)
    return sum(kind == "all_reduce" for kind, _ in events[1:last])


def test_data_parallel_buckets_are_reduced_while_backward_runs():
    """Buckets are issued before the first layer's gradients exist, and every bucket by the time the embedding's
    gradient (the last of backward) is in: the program's hook on it, registered before the test's, launches the
    last bucket; one all-reduce per bucket, one of the loss sum and label count (first, before the last backward) and
    the step guard's (last, after the buckets: `runtime.step_guard`). With
    overlap off (the contrast that makes the order mean something) no bucket goes out before backward ends."""
    on, off = run_distributed(_overlap_order, 2)[0], run_distributed(_overlap_order, 2, False)[0]
    for got in on, off:
        kinds = [kind for kind, _ in got["events"]]
        assert got["buckets"] > 2
        assert kinds.count("all_reduce") == got["buckets"] + 2
        assert got["events"][0] == ("all_reduce", 2)  # the totals
        assert got["events"][-1] == ("all_reduce", 3)  # the step guard's: norm, non-finite flag, tokens
    assert _bucket_reductions_before(on["events"], "embedding grad") == on["buckets"], on["events"]
    # buckets of the layers after the first went out while the first layer's backward was still to run
    assert 0 < _bucket_reductions_before(on["events"], "first layer grad") < on["buckets"], on["events"]
    assert _bucket_reductions_before(off["events"], "embedding grad") == 0, off["events"]
    # the buckets follow the order backward completes gradients (read from the graph): each one fills, and is
    # launched, before the next, so none waits on a gradient that comes after the next bucket's
    assert on["launched"] == list(range(on["buckets"]))
    assert on["loss"] == off["loss"]


def test_bf16_zero1_column_parallel_on_dp2_tp2():
    """Column-parallel q/k/v (split on dim 0 over tp) with ZeRO-1: the data axis shards those weights on another
    dim (dim 0 on both axes made DTensor's gather for the matmul give wrong local shapes)."""
    columns = {f"model.layers.{i}.self_attn.{m}_proj.weight": "S(0)" for i in range(2) for m in "qkv"}
    _check_mixed(4, "sgd", [("sharded", {"tp": 2, "dp": 2, "zero": 1, "param_placements": columns}, None)])

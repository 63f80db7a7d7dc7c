"""The sharded program's overlap: gradient buckets reduced while backward runs, with the single-process numerics.

Two gloo ranks, the tiny LLaMA on a data axis of 2: ZeRO-0 (run on DTensors by full recompute), 1, 2 and 3.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
# fp32 on CPU: the program sums gradients over two ranks in another order than one process does, ~1e-7
# relative on the loss; a missing or doubled reduction moves the second step's loss by ~1e-2.
LOSS_RTOL = 1e-5
# Parameters after two steps: SGD moves them by lr * grad (~1e-3), so rounding-level gradient differences give
# ~1e-9; AdamW turns rounding on a near-zero gradient into up to ~lr / 100 (see test_train_numerics, eps 1e-6).
# A wrong reduction (unsummed, or summed twice) moves most elements by ~lr.
SGD_ATOL, ADAMW_ATOL = 1e-6, 1e-4
ADAM_EPS = 1e-6
# ZeRO-2 and 3 overlap only where pinned ("overlap": True: their overlapping runtime holds whole gradients)
ZERO = [{"dp": 2, "tp": 1, "zero": 0, "recompute": "full"}, {"dp": 2, "tp": 1, "zero": 1},
        {"dp": 2, "tp": 1, "zero": 2, "num_microbatches": 2, "overlap": True},
        {"dp": 2, "tp": 1, "zero": 3, "overlap": True},
        {"dp": 2, "tp": 1, "zero": 0, "recompute": "full", "num_microbatches": 2}]  # fmt: skip


def _optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _train(rank: int, world_size: int, cases, opt: str):
    out = []
    for constraints in cases:
        model = make_model("llama")
        args, kwargs = make_batch("llama")
        pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=_optimizer(opt),
                             constraints=constraints)  # fmt: skip
        losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
        state = pm.state_dict()  # every rank gathers
        out.append({"program": str(pm.plan.program), "zero": pm.plan.zero_stage, "overlap": pm.overlap,
                    "losses": losses, "state": state if rank == 0 else None})  # fmt: skip
    return out


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_overlapped_zero_stages_match_single_process(opt):
    got = run_distributed(_train, 2, ZERO, opt)[0]
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    ref_losses, ref_state = train_locally(model, args, kwargs, _optimizer(opt)(model.parameters()), 2)
    atol = SGD_ATOL if opt == "sgd" else ADAMW_ATOL
    for constraints, run in zip(ZERO, got, strict=True):
        assert run["program"] == "sharded" and run["zero"] == constraints["zero"] and run["overlap"], constraints
        assert run["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (constraints, run["losses"], ref_losses)
        for key, ref in ref_state.items():
            torch.testing.assert_close(run["state"][key], ref, atol=atol, rtol=0,
                                       msg=lambda m, k=key, c=constraints: f"{c} {k}: {m}")  # fmt: skip


def _events(rank: int, world_size: int, constraints, bucket_bytes: int):
    import torch.distributed as dist

    import autopar.runtime.overlap as overlap

    overlap.BUCKET_BYTES = bucket_bytes
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, constraints=constraints)
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return real[name](*a, **k)

        return call

    pm.train_step(*args, **kwargs)  # a first step: every count below is of a later one
    pm.comm_events = []
    for name in real:
        setattr(dist, name, counting(name))
    try:
        pm.train_step(*args, **kwargs)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    trainable = sum(p.requires_grad for p in model.parameters())
    return {"events": pm.comm_events, "calls": calls, "trainable": trainable, "overlap": pm.overlap}


@pytest.mark.parametrize("constraints", [ZERO[0], ZERO[3]], ids=["zero0", "zero3"])
def test_first_bucket_is_reduced_before_backward_reaches_the_first_layer(constraints):
    """With one parameter per bucket, the first reduction goes out before the embedding's gradient (the last
    that backward produces) exists, and the step issues exactly one collective per bucket (every trainable
    parameter); with one bucket for all, exactly one, after the embedding's gradient."""
    kind = "all_reduce" if constraints["zero"] == 0 else "reduce_scatter"
    small, whole = (run_distributed(_events, 2, constraints, size)[0] for size in (1, 2**40))
    for got in (small, whole):
        events = got["events"]
        assert got["overlap"]
        assert events[-1][0] == "wait"  # the step waits once, after issuing every bucket
        reductions = [i for i, (event, _) in enumerate(events) if event == kind]
        embedding = events.index(("grad", "model.embed_tokens.weight"))
        assert [e for e, _ in events].count(kind) == len(reductions)
        assert got["calls"] == [("reduce_scatter_single" if kind == "reduce_scatter" else kind)] * len(reductions)
        if got is small:
            assert len(reductions) == got["trainable"]
            assert reductions[0] < embedding < reductions[-1], events
        else:
            assert len(reductions) == 1 and reductions[0] > embedding, events


def test_overlap_off_keeps_the_synchronous_path():
    """`overlap: False`: no bucket, no deferred gather: the reductions run inside DTensor's redistributions."""
    got = run_distributed(_events, 2, {**ZERO[3], "overlap": False}, 1)[0]
    assert not got["overlap"] and got["events"] == [] and got["calls"] == []


def _gathers(rank: int, world_size: int, cases):
    import torch.distributed as dist

    out = []
    calls = []
    real = dist.all_gather_single

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    for constraints in cases:
        model = make_model("llama")
        args, kwargs = make_batch("llama")
        pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, constraints=constraints)
        first = pm.train_step(*args, **kwargs)
        calls.clear()
        pm.comm_events = []
        dist.all_gather_single = counting
        try:
            pm.train_step(*args, **kwargs)
        finally:
            dist.all_gather_single = real
        out.append({"events": pm.comm_events, "gathers": len(calls), "depth": pm.plan.prefetch_depth, "loss": first})
    return out


def _issued(events, layer: int, start: int = 0) -> int:
    """Index of the first gather of layer `layer`'s parameters issued at or after `start` (ahead or on demand)."""
    prefix = f"model.layers.{layer}."
    return next(k for k, (e, name) in enumerate(events) if k >= start and e in ("gather", "prefetch")
                and name.startswith(prefix))  # fmt: skip


def test_zero3_gathers_the_next_layer_while_the_current_one_computes():
    """Depth 1: layer 1's gathers go out before layer 0's last weight (its MLP down projection) is handed to its
    op, so they overlap layer 0's compute; depth 0 gathers layer by layer. Under full recompute the backward
    gathers layer 0 ahead while layer 1 is recomputed. The number of gathers per step is the same at every
    depth, one per gathered weight handed to an op, and so is the loss."""
    last = ("gathered", "model.layers.0.mlp.down_proj.weight")
    cases = [{"dp": 2, "tp": 1, "zero": 3, "prefetch_depth": d, "overlap": True} for d in (0, 1)]
    cases.append({"dp": 2, "tp": 1, "zero": 3, "recompute": "full", "overlap": True})
    on_demand, ahead, recomputed = run_distributed(_gathers, 2, cases)[0]
    assert (on_demand["depth"], ahead["depth"], recomputed["depth"]) == (0, 1, 1)
    assert "prefetch" not in [e for e, _ in on_demand["events"]]
    assert _issued(on_demand["events"], 1) > on_demand["events"].index(last), on_demand["events"]
    assert _issued(ahead["events"], 1) < ahead["events"].index(last), ahead["events"]
    for got in (on_demand, ahead, recomputed):
        assert got["gathers"] == [e for e, _ in got["events"]].count("gathered") > 0
    assert ahead["gathers"] == on_demand["gathers"]
    assert ahead["loss"] == on_demand["loss"]  # the same gathers, earlier: bit for bit the same step
    # backward: layer 1 is recomputed first (its weights gathered again), and layer 0's gathers go out before
    # layer 1's recompute hands its last weight over
    events = recomputed["events"]
    backward = next(k for k, (e, _) in enumerate(events) if e == "grad")
    second = events.index(("gathered", "model.layers.1.mlp.down_proj.weight"), backward)
    assert _issued(events, 0, backward) < second, events


def test_zero3_overlaps_only_where_pinned():
    """Unpinned, a ZeRO-2/3 plan runs the synchronous path (the overlapping one holds every split parameter's whole
    fp32 gradient until the last bucket): the plan says so, and its price counts no such gradients."""
    from tests.models import make_batch, make_model

    model = make_model("llama")
    args, kwargs = make_batch("llama")
    plain = autopar.plan(model, "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1, "zero": 3}, alternatives=False)
    pinned = autopar.plan(model, "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1, "zero": 3, "overlap": True},
                          alternatives=False)  # fmt: skip
    assert not plain.overlap and plain.prefetch_depth == 0 and pinned.overlap and pinned.prefetch_depth == 1
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # whole fp32 gradients on each rank with overlap, a half of them without (dp=2 splits them)
    assert pinned.predicted.memory_breakdown["grads"] >= 4 * trainable * 0.99
    assert plain.predicted.memory_breakdown["grads"] <= 4 * trainable / 2 * 1.01

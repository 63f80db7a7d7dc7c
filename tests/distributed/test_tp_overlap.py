"""Tensor-axis collectives launched early: a value whose first consumer is not the very next op is
redistributed where it is made, without waiting, and waited for by the op that reads it.

The model is a stack of parallel blocks (GPT-J / PaLM style: x + mlp(norm(x)) + attention(norm(x))): the
MLP's row-parallel down projection ends in a partial sum whose consumer, the residual add, comes only after
the whole attention branch. On cpu:2 with tp pinned to 2, hooks record the interpreter's ops and each functional
collective's launch and wait; the test checks that ops run between the attention's all-reduce and its wait,
that none do with early launch turned off (so the check can fail), that both runs launch the same
collectives, and that training matches one process. The plan's `overlap` turns early launch off (the same
layout run both ways).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from tests.distributed.harness import for_this_run, run_distributed

pytestmark = pytest.mark.distributed

HIDDEN, HEADS, SEQ, BATCH = 256, 4, 16, 4


class ParallelBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm(x)
        mlp = self.down(nn.functional.gelu(self.up(y)))
        q, k, v = (f(y).view(b, s, HEADS, h // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        attn = self.proj(
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        )
        return x + mlp + attn


class ParallelStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ParallelBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def _model():
    torch.manual_seed(0)
    return ParallelStack()


def _batch():
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)),)


def _record(rank: int, world: int, early: bool):
    import torch.distributed._functional_collectives as funcol

    from autopar.passes.parallelize import ShardedInterpreter

    events = []
    run_op = ShardedInterpreter._run_op

    def recorded_op(self, n):
        events.append(("op", n.name))
        return run_op(self, n)

    for_this_run(ShardedInterpreter, "_run_op", recorded_op)
    for name in (
        "all_reduce",
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_tensor",
        "reduce_scatter_tensor",
    ):
        launch = getattr(funcol, name)

        def launched(*a, _launch=launch, _name=name, **k):
            out = _launch(*a, **k)
            events.append(("launch", _name, id(getattr(out, "elem", out))))
            if not isinstance(out, funcol.AsyncCollectiveTensor):  # done when it returns
                events.append(("wait", id(out)))
            return out

        for_this_run(funcol, name, launched)
    wait = funcol.wait_tensor

    def waited(t):
        events.append(("wait", id(t)))
        return wait(t)

    for_this_run(funcol, "wait_tensor", waited)
    args = _batch()
    plan = autopar.plan(_model(), f"cpu:{world}", args, constraints={"tp": 2, "dp": 1})
    # one layout, launched early or not by the plan's overlap (`"overlap": False` waits where a value is read)
    pm = autopar.compile(
        _model(),
        f"cpu:{world}",
        args,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2),
        plan=dataclasses.replace(plan, overlap=early),
    )
    losses = []
    for _ in range(2):
        events.clear()
        with torch.no_grad():
            pm.eval_step(*args)  # forward only: the ops between a launch and its wait are the forward's
        forward = list(events)
        losses.append(pm.train_step(*args))
    state = pm.state_dict()
    return {"forward": forward, "losses": losses, "state": state if rank == 0 else None}


def _ops_in_flight(events) -> list[tuple[str, int]]:
    """(collective, number of ops run between its launch and its wait) for each collective launched."""
    out = []
    for i, e in enumerate(events):
        if e[0] != "launch":
            continue
        j = next((j for j in range(i + 1, len(events)) if events[j] == ("wait", e[2])), len(events))
        out.append((e[1], sum(1 for x in events[i + 1 : j] if x[0] == "op")))
    return out


def test_parallel_block_all_reduce_runs_while_the_attention_branch_computes():
    early = run_distributed(_record, 2, True, timeout_s=600)[0]
    late = run_distributed(_record, 2, False, timeout_s=600)[0]
    in_flight, waited = _ops_in_flight(early["forward"]), _ops_in_flight(late["forward"])
    # the same collectives (the early one now launched before the attention's weight gathers)
    assert sorted(c for c, _ in in_flight) == sorted(c for c, _ in waited)
    assert all(n == 0 for _, n in waited), waited
    # each layer's MLP all-reduce is waited for only after the attention branch's projections ran
    assert sum(1 for _, n in in_flight if n >= 3) >= 2, in_flight
    # the same collectives on the same values: the same numbers, to the bit
    assert early["losses"] == late["losses"]
    for name, ref in late["state"].items():
        assert torch.equal(early["state"][name], ref), name
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref = []
    for _ in range(2):
        loss = model(*_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    # fp32, sums over two tensor-axis ranks in another order than one process: rounding-level differences
    assert early["losses"] == pytest.approx(ref, rel=1e-5)

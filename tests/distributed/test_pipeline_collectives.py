"""Pipelines never hang: export's metadata assertions place no parameter on a stage, every rank of a group
calls its collectives in the same order, and a rank that waits too long for a collective (the tie sums, the dp
reduction the schedule launched) raises an autopar error naming what it waited for. (The transfer and collective
counts per step, with overlap and without, are in test_pipeline_overlap.py.)

Gemma-2's RMSNorm reads its weight with `.float()`, and export asserts the weight's dtype
(`aten._assert_tensor_metadata`), a node with no inputs from the graph that the stage split used to put on
stage 0: the final norm's weight then counted as held by both stages, and only the last stage (the one with
its gradient) called the all-reduce tying the copies.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import ConfigError, LoweringError
from autopar.runtime.collectives import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout, waiting_for
from tests.distributed.harness import run_distributed
from tests.families import family_batch, make_family
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
# fp32 on CPU, two stages on two ranks: the pipeline computes every value the reference does, in the same order
# within an op; only the loss's sum over two micro-batches is split differently (~1e-7 relative)
LOSS_RTOL = 1e-5


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _gemma2_pp2(rank: int, world_size: int):
    model = make_family("gemma2")
    args, kwargs = family_batch("gemma2")
    pm = autopar.compile(
        model,
        f"cpu:{world_size}",
        args,
        kwargs,
        optimizer=_sgd,
        constraints={"pp": 2, "dp": 1, "tp": 1, "num_microbatches": 2},
    )
    losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
    return {
        "losses": losses,
        "program": str(pm.plan.program),
        "params": list(pm._param_names),
        "ties": [t[0] for t in pm._tie_groups],
    }


def test_gemma2_pipeline_does_not_hold_the_asserted_norm_weight_on_stage_0():
    got = run_distributed(_gemma2_pp2, 2, timeout_s=240)
    assert got[0]["program"] == "pipeline"
    assert "model.norm.weight" not in got[0]["params"]  # stage 0 runs no op that reads it
    assert "model.norm.weight" in got[1]["params"]
    model = make_family("gemma2")
    args, kwargs = family_batch("gemma2")
    ref, _ = train_locally(model, args, kwargs, _sgd(model.parameters()), 2)
    for res in got:
        assert res["losses"] == pytest.approx(ref, rel=LOSS_RTOL)


class DetachedScale(nn.Module):
    """Stage 0 reads `scale` detached (no gradient there), the last stage reads it with one: a parameter held
    on two stages whose first copy gets no gradient from its stage."""

    def __init__(self, hidden: int = 16, num_layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, hidden)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, target):
        h = self.inp(x) * self.scale.detach()
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return (nn.functional.mse_loss(self.out(h * self.scale).squeeze(-1), target),)


def _detached_model_and_batch():
    torch.manual_seed(0)
    model = DetachedScale()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(8, 8, generator=g), torch.randn(8, generator=g))


def _detached_pp2(rank: int, world_size: int):
    model, args = _detached_model_and_batch()
    pm = autopar.compile(
        model,
        f"cpu:{world_size}",
        args,
        {},
        optimizer=_sgd,
        constraints={"pp": 2, "dp": 1, "tp": 1, "num_microbatches": 2},
    )
    losses = [pm.train_step(*args) for _ in range(3)]
    return {"losses": losses, "ties": [t[0] for t in pm._tie_groups], "scale": pm._shard["scale"].detach().clone()}


def test_a_tied_copy_without_a_gradient_joins_the_sum_with_zeros():
    got = run_distributed(_detached_pp2, 2, timeout_s=240)
    assert got[0]["ties"] == got[1]["ties"] == [["scale"]]
    model, args = _detached_model_and_batch()
    ref, state = train_locally(model, args, {}, _sgd(model.parameters()), 3)
    for res in got:
        assert res["losses"] == pytest.approx(ref, rel=LOSS_RTOL)
        # both copies took the step of the one gradient (momentum included), so they stay equal
        torch.testing.assert_close(res["scale"], state["scale"], rtol=1e-5, atol=1e-6)


TIMEOUT_S = 5


def _train_step_error(pm, args, kwargs) -> tuple[str, str] | None:
    """(kind, message) of the error one train_step raised, None when it ran through (the outcome under test)."""
    try:
        pm.train_step(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _rank0_skips_the_tie(rank: int, world_size: int):
    os.environ[TIMEOUT_ENV] = str(TIMEOUT_S)
    model = make_model("gpt2")  # its token embedding, tied to the LM head, is held on both stages
    args, kwargs = make_batch("gpt2")
    pm = autopar.compile(
        model,
        f"cpu:{world_size}",
        args,
        kwargs,
        optimizer=_sgd,
        constraints={"pp": 2, "dp": 1, "tp": 1, "num_microbatches": 2},
    )
    if rank == 0:
        pm._sum_tied = lambda: None  # the bug under test: one rank skips a collective
    start = time.monotonic()
    error = _train_step_error(pm, args, kwargs)
    if rank == 0:  # stay alive past rank 1's wait: a rank that exits closes its connections (another error)
        time.sleep(TIMEOUT_S + 5)
    return {"error": error, "elapsed": time.monotonic() - start}


def test_a_rank_that_skips_a_collective_gets_an_autopar_error_within_the_timeout():
    rank0, rank1 = run_distributed(_rank0_skips_the_tie, 2, timeout_s=180, fresh=True)
    # rank 0 skipped the tie and went on to the step's last collective (the step guard's all-reduce), which
    # rank 1, held at the tie, never joins: rank 0 may end in that wait or see rank 1's connection close, but
    # never in the tie it skipped
    assert rank0["error"] is None or "tying" not in rank0["error"][1], rank0["error"]
    kind, message = rank1["error"]
    assert kind == "LoweringError"
    assert (
        "waited more than 5 s for the all-reduce tying transformer.wte.weight over the stages of pp ranks [0, 1]"
        in message
    ), message
    assert TIMEOUT_ENV in message
    # the timeout plus one step of a tiny model (a second at most on a loaded 2-core machine)
    assert rank1["elapsed"] < TIMEOUT_S + 10


@pytest.mark.parametrize("raw", ["0", "-3", "soon"])
def test_a_bad_timeout_is_refused(monkeypatch, raw):
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ConfigError, match=TIMEOUT_ENV):
        collective_timeout()


def test_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout() == timedelta(seconds=DEFAULT_TIMEOUT_S)
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert collective_timeout() == timedelta(seconds=2.5)


def test_only_a_timeout_becomes_an_autopar_error():
    with pytest.raises(LoweringError, match="waited more than .* for the thing"):
        with waiting_for("the thing"):
            raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")
    with pytest.raises(RuntimeError, match="unrelated"):
        with waiting_for("the thing"):
            raise RuntimeError("unrelated")


def _rank0_skips_the_dp_reduction(rank: int, world_size: int):
    os.environ[TIMEOUT_ENV] = str(TIMEOUT_S)
    model = make_model("gpt2")
    args, kwargs = make_batch("gpt2")
    pm = autopar.compile(
        model,
        f"cpu:{world_size}",
        args,
        kwargs,
        optimizer=_sgd,
        constraints={"pp": 2, "dp": 2, "tp": 1, "num_microbatches": 2},
    )
    assert pm.plan.overlap  # the reduction launched from the schedule, waited on after it
    if rank == 0:  # the bug under test: stage block 0's first dp rank never reduces
        pm._launch_bucket = lambda b: None
    start = time.monotonic()
    error = _train_step_error(pm, args, kwargs)
    elapsed = time.monotonic() - start
    time.sleep(TIMEOUT_S + 5)  # stay alive past the others' waits (an exit closes connections: another error)
    return {"error": error, "elapsed": elapsed}


@pytest.mark.slow
def test_a_dp_reduction_one_rank_skips_is_named_in_its_peers_error():
    got = run_distributed(_rank0_skips_the_dp_reduction, 4, timeout_s=240, fresh=True)
    kind, message = got[1]["error"]  # rank 1: rank 0's dp peer in stage block 0
    assert kind == "LoweringError"
    assert (
        f"waited more than {TIMEOUT_S} s for the all-reduce of the dp-replicated gradients of stage block 0 "
        "over the data axis"
    ) in message, message
    # the timeout plus one step of a tiny model on four ranks sharing two cores (a few seconds at most)
    assert got[1]["elapsed"] < TIMEOUT_S + 15

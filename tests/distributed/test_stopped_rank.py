"""A stopped rank (SIGSTOP) for every program kind: its peer's step fails after `AUTOPAR_COLLECTIVE_TIMEOUT_S`
with the autopar error naming what it waited for (the data-parallel program's step divisor included), instead of a
raw backend error or a wait of the backend's default 30 minutes."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.collectives import TIMEOUT_ENV
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10  # short, so the test waits little; long enough that a loaded machine's ordinary step never hits it
# program kind -> (constraints, offload, what the waiting rank's error names)
KINDS = {
    "data-parallel": ({"dp": 2, "tp": 1}, None, "the all-reduce of the loss and label count over the data axis"),
    "sharded": ({"tp": 2}, None, "a collective of the sharded forward or backward"),
    "pipeline": ({"pp": 2, "num_microbatches": 2}, None, "the pipeline schedule of stage(s) [0]"),
    "offload": ({"tp": 1}, True, "a chunk's all-gather of its weights or reduce-scatter of its gradients"),
}


def _stop_rank_1(rank: int, world: int, kind: str):
    os.environ[TIMEOUT_ENV] = str(TIMEOUT_S)  # before compile: the program's groups take it when made
    constraints, offload, _ = KINDS[kind]
    args, kwargs = make_batch("llama")
    # the offload program runs AdamW over its chunks; the others take SGD
    optimizer = None if offload else (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9))
    pm = autopar.compile(
        make_model("llama"), f"cpu:{world}", args, kwargs, optimizer=optimizer, constraints=constraints, offload=offload
    )
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()  # both ranks start the step together: only the stop below makes a rank wait
    pm.train_step(*args, **kwargs)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT once its step has failed
    try:
        pm.train_step(*args, **kwargs)
        error = None
    except Exception as e:  # rank 1, let go, finds its peer gone: any error will do
        error = f"{type(e).__name__}: {e}"
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return {"program": str(pm.plan.program), "error": error}


# all slow: each spawns a world of its own and waits out the timeout (35 s on a busy 2-core machine). `make test` keeps
# a peer's wait turned into the autopar error naming its collective in
# tests/distributed/test_pipeline_collectives.py::test_a_rank_that_skips_a_collective_gets_an_autopar_error_within_the_timeout
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_stopped_rank_is_named_in_its_peers_error(kind):
    got = run_distributed(_stop_rank_1, 2, kind, timeout_s=900, fresh=True)[0]  # a stopped rank: not the pool
    assert got["program"] == kind, got
    words = f"LoweringError: rank 0 waited more than {TIMEOUT_S:g} s for {KINDS[kind][2]}"
    assert got["error"] is not None and got["error"].startswith(words), got["error"]

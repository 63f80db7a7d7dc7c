"""The test harness: a run whose ranks hang fails within its time limit, naming the rank that did not finish."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankTimeoutError, run_distributed

pytestmark = pytest.mark.distributed


def _rank0_skips_the_all_reduce(rank: int, world_size: int):
    del world_size
    if rank == 1:  # rank 0 never joins: without a bound this waits for gloo's 30 minutes
        dist.all_reduce(torch.ones(1))
    else:  # busy elsewhere (had it exited, its closed connection would fail rank 1 at once)
        time.sleep(120)
    return rank


def _sums(rank: int, world_size: int):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t), world_size


def test_hang_fails_naming_the_rank_within_the_limit():
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        # 30 s: both spawned interpreters must be up (and rank 1 in its all-reduce) on a loaded 2-core machine
        run_distributed(_rank0_skips_the_all_reduce, 2, timeout_s=30)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank(s) [0, 1] did not finish within 30 s (finished: none)" in message
    rank0, rank1 = message.split("rank 0 was at")[1].split("rank 1 was at")
    assert "_rank0_skips_the_all_reduce" in rank0 and "distributed_c10d" not in rank0
    # the stuck rank's stack shows the collective it waited in
    assert 'distributed_c10d.py", line' in rank1 and "in all_reduce" in rank1
    # the limit, the stack request and the start-up of two spawned interpreters (a few seconds each on 2 cores)
    assert elapsed < 30 + 40, elapsed


def test_finished_run_returns_every_rank():
    assert run_distributed(_sums, 2) == [(1.0, 2), (1.0, 2)]

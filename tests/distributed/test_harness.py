"""The test harness: a run whose ranks hang fails within its time limit, naming the rank that did not finish; the
pool of ranks runs test after test on the same processes, and a hung, failed or patched run leaves none behind."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import autopar.runtime.data_parallel as dp_program
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


def _who(rank: int, world_size: int, name: str):
    """This rank's process id, the variable `name` of its environment, and its first random draw."""
    del rank, world_size
    return os.getpid(), os.environ.get(name), float(torch.rand(()))


def _rank1_raises_while_rank0_waits(rank: int, world_size: int):
    del world_size
    if rank == 1:
        raise ValueError("rank 1 found a wrong shape")
    dist.all_reduce(torch.ones(1))  # never matched: rank 0 waits here until the pool is stopped


def _patches_a_constant(rank: int, world_size: int):
    del rank, world_size
    dp_program.BUCKET_BYTES = 1024


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` whose process still runs (the pool joins the ranks it stops: none is left a zombie)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _stuck_message_checks(message: str, limit: int) -> None:
    assert f"rank(s) [0, 1] did not finish within {limit} s (finished: none)" in message
    rank0, rank1 = message.split("rank 0 was at")[1].split("rank 1 was at")
    assert "_rank0_skips_the_all_reduce" in rank0 and "distributed_c10d" not in rank0
    # the stuck rank's stack shows the collective it waited in
    assert 'distributed_c10d.py", line' in rank1 and "in all_reduce" in rank1


@pytest.mark.slow
def test_hang_fails_naming_the_rank_within_the_limit():
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        # 30 s: both spawned interpreters must be up (and rank 1 in its all-reduce) on a loaded 2-core machine
        run_distributed(_rank0_skips_the_all_reduce, 2, timeout_s=30, fresh=True)
    elapsed = time.monotonic() - start
    _stuck_message_checks(str(info.value), 30)
    # the limit, the stack request and the start-up of two spawned interpreters (a few seconds each on 2 cores)
    assert elapsed < 30 + 40, elapsed


def test_finished_run_returns_every_rank():
    assert run_distributed(_sums, 2, fresh=True) == [(1.0, 2), (1.0, 2)]
    assert run_distributed(_sums, 2) == [(1.0, 2), (1.0, 2)]


def test_pool_runs_each_call_on_the_same_ranks_as_a_fresh_rank_would(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TEST_MARK", "one")
    first = run_distributed(_who, 2, "AUTOPAR_TEST_MARK")
    monkeypatch.setenv("AUTOPAR_TEST_MARK", "two")
    second = run_distributed(_who, 2, "AUTOPAR_TEST_MARK")
    assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]  # spawned once
    assert [mark for _, mark, _ in first] == ["one", "one"] and [mark for _, mark, _ in second] == ["two", "two"]
    # each call starts from the random state the rank started with: the same first draw, run after run
    assert [draw for _, _, draw in first] == [draw for _, _, draw in second]


def test_pool_hang_fails_naming_the_rank_and_the_next_call_gets_new_ranks():
    before = [pid for pid, _, _ in run_distributed(_who, 2, "HOME")]  # the pool is up: the limit is the task's
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        # 10 s: the ranks are up, rank 1 reaches its all-reduce within a second of the task's arrival
        run_distributed(_rank0_skips_the_all_reduce, 2, timeout_s=10)
    elapsed = time.monotonic() - start
    _stuck_message_checks(str(info.value), 10)
    assert elapsed < 10 + 15, elapsed  # the limit, the stack request (2 s), stopping the ranks
    assert not _alive(before)
    after = run_distributed(_who, 2, "HOME")
    assert not set(before) & {pid for pid, _, _ in after}
    assert run_distributed(_sums, 2) == [(1.0, 2), (1.0, 2)]


# `make test-all`, as the next one: the pool stopped after a failed or a patching run (`make test`: after a hang)
@pytest.mark.slow
def test_pool_rank_failure_fails_with_its_traceback_and_the_next_call_gets_new_ranks():
    before = [pid for pid, _, _ in run_distributed(_who, 2, "HOME")]
    with pytest.raises(AssertionError, match="rank 1 failed: ValueError: rank 1 found a wrong shape") as info:
        run_distributed(_rank1_raises_while_rank0_waits, 2, timeout_s=60)
    assert "in _rank1_raises_while_rank0_waits" in str(info.value)  # the rank's traceback
    assert not _alive(before)  # stopped, not left waiting in the all-reduce
    after = run_distributed(_who, 2, "HOME")
    assert not set(before) & {pid for pid, _, _ in after}


@pytest.mark.slow
def test_pool_refuses_a_run_that_leaves_a_patch_behind():
    before = [pid for pid, _, _ in run_distributed(_who, 2, "HOME")]
    with pytest.raises(AssertionError, match="autopar.runtime.data_parallel.BUCKET_BYTES"):
        run_distributed(_patches_a_constant, 2)
    assert not _alive(before)
    after = run_distributed(_who, 2, "HOME")
    assert not set(before) & {pid for pid, _, _ in after}

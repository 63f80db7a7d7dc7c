"""`autopar.bench.noop_collectives`: inside the block collectives complete without communicating, outside they
communicate again. That every method of `bench run` (DDP's C++ reducer, FSDP2, autopar's programs) goes through
it is checked by tests/test_bench.py's run-suite test (collectives replaced per step, losses finite)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


def _collectives(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from autopar.bench.noop_collectives import noop_collectives

    mine = torch.full((3,), float(rank + 1))
    got = {}
    with noop_collectives() as replaced:
        t = mine.clone()
        dist.all_reduce(t, async_op=True).wait()
        got["all_reduce"] = t
        out = torch.zeros(world_size * 3)
        dist.all_gather_into_tensor(out, mine)
        got["all_gather"] = out
        shard = torch.zeros(3)
        dist.reduce_scatter_tensor(shard, torch.arange(world_size * 3, dtype=torch.float32) + rank)
        got["reduce_scatter"] = shard
        got["funcol_all_reduce"] = funcol.all_reduce(mine, "sum", dist.group.WORLD).wait()
    got["counts"] = dict(replaced.counts)
    t = mine.clone()
    dist.all_reduce(t)
    got["after"] = t
    return got


def test_collectives_do_not_communicate_inside_the_block():
    for rank, got in enumerate(run_distributed(_collectives, 2, timeout_s=120)):
        mine = torch.full((3,), float(rank + 1))
        # exact: nothing is added or scaled, the values are copied
        torch.testing.assert_close(got["all_reduce"], mine, rtol=0, atol=0)
        torch.testing.assert_close(got["funcol_all_reduce"], mine, rtol=0, atol=0)
        torch.testing.assert_close(got["all_gather"], mine.repeat(2), rtol=0, atol=0)
        torch.testing.assert_close(got["reduce_scatter"], torch.arange(3.0) + rank, rtol=0, atol=0)
        assert got["counts"] == {"allreduce_": 2, "_allgather_base_": 1, "_reduce_scatter_base_": 1}
        # gloo's kernels are back after the block: 1 + 2 summed over the ranks
        torch.testing.assert_close(got["after"], torch.full((3,), 3.0), rtol=0, atol=0)

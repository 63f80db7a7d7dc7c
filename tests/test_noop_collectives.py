"""`autopar.bench.noop_collectives`: inside the block collectives complete without communicating, outside they
communicate again; DDP's reducer (C++), FSDP2 and the functional collectives all go through it."""

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


def _baselines(rank: int, world_size: int) -> dict:
    import copy

    from autopar.bench.execution import METHODS, RunModel, _measure_noop, _model_and_batch

    _, base, ids = _model_and_batch(RunModel("tiny-llama", "tiny-llama", 4, 16))
    out = {}
    for name in ("ddp", "fsdp2", "autopar-dp"):
        method = METHODS[name](copy.deepcopy(base), ids, rank, world_size, optimizer="sgd")
        method.step()
        loss = method.last_loss
        _, count, finite = _measure_noop(method, 1)
        out[name] = {"count": count, "finite": finite, "loss_kept": method.last_loss == loss}
    return out


def test_every_method_of_the_bench_goes_through_it():
    for got in run_distributed(_baselines, 2, timeout_s=300):
        for name, m in got.items():
            # DDP's bucket all-reduce is called from C++, FSDP2's gathers from Python, autopar's from its hooks
            assert m["count"] >= 1 and m["finite"] and m["loss_kept"], (name, m)

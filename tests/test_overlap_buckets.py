"""The reduce-scatter send buffer `overlap.put_gradient` packs, checked against the padded layout built directly."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import overlap


def _expected(g: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """Rank r's row of member g: piece r of `g` split on `dim` as torch.chunk splits it, zero-padded to the longest."""
    chunk = -(-g.shape[dim] // parts)
    padded = overlap._padded(g, dim, parts * chunk)
    return padded.reshape(parts, -1)


def test_a_send_buffer_holds_each_members_padded_pieces_and_zeros_for_the_rest():
    parts = 4
    shapes = {0: torch.Size([5, 3]), 1: torch.Size([2, 8]), 2: torch.Size([6]), 3: torch.Size([3, 2])}
    dims = [0, 1, 0, 0]
    bucket = overlap.Bucket("reduce_scatter", torch.float32, members=[0, 1, 2, 3])
    overlap.lay_out(bucket, shapes, dims, parts)
    columns = sum(width for _, width, _ in bucket.slots.values())
    # the buffer as torch.empty may leave it: NaN wherever nothing writes, so an unzeroed padding shows
    bucket.send, bucket.sent = torch.full((parts, columns), float("nan")), []
    torch.manual_seed(0)
    grads = {i: torch.randn(shapes[i]) for i in (0, 1, 3)}  # member 2 gets no gradient this step
    for i in (0, 1, 3):
        overlap.put_gradient(bucket, i, grads[i], dims[i], parts)
    extra = torch.randn(shapes[0])
    overlap.put_gradient(bucket, 0, extra, dims[0], parts)  # a second micro-batch's gradient adds
    overlap.zero_missing(bucket)
    assert not bucket.send.isnan().any()
    want = {0: grads[0] + extra, 1: grads[1], 2: torch.zeros(shapes[2]), 3: grads[3]}
    for i, (offset, width, _) in bucket.slots.items():
        # 5 rows over 4: pieces 2, 2, 1, 0 long (padding in rows 2 and 3); 3 rows over 4: the last piece empty.
        # Copies and one add of the same two tensors: exact.
        got = bucket.send[:, offset : offset + width]
        torch.testing.assert_close(got, _expected(want[i], dims[i], parts), rtol=0, atol=0)


def _bucket_on_ranks(rank: int, world_size: int, mode: str | None):
    """Each rank packs its own gradients of two members into a bucket and launches it over gloo: (this rank's summed
    pieces, whether the all-reduce form ran)."""
    import os

    import torch.distributed as dist

    from autopar.errors import ConfigError
    from autopar.runtime.collectives import GLOO_REDUCE_SCATTER_ENV, issue_reduce_scatter, reduce_scatter_by_all_reduce

    os.environ.pop(GLOO_REDUCE_SCATTER_ENV, None)
    if mode is not None:
        os.environ[GLOO_REDUCE_SCATTER_ENV] = mode
    if mode == "ring":
        try:
            reduce_scatter_by_all_reduce()
        except ConfigError as e:
            return str(e)
        return None
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, name=name, fn=fn, **k: calls.append(name) or fn(*a, **k))
    try:
        shapes, dims = {0: torch.Size([5, 3]), 1: torch.Size([4])}, [0, 0]
        bucket = overlap.Bucket("reduce_scatter", torch.float32, members=[0, 1])
        overlap.lay_out(bucket, shapes, dims, world_size)
        for i in (0, 1):
            overlap.put_gradient(bucket, i, _gradient(shapes[i], rank, i), dims[i], world_size)
        overlap.launch_packed(bucket, None)
        out = [None, None]
        overlap.finish_reduce_scatter(bucket, dims, None, out)
        # the form the chunk store and cp attention use: the piece lands in a tensor of the caller's
        stacked = torch.arange(world_size * 6, dtype=torch.float32).reshape(world_size, 2, 3) * (rank + 1)
        mine = torch.full((2, 3), float("nan"))
        piece = issue_reduce_scatter(stacked, None, out=mine).wait()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"pieces": out, "calls": calls, "own": piece, "into_out": piece is mine}


def _gradient(shape: torch.Size, rank: int, i: int) -> torch.Tensor:
    return torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) * (rank + 1) + 10 * i


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [None, "native"], ids=["default-all-reduce", "native"])
def test_a_gloo_reduce_scatter_gives_each_rank_its_summed_pieces_in_either_form(mode):
    from tests.distributed.harness import run_distributed

    world = 2
    got = run_distributed(_bucket_on_ranks, world, mode)
    shapes = {0: torch.Size([5, 3]), 1: torch.Size([4])}
    for rank, r in enumerate(got):
        assert r["calls"] == ["reduce_scatter_single" if mode == "native" else "all_reduce"] * 2
        stacked_sum = torch.arange(world * 6, dtype=torch.float32).reshape(world, 2, 3) * sum(range(1, world + 1))
        assert r["into_out"]
        torch.testing.assert_close(r["own"], stacked_sum[rank], rtol=0, atol=0)  # small integers: exact
        for i, shape in shapes.items():
            whole = sum(_gradient(shape, k, i) for k in range(world))
            # rows 0-2 to rank 0, 3-4 to rank 1 (torch.chunk's pieces); sums of small integers: exact
            torch.testing.assert_close(r["pieces"][i], whole.chunk(world, 0)[rank], rtol=0, atol=0)


@pytest.mark.distributed
def test_an_unknown_gloo_reduce_scatter_setting_is_refused():
    from tests.distributed.harness import run_distributed

    message = run_distributed(_bucket_on_ranks, 2, "ring")[0]
    assert message is not None and "all_reduce" in message and "native" in message

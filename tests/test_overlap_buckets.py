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


def test_a_gloo_reduce_scatter_runs_as_an_all_reduce_unless_told_native(tmp_path, monkeypatch):
    import torch.distributed as dist

    from autopar.errors import ConfigError
    from autopar.runtime.collectives import GLOO_REDUCE_SCATTER_ENV, reduce_scatter_by_all_reduce

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process; this test makes its own")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.delenv(GLOO_REDUCE_SCATTER_ENV, raising=False)
        assert reduce_scatter_by_all_reduce()
        monkeypatch.setenv(GLOO_REDUCE_SCATTER_ENV, "native")
        assert not reduce_scatter_by_all_reduce()
        monkeypatch.setenv(GLOO_REDUCE_SCATTER_ENV, "ring")
        with pytest.raises(ConfigError, match="all_reduce"):
            reduce_scatter_by_all_reduce()
        # the bucket path end to end on one rank: the summed row is the rank's piece, the buffer's padding zero
        monkeypatch.delenv(GLOO_REDUCE_SCATTER_ENV)
        bucket = overlap.Bucket("reduce_scatter", torch.float32, members=[0])
        overlap.lay_out(bucket, {0: torch.Size([3, 2])}, [0], 1)
        g = torch.randn(3, 2)
        overlap.put_gradient(bucket, 0, g, 0, 1)
        overlap.launch_packed(bucket, None)
        out = [None]
        overlap.finish_reduce_scatter(bucket, [0], None, out)
        torch.testing.assert_close(out[0], g, rtol=0, atol=0)  # a sum over one rank: the gradient itself
    finally:
        dist.destroy_process_group()

"""Data-axis collectives issued from backward: gradient buckets reduced while backward goes on.

A program that overlaps its gradient reductions with backward (`plan.overlap`) packs the gradients of the
parameters it reduces over the data axis into buckets of about `bucket_bytes`, in the order backward produces
them, and issues each bucket's collective asynchronously as soon as its last gradient is in; the step waits
for them all before the optimizer runs. Two kinds of bucket:

- all-reduce: gradients of parameters replicated over the data axis (ZeRO-0, or a tensor too small to split);
  every rank ends with the sum, in place in each gradient;
- reduce-scatter: full gradients of parameters split over the data axis on one dim (ZeRO >= 1, as
  `passes.parallelize.dp_placement` splits them: `torch.chunk`'s pieces, the last ones possibly shorter or
  empty); each rank ends with the sum of its own piece. The pieces are padded to the longest one, so that
  every rank's share of the bucket is one equal, contiguous run of the flat buffer.

`split_gather` is the gather such a parameter's forward needs (the same padded layout, all-gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20  # gradient bucket size (DDP's and the data-parallel program's)


def piece_rows(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` of `parts` of a dim of `size` cut as `torch.chunk` cuts it (and DTensor's
    Shard): pieces of ceil(size / parts), the last ones shorter or empty."""
    chunk = -(-size // parts)
    start = min(size, index * chunk)
    return start, min(size, start + chunk) - start


def _padded(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """`t` with `dim` moved first and zero rows appended up to `rows`."""
    moved = t.movedim(dim, 0)
    if moved.shape[0] < rows:
        moved = torch.cat([moved, moved.new_zeros((rows - moved.shape[0], *moved.shape[1:]))])
    return moved


def split_gather(local: torch.Tensor, dim: int, size: int, group, *, async_op: bool = False):
    """All-gather over `group` the pieces of a tensor split on `dim` (whole length `size`), `local` being this
    rank's. Returns the whole tensor, or with `async_op` (work, finish) where finish() gives it after the wait."""
    parts = dist.get_world_size(group)
    chunk = -(-size // parts)
    sent = _padded(local, dim, chunk).contiguous()
    out = sent.new_empty((parts * chunk, *sent.shape[1:]))
    work = dist.all_gather_single(out, sent, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        return out[:size].movedim(0, dim).contiguous()

    return (work, finish) if async_op else finish()


@dataclass(slots=True)
class Bucket:
    """Parameters (indices into the program's list) whose gradients one collective reduces."""

    kind: str  # "all_reduce" or "reduce_scatter"
    dtype: torch.dtype  # the format the collective sends
    members: list[int] = field(default_factory=list)
    pending: int = 0  # gradients still awaited on the last micro-batch
    work: object = None
    flat: torch.Tensor | None = None
    sent: list[int] = field(default_factory=list)  # the members packed (those with a gradient), in order


def make_buckets(sizes: list[tuple[int, str, torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Buckets over parameters given as (bytes, kind, dtype) in the order backward produces their gradients:
    consecutive parameters of one kind and format share a bucket until it holds `bucket_bytes`."""
    buckets: list[Bucket] = []
    filled = 0
    for i, (nbytes, kind, dtype) in enumerate(sizes):
        if not buckets or filled >= bucket_bytes or (buckets[-1].kind, buckets[-1].dtype) != (kind, dtype):
            buckets.append(Bucket(kind, dtype))
            filled = 0
        buckets[-1].members.append(i)
        filled += nbytes
    return buckets


def launch_all_reduce(bucket: Bucket, grads: list[torch.Tensor | None], group) -> None:
    """Issue the bucket's all-reduce of the members' gradients (those that exist), packed in its format."""
    bucket.sent = [i for i in bucket.members if grads[i] is not None]
    flat = torch.cat([grads[i].reshape(-1).to(bucket.dtype) for i in bucket.sent]) if bucket.sent else None
    bucket.flat = flat
    bucket.work = dist.all_reduce(flat, group=group, async_op=True) if flat is not None else None


def finish_all_reduce(bucket: Bucket, grads: list[torch.Tensor | None]) -> None:
    """Wait for the bucket's all-reduce and write the sums back into the gradients."""
    if bucket.work is None:
        return
    bucket.work.wait()
    pieces = bucket.flat.split([grads[i].numel() for i in bucket.sent])
    for i, piece in zip(bucket.sent, pieces, strict=True):
        grads[i].copy_(piece.view_as(grads[i]))
    bucket.work = bucket.flat = None


def launch_reduce_scatter(bucket: Bucket, full: list[torch.Tensor | None], dims: list[int], group) -> None:
    """Issue the bucket's reduce-scatter of the members' full gradients (split on `dims[i]` over `group`)."""
    parts = dist.get_world_size(group)
    bucket.sent = [i for i in bucket.members if full[i] is not None]
    if not bucket.sent:
        bucket.work = bucket.flat = None
        return
    rows = []
    for i in bucket.sent:
        g, d = full[i], dims[i]
        chunk = -(-g.shape[d] // parts)
        rows.append(_padded(g.to(bucket.dtype), d, parts * chunk).reshape(parts, -1))
    sent = torch.cat(rows, dim=1).reshape(-1)
    bucket.flat = sent.new_empty(sent.numel() // parts)
    bucket.work = dist.reduce_scatter_single(bucket.flat, sent, group=group, async_op=True)


def finish_reduce_scatter(bucket: Bucket, full: list[torch.Tensor | None], dims: list[int], group,
                          out: list[torch.Tensor | None]) -> None:  # fmt: skip
    """Wait for the bucket's reduce-scatter; out[i] becomes this rank's piece of member i's summed gradient."""
    if bucket.work is None:
        return
    bucket.work.wait()
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    offset = 0
    for i in bucket.sent:
        g, d = full[i], dims[i]
        chunk = -(-g.shape[d] // parts)
        rest = g.movedim(d, 0).shape[1:]
        n = chunk * rest.numel()
        _, length = piece_rows(g.shape[d], parts, rank)
        out[i] = bucket.flat[offset : offset + n].view(chunk, *rest)[:length].movedim(0, d).contiguous()
        offset += n
    bucket.work = bucket.flat = None

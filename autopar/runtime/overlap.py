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
  every rank's share of the bucket is one equal, contiguous run of the flat buffer. At ZeRO-2/3 the program
  writes each gradient into its bucket's send buffer as backward hands it over (`put_gradient`): the buffer is
  the only whole copy of its members' gradients, made with the bucket's first gradient and freed once its
  collective is done; at most `WINDOW` buckets are in flight. ZeRO-1 packs its accumulated whole gradients when
  the last micro-batch's bucket is ready (`launch_reduce_scatter`).

Buckets follow `autopar.program_comm.gradient_order`, so that a bucket's gradients arrive together and whole
gradients wait for few others. `split_gather` is the gather such a parameter's forward needs (the same padded layout,
all-gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar import compat
from autopar.runtime.collectives import issue_reduce_scatter
from autopar.units import BUCKET_BYTES as BUCKET_BYTES  # the programs' bucket size: tests rebind it here
from autopar.units import BUCKETS_IN_FLIGHT

WINDOW = BUCKETS_IN_FLIGHT  # reduce-scatter buckets in flight at once at ZeRO-2/3


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


def padded_piece(local: torch.Tensor, dim: int, size: int, parts: int) -> torch.Tensor:
    """`local`, one rank's piece of a tensor split on `dim` (whole length `size`) over `parts` ranks, as a gather of
    split pieces sends it: `dim` first, zero rows appended up to the longest piece's ceil(size / parts) (a view of
    `local` where it has them all)."""
    return _padded(local, dim, -(-size // parts))


def whole_from_pieces(pieces: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The whole tensor of length `size` on `dim` from every rank's `padded_piece`, in rank order along dim 0: cut
    to `size`, `dim` put back, contiguous (a view of `pieces` only where that already is)."""
    return pieces[:size].movedim(0, dim).contiguous()


def split_gather(local: torch.Tensor, dim: int, size: int, group, *, async_op: bool = False):
    """All-gather over `group` the pieces of a tensor split on `dim` (whole length `size`), `local` being this
    rank's. Returns the whole tensor, or with `async_op` (work, finish) where finish() gives it after the wait."""
    parts = dist.get_world_size(group)
    sent = padded_piece(local, dim, size, parts).contiguous()
    out = sent.new_empty((parts * sent.shape[0], *sent.shape[1:]))
    work = compat.all_gather_single(out, sent, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        return whole_from_pieces(out, dim, size)

    return (work, finish) if async_op else finish()


@dataclass(slots=True)
class Bucket:
    """Parameters (indices into the program's list) whose gradients one collective reduces."""

    kind: str  # "all_reduce" or "reduce_scatter"
    dtype: torch.dtype  # the format the collective sends
    members: list[int] = field(default_factory=list)
    pending: int = 0  # gradients still awaited in the micro-batch whose backward launches the bucket
    armed: bool = False  # whether this micro-batch's backward launches the bucket
    work: object = None  # the collective in flight (reduce-scatter: a `PendingReduceScatter`)
    flat: torch.Tensor | None = None  # all-reduce: what this rank sends and receives
    send: torch.Tensor | None = None  # reduce-scatter: the packed gradients, until the collective is done
    sent: list[int] = field(default_factory=list)  # the members packed (those with a gradient)
    # reduce-scatter: member -> (first column, columns, whole shape) in the send buffer's rows (`lay_out`)
    slots: dict[int, tuple[int, int, torch.Size]] = field(default_factory=dict)


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


def lay_out(bucket: Bucket, shapes: dict[int, torch.Size], dims: list[int], parts: int) -> None:
    """Give each member of a reduce-scatter bucket its columns of the send buffer: member i (whole gradient of
    `shapes[i]`, split on `dims[i]` over `parts`) takes one padded piece's worth in every rank's row."""
    bucket.slots, offset = {}, 0
    for i in bucket.members:
        width = _piece_numel(shapes[i], dims[i], parts)
        bucket.slots[i] = (offset, width, shapes[i])
        offset += width


def put_gradient(bucket: Bucket, i: int, grad: torch.Tensor, dim: int, parts: int) -> None:
    """Write (or, for member i's next use, add) a gradient of member i into the bucket's send buffer, which is made
    (uninitialised: a member's first write zeroes its pieces' padding, `launch_packed` the columns of members that
    got no gradient) when its first gradient comes in; the bucket holds no other copy of its members' whole
    gradients."""
    if bucket.send is None:
        columns = sum(width for _, width, _ in bucket.slots.values())
        bucket.send = torch.empty((parts, columns), dtype=bucket.dtype, device=grad.device)
        bucket.sent = []
    offset, width, _ = bucket.slots[i]
    first = i not in bucket.sent
    _pack(grad, dim, bucket.send[:, offset : offset + width], accumulate=not first)
    if first:
        bucket.sent.append(i)


def zero_missing(bucket: Bucket) -> None:
    """Zero the send buffer's columns of the members `put_gradient` got no gradient of (they send zeros)."""
    sent = set(bucket.sent)
    for i, (offset, width, _) in bucket.slots.items():
        if i not in sent:
            bucket.send[:, offset : offset + width].zero_()


def launch_packed(bucket: Bucket, group) -> None:
    """Issue the reduce-scatter of the bucket's send buffer as `put_gradient` filled it (none if it got nothing)."""
    if bucket.send is None:
        bucket.sent, bucket.work, bucket.flat = [], None, None
        return
    zero_missing(bucket)
    bucket.work = issue_reduce_scatter(bucket.send, group)


def launch_reduce_scatter(bucket: Bucket, full: list[torch.Tensor | None], dims: list[int], group) -> None:
    """Issue the bucket's reduce-scatter of the members' full gradients (split on `dims[i]` over `group`; those that
    exist), packed into one send buffer in the bucket's format."""
    parts = dist.get_world_size(group)
    sent = [i for i in bucket.members if full[i] is not None]
    packed = Bucket(bucket.kind, bucket.dtype, members=sent)
    lay_out(packed, {i: full[i].shape for i in sent}, dims, parts)
    bucket.slots, bucket.send = packed.slots, None
    for i in sent:
        put_gradient(bucket, i, full[i], dims[i], parts)
    launch_packed(bucket, group)


def _piece_numel(shape: torch.Size, dim: int, parts: int) -> int:
    """Elements of one rank's padded piece of a tensor of `shape` split on `dim` over `parts`."""
    return -(-shape[dim] // parts) * (shape.numel() // shape[dim] if shape[dim] else 0)


def _pack(g: torch.Tensor, dim: int, out: torch.Tensor, *, accumulate: bool = False) -> None:
    """Write (or add) `g`, split on `dim` into `out.shape[0]` pieces, into the rows of `out` (one piece per row; a
    write zeroes the rows a piece shorter than the longest leaves, an add leaves them as they are)."""
    parts, size = out.shape[0], g.shape[dim]
    chunk = -(-size // parts)
    moved = g.movedim(dim, 0)
    rows = out.view(parts, chunk, *moved.shape[1:])
    full, rest = divmod(size, chunk) if chunk else (0, 0)
    put = torch.Tensor.add_ if accumulate else torch.Tensor.copy_
    put(rows[:full], moved[: full * chunk].reshape(full, chunk, *moved.shape[1:]))
    if full < parts and rest:
        put(rows[full, :rest], moved[full * chunk :])
    if not accumulate and full < parts:  # the padding
        if rest:
            rows[full, rest:].zero_()
        rows[full + (1 if rest else 0) :].zero_()


def finish_reduce_scatter(bucket: Bucket, dims: list[int], group, out: list[torch.Tensor | None]) -> None:
    """Wait for the bucket's reduce-scatter; out[i] becomes this rank's piece of member i's summed gradient (a
    tensor of its own, not a view of the bucket's buffer), for the members that had a gradient."""
    if bucket.work is None:
        return
    flat = bucket.work.wait()
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    for i in bucket.sent:
        offset, n, shape = bucket.slots[i]
        d = dims[i]
        chunk = -(-shape[d] // parts)
        rest = shape[:d] + shape[d + 1 :]
        _, length = piece_rows(shape[d], parts, rank)
        piece = flat[offset : offset + n].view(chunk, *rest)[:length].movedim(0, d)
        out[i] = piece.clone(memory_format=torch.contiguous_format)
    bucket.work = bucket.flat = bucket.send = None


class _GatherSplit(torch.autograd.Function):
    """A parameter split over `group` on `dim` gathered whole (functional collectives, padded pieces as
    `split_gather` lays them out); the backward reduce-scatters the whole gradient back to this rank's piece."""

    @staticmethod
    def forward(ctx, local, dim, size, group, whole):
        ctx.dim, ctx.size, ctx.group, ctx.length = dim, size, group, local.shape[dim]
        if whole is not None:  # gathered already, with its layer (`autopar.runtime.layer_gather`)
            return whole
        parts = dist.get_world_size(group)
        whole = compat.funcol_all_gather(padded_piece(local, dim, size, parts).contiguous(), 0, group)
        whole = whole.wait() if hasattr(whole, "wait") else whole
        return whole_from_pieces(whole, dim, size)

    @staticmethod
    def backward(ctx, grad):
        parts = dist.get_world_size(ctx.group)
        chunk = -(-ctx.size // parts)
        piece = compat.funcol_reduce_scatter(_padded(grad, ctx.dim, parts * chunk).contiguous(), 0, ctx.group)
        piece = piece.wait() if hasattr(piece, "wait") else piece
        return piece[: ctx.length].movedim(0, ctx.dim).contiguous(), None, None, None, None


def gather_split(local: torch.Tensor, dim: int, size: int, group, *, whole: torch.Tensor | None = None) -> torch.Tensor:
    """`local`, this rank's piece of a tensor split on `dim` (whole length `size`) over `group`, gathered whole; the
    gradient of the whole comes back reduce-scattered (ZeRO's gather without overlap, as DTensor's Shard ->
    Replicate does it). `whole`: the tensor whole, gathered already (with others, in one collective)."""
    if dist.get_world_size(group) == 1:
        return local
    return _GatherSplit.apply(local, dim, size, group, whole)

"""Pieces: what one rank holds of a full tensor, and how pieces travel to the rank that writes a tensor.

Every program exposes its master weights (and optimizer states) as `Piece`s under the model's names
(`Checkpointable.checkpoint_masters`): this rank's part of one full tensor, as live storage, so that reading a
checkpoint into a piece updates the program. A piece is either

- rectangular: a block of the full tensor starting at `offsets` with the shape of `tensor` (a DTensor's
  local shard, or the whole tensor when replicated); `mesh` and `placements` say which DTensor it is
  the local shard of (None: a plain tensor, the same on every rank that lists it); or
- flat: the range `flat = (start, stop)` of the flattened full tensor (a ZeRO-3 chunk's shard cuts
  parameters anywhere), `tensor` being 1-D.

`agree` gathers every rank's problem with a step on every rank, so that a failure on one rank fails the step on
all. `assemble` brings the pieces of chosen tensors to the one rank that writes each (point-to-point, in one
order every rank follows, so no rank holds more than the tensors it writes plus one piece in flight).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

Region = tuple  # ("rect", offsets, sizes) or ("flat", start, stop)


@dataclass(frozen=True)
class Piece:
    """This rank's piece of one full tensor (see the module docstring).

    Attributes:
        tensor: the piece, live storage (writes change the program's state).
        shape: the full tensor's shape.
        offsets: where a rectangular piece starts in the full tensor (None for a flat piece).
        flat: (start, stop) of a flat piece in the flattened full tensor (None for a rectangular one).
        mesh, placements: the DTensor whose local shard a rectangular piece is (None: a plain tensor).
        param: the tensor the optimizer keys its state by (None where the program keeps states its own way).
    """

    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None
    flat: tuple[int, int] | None = None
    mesh: object = None
    placements: tuple = ()
    param: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert (self.offsets is None) != (self.flat is None), "a piece is rectangular or flat"

    @property
    def region(self) -> Region:
        if self.flat is not None:
            return ("flat", *self.flat)
        return ("rect", tuple(self.offsets), tuple(self.tensor.shape))

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def like(self, tensor: torch.Tensor) -> Piece:
        """The same region of another tensor of the same shape (an optimizer state of this master)."""
        return Piece(tensor, self.shape, self.offsets, self.flat, self.mesh, self.placements)

    def as_checkpoint_value(self, tensor: torch.Tensor | None = None):
        """`tensor` (default the piece) as torch.distributed.checkpoint takes it: a DTensor over the piece's mesh,
        or the plain tensor (a whole, replicated one)."""
        t = self.tensor if tensor is None else tensor
        if self.mesh is None:
            assert self.offsets is not None and tuple(t.shape) == tuple(self.shape), "a plain piece is whole"
            return t
        from torch.distributed.tensor import DTensor

        stride = contiguous_stride(self.shape)
        return DTensor.from_local(
            t, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=stride
        )


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    """The number of ranks (1 outside a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier(group=None) -> None:
    """Wait for every rank of `group` (default the world; nothing to wait for alone)."""
    if world() > 1:
        dist.barrier(group=group)


def agree(problem: str | None, group=None) -> list[tuple[int, str]]:
    """Every rank's problem (None: none), gathered on every rank of `group` (default the world): the (rank,
    problem) pairs, empty when no rank had one. A step that fails on one rank fails on every rank then, rather
    than leaving the others waiting in the next collective."""
    if world() == 1:
        return [(0, problem)] if problem is not None else []
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problem, group=group)
    return [(r, p) for r, p in enumerate(everyone) if p is not None]


def dtensor_piece(local: torch.Tensor, shape, mesh, placements, *, param=None) -> Piece:
    """The piece a DTensor's local shard is (offsets computed as DTensor computes them)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return Piece(
        local,
        tuple(shape),
        offsets=tuple(int(o) for o in offsets),
        mesh=mesh,
        placements=tuple(placements),
        param=param,
    )


def region_of(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The view of `full` a region names."""
    if region[0] == "flat":
        return full.reshape(-1)[region[1] : region[2]]
    view = full
    for dim, (o, s) in enumerate(zip(region[1], region[2], strict=True)):
        view = view.narrow(dim, o, s)
    return view


def region_numel(region: Region) -> int:
    if region[0] == "flat":
        return region[2] - region[1]
    n = 1
    for s in region[2]:
        n *= s
    return n


def assemble(
    pieces: Mapping[str, Piece],
    owners: Mapping[str, int],
    dtypes: Mapping[str, torch.dtype],
    *,
    shapes: Mapping[str, tuple] | None = None,
    group=None,
) -> dict[str, torch.Tensor]:
    """Full tensors (on the CPU, in `dtypes[name]`) of the names this rank owns, from every rank's pieces.

    Args:
        pieces: this rank's pieces by name (any subset of `owners`).
        owners: name -> the rank that gets the full tensor (every rank passes the same mapping).
        dtypes: name -> the dtype of the full tensor.
        shapes: name -> full shape, for names this rank holds no piece of (default: from the pieces).
    Collective over `group` (default the world): every rank calls it.
    """
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = {n: (p.region, tuple(p.shape)) for n, p in pieces.items() if n in owners}
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    holders: dict[tuple, list[int]] = {}
    full_shape: dict[str, tuple] = dict(shapes or {})
    for rank, listed in enumerate(everyone):
        for name, (region, shape) in listed.items():
            holders.setdefault((name, region), []).append(rank)
            full_shape.setdefault(name, shape)
    out: dict[str, torch.Tensor] = {}
    for name, owner in owners.items():
        if owner == me:
            out[name] = torch.empty(full_shape[name], dtype=dtypes[name])
    covered: dict[str, int] = {}
    for (name, region), ranks in sorted(holders.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        dst = owners[name]
        src = dst if dst in ranks else min(ranks)
        if dst == me:
            covered[name] = covered.get(name, 0) + region_numel(region)
        if src == me and dst == me:
            region_of(out[name], region).copy_(pieces[name].tensor.detach().reshape(region_of(out[name], region).shape))
        elif src == me:
            dist.send(pieces[name].tensor.detach().to("cpu", dtype=dtypes[name]).contiguous(), dst, group=group)
        elif dst == me:
            view = region_of(out[name], region)
            buf = torch.empty(_piece_shape(region), dtype=dtypes[name])  # pieces travel in the full tensor's dtype
            dist.recv(buf, src, group=group)
            view.copy_(buf.reshape(view.shape))
    for name, t in out.items():
        if covered.get(name, 0) != t.numel():
            raise AssertionError(f"the pieces of {name} cover {covered.get(name, 0)} of its {t.numel()} elements")
    return out


def _piece_shape(region: Region) -> tuple[int, ...]:
    return (region[2] - region[1],) if region[0] == "flat" else tuple(region[2])

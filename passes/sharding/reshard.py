"""Prices of resharding on the tensor axis: the collective that turns one placement of a value into another, and its
time on the axis's link (`redistribute_time`); the layout a gradient comes back in (`grad_layout`)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec

R = Replicate()


FORBIDDEN_S = 1e6  # the price of a conversion the runtime cannot do: no optimum ever pays it


def redistribute_kind(src: Placement, dst: Placement) -> Collective | None:
    """The collective that turns placement `src` into `dst` on the tensor axis; None when none is needed (the
    same placement, or a slice of a replicated value); ValueError for a conversion the runtime cannot do."""
    if src == dst:
        return None
    if dst.is_replicate():
        return Collective.ALL_REDUCE if src.is_partial() else Collective.ALL_GATHER
    if isinstance(dst, Shard):
        if src.is_replicate():
            return None  # each rank keeps its slice
        return Collective.REDUCE_SCATTER if src.is_partial() else Collective.ALL_TO_ALL
    # Nothing turns a value into a Partial one at run time (DTensor keeps that for its own
    # ops), so a consumer that wants Partial inputs can only follow a Partial producer.
    raise ValueError(f"no collective turns {src} into {dst}")


def redistribute_time(src: Placement, dst: Placement, nbytes: float, tp: int, link: LinkSpec) -> float:
    """Time to turn a tensor of `nbytes` (full size) from placement `src` into `dst` on the tensor axis."""
    return reshard_memo(link).time(src, dst, nbytes, tp)


class ReshardMemo:
    """`redistribute_time` on one link, each (src, dst, nbytes, tp) priced once: the programs of one plan (meshes,
    stage views, micro-batch counts) price the same conversions of the same values again and again, and the price is
    a pure function of them."""

    __slots__ = ("link", "_times")

    def __init__(self, link: LinkSpec):
        self.link = link
        self._times: dict[tuple, float] = {}

    def time(self, src: Placement, dst: Placement, nbytes: float, tp: int) -> float:
        if tp == 1:
            return 0.0
        key = (src, dst, nbytes, tp)
        found = self._times.get(key)
        if found is None:
            if len(self._times) >= _MAX_ENTRIES:
                self._times.clear()
            found = self._times[key] = _redistribute_time(src, dst, nbytes, tp, self.link)
        return found


def reshard_memo(link: LinkSpec) -> ReshardMemo:
    """The memo of `link` (equal links share one: a cluster makes a new link object for every mesh it is asked)."""
    memo = _MEMOS.get(link)
    if memo is None:
        if len(_MEMOS) >= _MAX_LINKS:
            _MEMOS.clear()
        memo = _MEMOS[link] = ReshardMemo(link)
    return memo


_MEMOS: dict[LinkSpec, ReshardMemo] = {}
_MAX_LINKS, _MAX_ENTRIES = 256, 1 << 18


def _redistribute_time(src: Placement, dst: Placement, nbytes: float, tp: int, link: LinkSpec) -> float:
    try:
        kind = redistribute_kind(src, dst)
    except ValueError:
        return FORBIDDEN_S
    return 0.0 if kind is None else estimate_collective_time(kind, nbytes, tp, link)


def grad_layout(p: Placement) -> Placement:
    """The layout a producer needs its output's gradient in (the gradient of a Partial value is replicated)."""
    return R if p.is_partial() else p

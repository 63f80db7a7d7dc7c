"""The sharded program's gathered weights: which whole weights a step keeps, and ZeRO-3's release of them.

Gathered weights (ZeRO >= 1, more than one rank on the data axis). ZeRO-3 keeps no whole weight from a forward to
its backward, as FSDP reshards after forward: while a step runs, a saved-tensor hook turns what autograd saves of a
gathered weight (the weight, or a view of it) into a handle, and the backward gathers that weight again when it
first unpacks one (once per micro-batch, for all its saved uses; with the other weights of its layer the backward
needs again, in one all-gather: `autopar.runtime.layer_gather`). So a step gathers each weight twice per
micro-batch, in its forward and in its backward, and holds whole only the weights of the layer running and those
gathered ahead (the plan prices the gathers, and counts the layers gathered ahead). ZeRO-1 and 2 (with overlap) hold every weight whole anyway (the plan counts
them so): each is gathered in the step's first forward and kept until the step ends, one gather per weight per
step, as priced.

`ReleasedWeights` holds this state, the saved-tensor hooks and the gather without overlap for
`autopar.runtime.sharded.ShardedProgram`; with overlap a backward's gather is `GradientOverlap._gather_now`
(`autopar.runtime.sharded_overlap`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from autopar.runtime import overlap


@dataclass(frozen=True, slots=True)
class _Released:
    """What a ZeRO-3 forward saves for backward in place of a gathered weight: which one, and the view of it."""

    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class ReleasedWeights:
    """The gathered weights of a `ShardedProgram` (a mixin of it: see the module docstring)."""

    def _setup_release(self) -> None:
        """ZeRO-3 frees each weight it gathers once the forward has used it, and gathers it again for the backward
        (see the module docstring); ZeRO-1 and 2, with overlap, keep each gathered weight for the step."""
        self._release = self.comm.releases_gathered_weights
        self._hold = self.comm.holds_gathered_weights
        self._held: dict[int, torch.Tensor] = {}  # ZeRO-1/2: parameter index -> its whole weight, for the step
        # ZeRO-3: address of a gathered weight's storage -> (a weak reference to the weight, parameter index)
        self._gathered_by: dict[int, tuple[weakref.ref, int]] = {}
        self._regather_from: dict[int, object] = {}  # parameter index -> what its backward gather starts from
        self._handles: dict[int, int] = {}  # parameter index -> saved uses of its weight the backward has to come
        self._regathered: dict[int, torch.Tensor] = {}  # parameter index -> its weight gathered again, while needed

    def _released(self, i: int, full: torch.Tensor, source) -> None:
        """Weight i, gathered whole in a forward: saved for backward, it is kept as a handle instead."""
        if self._release and not self._in_backward:
            # a tensor the forward saves is found by its storage (a view of the weight shares it). The weak reference
            # tells that the storage is still this weight's: an address is only reused once its storage is freed.
            self._gathered_by[full.untyped_storage().data_ptr()] = (weakref.ref(full), i)
            self._regather_from[i] = source

    def _pack(self, saved):
        """Saved-tensor hook: a gathered weight (or a view of one) the backward needs becomes a handle."""
        local = saved._local_tensor if isinstance(saved, DTensor) else saved
        found = self._gathered_by.get(local.untyped_storage().data_ptr())
        if found is None or found[0]() is None:
            return saved
        i = found[1]
        self._handles[i] = self._handles.get(i, 0) + 1
        return _Released(i, local.shape, local.stride(), local.storage_offset())

    def _unpack(self, handle):
        """Saved-tensor hook: a handle's weight gathered again (once for all its saved uses in this backward)."""
        if not isinstance(handle, _Released):
            return handle
        i = handle.index
        full = self._regathered.get(i)
        if full is None:
            source = self._regather_from[i]
            full = self._gather_now(i, source) if self.overlap else self._gather_sync(i, source)
            self._regathered[i] = full
        self._handles[i] -= 1
        if not self._handles[i]:
            del self._regathered[i], self._handles[i]
        return full.as_strided(handle.size, handle.stride, handle.offset)

    def _releasing(self):
        """The saved-tensor hooks of a step's forwards and backwards (none where nothing is released)."""
        if not self._release:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _forget_gathers(self) -> None:
        """End of a step (or a forward outside one): no gathered weight is kept or awaited any more."""
        self._drop_prefetched()
        self._held.clear()
        self._gathered_by.clear()
        self._regather_from.clear()
        self._handles.clear()
        self._regathered.clear()

    def _gather_sync(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Split parameter i whole (from its layer group's gather: `LayerGathers`), its gradient (if any)
        reduce-scattered by the gather's backward."""
        d = self._split_dim[i]
        return overlap.gather_split(local, d, self._shapes[i][d], self._dp_group, whole=self._whole(i, local))

    def _gather_plain(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """The gather without overlap, its weight released at ZeRO-3."""
        full = self._gather_sync(i, local)
        if torch.is_grad_enabled():
            self._released(i, full, local.detach())
        return full


__all__ = ["ReleasedWeights"]

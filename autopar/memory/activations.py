"""Activation offload: the tensors autograd saves for backward, kept on the host until backward reads them.

`ActivationOffload` is a pair of saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`).
Inside its context every tensor an op saves for backward is copied to the host (pinned memory and a
non-blocking copy where the device is a GPU) and the device copy is dropped with the op's other
references; backward brings it back to the device when it needs it. A DTensor is offloaded through
its local shard and rebuilt with the same mesh, placements, shape and stride. Tensors that stay
resident anyway (parameters, whatever `keep` accepts) are saved as they are.

On a CPU device the host is the same memory: the copy is real (a distinct buffer, counted as host
bytes) but moves nothing between memories. The counters (`packed`, `unpacked`, `host_bytes`,
`peak_host_bytes`) say what was moved; host bytes are released when autograd frees the saved copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _SavedTensorHooks:
    """`_pack` / `_unpack` as saved-tensor hooks, installed while the object is used as a context manager."""

    def __init__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        raise NotImplementedError

    def _unpack(self, packed):
        raise NotImplementedError


class ActivationOffload(_SavedTensorHooks):
    """Saved-tensor hooks that keep saved activations on the host; use as a context manager (re-entrant)."""

    def __init__(self, keep: Callable[[torch.Tensor], bool] | None = None, tracker=None):
        super().__init__()
        self.keep = keep or (lambda t: False)
        self.tracker = tracker  # a MemoryTracker: counts a tensor brought back while backward holds it
        self.packed = 0
        self.unpacked = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0

    def _pack(self, t: torch.Tensor):
        local = local_tensor(t)
        if self.keep(t) or (t.requires_grad and t.is_leaf) or local.device.type == "meta" or local.numel() == 0:
            return ("kept", t)
        cuda = local.device.type == "cuda"
        host = torch.empty(local.size(), dtype=local.dtype, layout=local.layout, pin_memory=cuda)
        host.copy_(local, non_blocking=cuda)
        nbytes = host.numel() * host.element_size()
        self.packed += 1
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(host, self._release, nbytes)
        meta = (t.device_mesh, t.placements, t.size(), t.stride()) if isinstance(t, DTensor) else None
        return ("host", host, local.device, meta)

    def _unpack(self, packed):
        if packed[0] == "kept":
            return packed[1]
        _, host, device, meta = packed
        self.unpacked += 1
        local = host.to(device, non_blocking=device.type == "cuda") if device.type != "cpu" else host.clone()
        if self.tracker is not None:
            nbytes = local.numel() * local.element_size()
            self.tracker.alloc(nbytes, "activations")
            weakref.finalize(local, self.tracker.free, nbytes, "activations")
        if meta is None:
            return local
        mesh, placements, shape, stride = meta
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


class ActivationTracker(_SavedTensorHooks):
    """Saved-tensor hooks that count, on a `MemoryTracker`, the device bytes autograd holds for backward.

    Every tensor an op saves is counted once per storage (views of one value share it) from the
    moment it is saved until autograd frees the last saved reference to it (after its backward, or
    when the graph is dropped), under the kind "activations". Parameters, views of parameters and
    tensors not on the tracked device are not counted: the store accounts for the parameters, and
    tensors a nested `ActivationOffload` sends to the host never reach these hooks.
    """

    def __init__(self, tracker, device: str | torch.device):
        super().__init__()
        self.tracker = tracker
        self.device = torch.device(device)
        self._held: dict[int, list[int]] = {}  # storage pointer -> [saved references alive, bytes]

    @property
    def held_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self._held.values())

    def _pack(self, t: torch.Tensor):
        local = local_tensor(t)
        base = local._base if local._base is not None else local
        if base.requires_grad and base.is_leaf or local.device.type != self.device.type or local.numel() == 0:
            return _Kept(t, None)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in self._held:
            self._held[key][0] += 1
        else:
            self._held[key] = [1, storage.nbytes()]
            self.tracker.alloc(storage.nbytes(), "activations")
        held = _Kept(t, key)
        weakref.finalize(held, self._drop, key)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor

    def _drop(self, key: int) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self.tracker.free(entry[1], "activations")


class _Kept:
    """A saved tensor as autograd holds it between forward and backward."""

    __slots__ = ("__weakref__", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int | None):
        self.tensor, self.key = tensor, key

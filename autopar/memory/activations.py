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


class ActivationOffload:
    """Saved-tensor hooks that keep saved activations on the host; use as a context manager (re-entrant)."""

    def __init__(self, keep: Callable[[torch.Tensor], bool] | None = None):
        self.keep = keep or (lambda t: False)
        self.packed = 0
        self.unpacked = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        local = t.to_local() if isinstance(t, DTensor) else t
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
        if meta is None:
            return local
        mesh, placements, shape, stride = meta
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

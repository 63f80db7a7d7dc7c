"""ChunkScheduler: gathers a store's chunks as a module's forward and backward reach them, and frees them after.

Forward: before a module with parameters runs, its chunks are gathered (and the chunk after them
in the order recorded on the first step is prefetched); once every parameter of a chunk has been
used, the chunk is released. Backward: a hook on each module output gathers the module's chunks
again when the output's gradient arrives; a hook after each parameter's gradient accumulation adds
it into the chunk's staging buffer and, once the chunk's last gradient is in, issues the chunk's
reduce-scatter (asynchronously: it runs while backward goes on) and releases the chunk's payload. At
most `reduce_window` reduce-scatters are in flight: issuing one more first completes the oldest (adding
its shard into the chunk's gradient and freeing its staging buffer), so the device holds at most that
many staging buffers in flight besides the ones being filled. At the end of backward, chunks with
leftover gradients (parameters unused this step) are reduced, every reduce-scatter is completed and
every transient payload is released.

So on dp ranks one step issues, per chunk, one all-gather for forward, one for backward and one
reduce-scatter: ZeRO-3's 3x parameter traffic, in collectives of a chunk each. A chunk is gathered
again only if a parameter is used after its chunk was released (a tied embedding reused by the
output layer, say).

A module run again inside backward (activation recompute) gathers its chunks as in forward but
releases nothing: its parameters are read by the backward that follows, and its chunks are released
once their gradients are in (or at the end of backward).

Parameters are gathered when the forward of the module that owns them runs; a module that reads
another module's parameters directly needs those chunks gathered by hand (`store.gather`).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autopar.memory.store import Chunk, ChunkStore


class ChunkScheduler:
    """Hooks that drive a :class:`ChunkStore` through `module`'s forward and backward (see the module docstring).

    Args:
        store: the store whose parameters are bound into `module` (:meth:`ChunkStore.bind`).
        module: the model.
        prefetch: start gathering the next chunk (in the recorded order) while the current one computes,
            one chunk ahead at most, and only while the store's tracked device bytes stay within the
            tracker's budget (if it has one).
        reduce_window: gradient reduce-scatters in flight at most (0: each one completes where it is issued).
    """

    def __init__(self, store: ChunkStore, module: torch.nn.Module, *, prefetch: bool = True, reduce_window: int = 1):
        self.store, self.prefetch = store, prefetch
        self.reduce_window = reduce_window
        self._reducing: list[Chunk] = []  # chunks whose reduce-scatter is in flight, oldest first
        self._handles: list = []
        self._order: list[int] = []  # chunk indices in first-gather order, recorded on the first forward
        self._recording = True
        self._used: dict[int, set[str]] = {}
        self._backward_queued = False
        self._prefetched: Chunk | None = None  # gathered ahead and not used yet
        name_of = {id(p): n for n, p in store.params.items()}
        self._module_params: dict[torch.nn.Module, list[str]] = {}
        for mod in module.modules():
            names = [name_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in name_of]
            if names:
                self._module_params[mod] = list(dict.fromkeys(names))
                self._handles.append(mod.register_forward_pre_hook(self._before_forward))
                self._handles.append(mod.register_forward_hook(self._after_forward))
        for name, p in store.params.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _chunks(self, mod: torch.nn.Module) -> list[Chunk]:
        return list({id(c): c for c in (self.store.chunk_of(n) for n in self._module_params[mod])}.values())

    def _gather(self, chunk: Chunk, direction: int) -> None:
        if chunk is self._prefetched:
            self._prefetched = None
        if not chunk.resident:
            self.store.gather(chunk)
            if self._recording and chunk.index not in self._order:
                self._order.append(chunk.index)
        if self.prefetch and not self._recording and chunk.index in self._order:
            pos = self._order.index(chunk.index) + direction
            if 0 <= pos < len(self._order):
                self._prefetch(self.store.chunks[self._order[pos]])

    def _prefetch(self, chunk: Chunk) -> None:
        """Prefetch one chunk ahead at most, and not past the tracker's budget."""
        if chunk.resident or chunk.pending is not None or self._prefetched is not None:
            return
        tracker = self.store.tracker
        nbytes = chunk.payload.numel() * chunk.payload.element_size()
        if tracker.budget_bytes is None or tracker.current + nbytes <= tracker.budget_bytes:
            self.store.prefetch(chunk)
            self._prefetched = chunk

    # ------------------------------------------------------------------------- forward

    def _before_forward(self, mod, args) -> None:
        for chunk in self._chunks(mod):
            self._gather(chunk, +1)

    def _after_forward(self, mod, args, output):
        if torch._C._current_graph_task_id() != -1:
            return output  # a forward run again inside backward (recompute): its chunks stay until their gradients
        for name in self._module_params[mod]:
            chunk = self.store.chunk_of(name)
            used = self._used.setdefault(chunk.index, set())
            used.add(self.store.slot_of(name).name)
            if len(used) == len(chunk.layout.slots):
                self._used.pop(chunk.index)
                self.store.release(chunk)
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_hook(mod))
        return output

    # ------------------------------------------------------------------------- backward

    def _backward_hook(self, mod):
        def hook(grad):
            self._queue_end_of_backward()
            for chunk in self._chunks(mod):
                self._gather(chunk, -1)

        return hook

    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            self._queue_end_of_backward()
            chunk = self.store.add_grad(name, p.grad)
            p.grad = None
            if len(chunk.grads_seen) == len(chunk.layout.slots):
                self.store.reduce_scatter_grads(chunk, async_op=self.reduce_window > 0)
                self._reducing.append(chunk)
                while len(self._reducing) > self.reduce_window:
                    self.store.finish_reduce(self._reducing.pop(0))
                self.store.release(chunk)

        return hook

    def _queue_end_of_backward(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_queued = False
        self._recording = False
        self._used.clear()
        self._prefetched = None
        self._reducing.clear()
        self.store.finish_grads()  # completes the reduce-scatters in flight too
        for chunk in self.store.chunks:
            self.store.release(chunk)

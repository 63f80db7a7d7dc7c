"""ChunkStore: parameters, gradients and AdamW states in chunks, on the device or the host, sharded over dp.

Each chunk (see :mod:`autopar.memory.layout`) owns:
- `payload`: the full chunk in the compute dtype (fp32, or bf16/fp16 for mixed precision) on the
  compute device. The model's parameters are views into it. It is *persistent* when the chunk is
  not sharded (dp == 1) and resident on the device; otherwise it is *transient*: materialised by
  :meth:`ChunkStore.gather` (or `prefetch` + `wait`) and freed by :meth:`ChunkStore.release`. Freeing
  resizes the payload's storage to zero and gathering resizes it back, so the parameter views and
  the tensors autograd saved from them stay valid across a release and a later gather (the scheme of
  PyTorch FSDP1; writes go through `.data`, so autograd's version counters do not see them).
- `master`, `grad`, `exp_avg`, `exp_avg_sq`: this rank's shard (1/dp of the chunk) of the master
  weights (fp32), gradients (fp32) and AdamW moments, where the chunk resides (`chunk.device`).
  Frozen chunks have only `master`, in the compute dtype. A persistent fp32 payload *is* the master
  (no second copy).

Placement: `chunk.device` is :class:`Residence` "device" or "host". On a CUDA device host states sit
in pinned memory and `prefetch` copies them up on a side stream. On a CPU-only machine the device and
the host are the same RAM: the placement is then logical, and the :class:`MemoryTracker` (which counts
the bytes the store holds on the device) is what tells them apart.

ZeRO-3 over the data axis (a process group of size dp): `gather` is one all-gather per chunk,
`reduce_scatter_grads` one reduce-scatter per chunk (an all-reduce and a slice where the backend has
no reduce-scatter), each counted once by the :class:`CollectiveCounter`.

Gradients: :meth:`ChunkStore.add_grad` adds a parameter's gradient into the chunk's full-size fp32
staging buffer (the `grad` itself when dp == 1 and the chunk is on the device); `reduce_scatter_grads`
then reduces the staging buffer, averages over dp and adds this rank's shard into `grad`, where it
accumulates over micro-batches until the optimizer step zeroes it. With `async_op` it only issues the
reduce-scatter, which runs while backward goes on; :meth:`ChunkStore.finish_reduce` waits for it and adds
the shard, and the staging buffer stays allocated (and counted) until then.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from enum import StrEnum

import torch
import torch.distributed as dist

from autopar import compat
from autopar.errors import ConfigError, LoweringError
from autopar.memory.layout import ALIGN_NUMEL, ChunkLayout, ParamSpec, Slot, choose_chunk_size, pack


class Residence(StrEnum):
    """Where a chunk's persistent states live."""

    DEVICE = "device"
    HOST = "host"


class MemoryTracker:
    """Bytes the store holds on the compute device, with their peak.

    Counts what the store allocates and frees (payloads, device-resident states, gradient staging) and
    what an `ActivationTracker` reports (tensors saved for backward); not the transient `param.grad`.
    """

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.current = 0
        self.peak = 0
        self.num_over_budget = 0  # allocations that took `current` past the budget
        self.by_kind: Counter[str] = Counter()
        self.peak_by_kind: Counter[str] = Counter()  # the most each kind held at once

    def alloc(self, nbytes: int, kind: str) -> None:
        self.current += nbytes
        self.by_kind[kind] += nbytes
        self.peak_by_kind[kind] = max(self.peak_by_kind[kind], self.by_kind[kind])
        self.peak = max(self.peak, self.current)
        if self.budget_bytes is not None and self.current > self.budget_bytes:
            self.num_over_budget += 1

    def free(self, nbytes: int, kind: str) -> None:
        self.current -= nbytes
        self.by_kind[kind] -= nbytes
        assert self.current >= 0 and self.by_kind[kind] >= 0, "freed more than was allocated"

    def reset_peak(self) -> None:
        self.peak = self.current


class CollectiveCounter:
    """Number of collectives the store issued, by kind ("all_gather", "reduce_scatter")."""

    def __init__(self):
        self.counts: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()


class Chunk:
    """One chunk's buffers and state (see the module docstring)."""

    def __init__(self, layout: ChunkLayout, device: Residence):
        self.layout = layout
        self.device = device
        self.payload: torch.Tensor
        self.master: torch.Tensor
        self.grad: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        self.resident = False  # the payload holds the current weights
        self.pending: tuple | None = None  # (collective work or None, CUDA event or None) of a prefetch
        self.reducing: tuple | None = None  # (PendingReduceScatter, staging) of a reduce-scatter in flight
        self.grads_seen: set[str] = set()

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def requires_grad(self) -> bool:
        return self.layout.requires_grad

    def __repr__(self) -> str:
        return (
            f"Chunk({self.index}, capacity={self.layout.capacity}, params={len(self.layout.slots)}, "
            f"device={self.device.value}, resident={self.resident})"
        )


def module_params(module: torch.nn.Module) -> tuple[list[ParamSpec], dict[str, str], dict[str, torch.Tensor]]:
    """(specs in the model's order, tied name -> first name, values): `module`'s parameters, tied ones once."""
    first: dict[int, str] = {}
    specs, aliases, values = [], {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
            continue
        first[id(p)] = name
        specs.append(ParamSpec(name, tuple(p.shape), p.dtype, p.requires_grad))
        values[name] = p.detach()
    return specs, aliases, values


class ChunkStore:
    """Parameters packed into chunks; placement, gathering and gradient reduction per chunk.

    Args:
        specs: the parameters in the order the model uses them (one entry per distinct tensor).
        chunk_numel: chunk size in elements; None chooses it with :func:`choose_chunk_size`.
        compute_dtype: dtype of the payload the model computes with (bf16/fp16: mixed precision).
        master_dtype: dtype of the master weights, gradients and moments of trainable chunks.
        device: the compute device; default the current CUDA device if there is one, else the CPU.
        group: the data-axis process group; None (or size 1) stores every chunk whole.
        host: indices of chunks that start on the host.
        aliases: extra names of tied parameters, alias -> the name in `specs`.
        tracker, counter: shared accounting objects; new ones by default.
    """

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        *,
        chunk_numel: int | None = None,
        compute_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        host: Collection[int] = (),
        aliases: Mapping[str, str] | None = None,
        tracker: MemoryTracker | None = None,
        counter: CollectiveCounter | None = None,
    ):
        self.compute_dtype, self.master_dtype = compute_dtype, master_dtype
        self.device = torch.device(device) if device is not None else _default_device()
        self.group = group
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.tracker = tracker or MemoryTracker()
        self.counter = counter or CollectiveCounter()
        self.aliases = dict(aliases or {})
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        multiple = ALIGN_NUMEL * self.dp
        if chunk_numel is None:
            chunk_numel = choose_chunk_size([s.numel for s in specs], multiple=multiple)
        self.chunk_numel = chunk_numel
        self.layouts = pack(specs, chunk_numel, multiple=multiple)
        self.chunks = [Chunk(lay, Residence.HOST if lay.index in host else Residence.DEVICE) for lay in self.layouts]
        self._where: dict[str, tuple[Chunk, Slot]] = {}
        for chunk in self.chunks:
            for slot in chunk.layout.slots:
                self._where[slot.name] = (chunk, slot)
        unknown = [a for a, n in self.aliases.items() if n not in self._where]
        if unknown:
            raise ConfigError(f"aliases {unknown[:3]} point to parameters that are not in the specs")
        self.params: dict[str, torch.nn.Parameter] = {}
        for chunk in self.chunks:
            self._allocate(chunk)

    # ------------------------------------------------------------------------- building

    @classmethod
    def from_module(cls, module: torch.nn.Module, **kwargs) -> ChunkStore:
        """A store holding `module`'s parameters (tied ones once) with their current values.

        `kwargs` go to the constructor. The module is not changed; :meth:`bind` puts the views in.
        """
        specs, aliases, values = module_params(module)
        store = cls(specs, aliases=aliases, **kwargs)
        store.load_state(values)
        return store

    def load_state(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy full parameter values (by name) into the master shards and persistent payloads."""
        for name, value in values.items():
            chunk, slot = self._where[self.aliases.get(name, name)]
            flat = value.detach().reshape(-1)
            lo, hi = self._shard_range(chunk)
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                chunk.master.narrow(0, a - lo, b - a).copy_(flat[a - slot.offset : b - slot.offset])
            if self._persistent(chunk) and chunk.payload.data_ptr() != chunk.master.data_ptr():
                chunk.payload.data.narrow(0, slot.offset, slot.numel).copy_(flat)

    def bind(self, module: torch.nn.Module) -> None:
        """Replace `module`'s parameters (tied names included) with the store's views."""
        for name in list(self.params) + list(self.aliases):
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, self.params[self.aliases.get(name, name)])

    def _allocate(self, chunk: Chunk) -> None:
        cap, shard = chunk.layout.capacity, chunk.layout.capacity // self.dp
        chunk.payload = torch.empty(cap, dtype=self.compute_dtype, device=self.device)
        for slot in chunk.layout.slots:  # views need the storage at their full size to be made
            view = chunk.payload.narrow(0, slot.offset, slot.numel).view(slot.shape)
            self.params[slot.name] = torch.nn.Parameter(view, requires_grad=chunk.requires_grad)
        master_dtype = self.master_dtype if chunk.requires_grad else self.compute_dtype
        if self._persistent(chunk):
            self._account(chunk.device, chunk.payload, "payload")
            chunk.resident = True
            if master_dtype == self.compute_dtype:
                chunk.master = chunk.payload
            else:
                chunk.master = self._new(shard, master_dtype, chunk.device, "master")
        else:
            _free_storage(chunk.payload)
            chunk.master = self._new(shard, master_dtype, chunk.device, "master")
        chunk.master.zero_()
        if chunk.requires_grad:
            chunk.grad = self._new(shard, self.master_dtype, chunk.device, "grad").zero_()
            chunk.exp_avg = self._new(shard, self.master_dtype, chunk.device, "optim").zero_()
            chunk.exp_avg_sq = self._new(shard, self.master_dtype, chunk.device, "optim").zero_()

    # ------------------------------------------------------------------------- queries

    def chunk_of(self, name: str) -> Chunk:
        return self._where[self.aliases.get(name, name)][0]

    def slot_of(self, name: str) -> Slot:
        return self._where[self.aliases.get(name, name)][1]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def trainable_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.requires_grad]

    def waste(self) -> int:
        """Elements allocated per full copy but not holding a parameter."""
        return sum(lay.waste for lay in self.layouts)

    def _persistent(self, chunk: Chunk) -> bool:
        return self.dp == 1 and chunk.device == Residence.DEVICE

    def _shard_range(self, chunk: Chunk) -> tuple[int, int]:
        shard = chunk.layout.capacity // self.dp
        return self.rank * shard, (self.rank + 1) * shard

    # ------------------------------------------------------------------------- memory

    def _where_is(self, residence: Residence) -> torch.device:
        return self.device if residence == Residence.DEVICE else torch.device("cpu")

    def _new(self, numel: int, dtype: torch.dtype, residence: Residence, kind: str) -> torch.Tensor:
        pin = residence == Residence.HOST and self.device.type == "cuda"
        t = torch.empty(numel, dtype=dtype, device=self._where_is(residence), pin_memory=pin)
        self._account(residence, t, kind)
        return t

    def _account(self, residence: Residence, t: torch.Tensor, kind: str, free: bool = False) -> None:
        if residence == Residence.DEVICE:
            nbytes = t.numel() * t.element_size()
            (self.tracker.free if free else self.tracker.alloc)(nbytes, kind)

    def move(self, chunk: Chunk, where: Residence | str) -> None:
        """Move a chunk's persistent states (master, grad, moments) to the device or the host.

        The chunk must be idle: no staged gradients, no prefetch in flight, no gathered payload in use
        (a persistent payload follows the chunk).
        """
        where = Residence(where)
        if where == chunk.device:
            return
        if chunk.staging is not None or chunk.pending is not None or chunk.reducing is not None:
            raise LoweringError(
                f"chunk {chunk.index} has staged gradients, a prefetch or a reduce-scatter in "
                f"flight; reduce its gradients and wait for it before moving it"
            )
        if chunk.resident and not self._persistent(chunk):
            self.release(chunk)
        was_persistent, aliased = self._persistent(chunk), chunk.master is chunk.payload
        old = chunk.device
        for attr in ("master", "grad", "exp_avg", "exp_avg_sq"):
            t = getattr(chunk, attr)
            if t is None:
                continue
            kind = _STATE_KINDS[attr]
            new = self._new(t.numel(), t.dtype, where, kind)
            new.copy_(t)
            if not (attr == "master" and aliased):
                self._account(old, t, kind, free=True)
            setattr(chunk, attr, new)
        chunk.device = where
        if was_persistent:  # the payload becomes transient
            self._account(old, chunk.payload, "payload", free=True)
            _free_storage(chunk.payload)
            chunk.resident = False
        elif self._persistent(chunk):  # the payload becomes persistent
            self._materialize_local(chunk)
            if chunk.master.dtype == self.compute_dtype:
                self._account(where, chunk.master, "master", free=True)
                chunk.master = chunk.payload

    def _materialize_local(self, chunk: Chunk) -> None:
        _alloc_storage(chunk.payload)
        self._account(Residence.DEVICE, chunk.payload, "payload")
        chunk.payload.data.copy_(chunk.master)
        chunk.resident = True

    # ------------------------------------------------------------------------- gather / release

    def prefetch(self, chunk: Chunk) -> None:
        """Start materialising the chunk's full payload on the device (copy up, all-gather); see `wait`."""
        if chunk.resident or chunk.pending is not None:
            return
        _alloc_storage(chunk.payload)
        self._account(Residence.DEVICE, chunk.payload, "payload")
        stream = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with stream:
            lo, hi = self._shard_range(chunk)
            mine = chunk.payload.data.narrow(0, lo, hi - lo)
            mine.copy_(chunk.master, non_blocking=True)
            work = None
            if self.dp > 1:
                work = compat.all_gather_single(chunk.payload.data, mine, group=self.group, async_op=True)
                self.counter.add("all_gather")
            event = torch.cuda.Event() if self._copy_stream is not None else None
            if event is not None:
                event.record()
        chunk.pending = (work, event)

    def wait(self, chunk: Chunk) -> None:
        """Block until the chunk's prefetch is done; then its parameters hold the current weights."""
        if chunk.pending is None:
            return
        work, event = chunk.pending
        if work is not None:
            work.wait()
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        chunk.pending = None
        chunk.resident = True

    def gather(self, chunk: Chunk) -> None:
        """Materialise the chunk's full payload now (one all-gather when sharded)."""
        self.prefetch(chunk)
        self.wait(chunk)

    def release(self, chunk: Chunk) -> None:
        """Free a transient payload (a persistent one stays)."""
        if self._persistent(chunk):
            return
        self.wait(chunk)
        if chunk.resident:
            self._account(Residence.DEVICE, chunk.payload, "payload", free=True)
            _free_storage(chunk.payload)
            chunk.resident = False

    # ------------------------------------------------------------------------- gradients

    def add_grad(self, name: str, grad: torch.Tensor) -> Chunk:
        """Add a parameter's gradient into its chunk's staging buffer; returns the chunk."""
        chunk, slot = self._where[self.aliases.get(name, name)]
        if not chunk.requires_grad:
            raise LoweringError(f"parameter {name!r} is frozen (requires_grad=False) and has no gradient buffer")
        if chunk.staging is None:
            if self._persistent(chunk):
                chunk.staging = chunk.grad
            else:
                chunk.staging = self._new(chunk.layout.capacity, self.master_dtype, Residence.DEVICE, "staging")
                chunk.staging.zero_()
        chunk.staging.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1))
        chunk.grads_seen.add(slot.name)
        return chunk

    def collect_grads(self) -> None:
        """Move every parameter's `.grad` into the staging buffers (when no gradient hooks do it)."""
        for name, p in self.params.items():
            if p.grad is not None:
                self.add_grad(name, p.grad)
                p.grad = None

    def reduce_scatter_grads(self, chunk: Chunk, *, async_op: bool = False) -> None:
        """Average the staged gradients over dp and add this rank's shard into `chunk.grad`; free the staging.

        With `async_op` (dp > 1) the reduce-scatter is only issued: `finish_reduce` completes it.
        """
        staging, chunk.staging = chunk.staging, None
        chunk.grads_seen.clear()
        if staging is None or staging is chunk.grad:
            return
        if self.dp == 1:
            chunk.grad.add_(staging.to(chunk.grad.device))
            self._account(Residence.DEVICE, staging, "staging", free=True)
            return
        lo, hi = self._shard_range(chunk)
        out = self._new(hi - lo, staging.dtype, Residence.DEVICE, "staging")
        from autopar.runtime.collectives import issue_reduce_scatter  # the runtime imports this module

        self.counter.add("reduce_scatter")
        chunk.reducing = (issue_reduce_scatter(staging, self.group, out=out), staging)
        if not async_op:
            self.finish_reduce(chunk)

    def finish_reduce(self, chunk: Chunk) -> None:
        """Wait for the chunk's reduce-scatter in flight (if any), add this rank's averaged shard into
        `chunk.grad` and free the buffers it used."""
        if chunk.reducing is None:
            return
        pending, staging = chunk.reducing
        chunk.reducing = None
        out = pending.wait()
        out.mul_(1.0 / self.dp)
        chunk.grad.add_(out.to(chunk.grad.device))
        self._account(Residence.DEVICE, out, "staging", free=True)
        self._account(Residence.DEVICE, staging, "staging", free=True)

    def finish_grads(self, chunks: Iterable[Chunk] | None = None) -> None:
        """Reduce every chunk that still has staged gradients (issued in chunk order, the same on every rank), and
        complete every reduce-scatter in flight."""
        chunks = list(chunks if chunks is not None else self.chunks)
        for chunk in chunks:
            if chunk.staging is not None:
                self.reduce_scatter_grads(chunk, async_op=True)
        for chunk in chunks:
            self.finish_reduce(chunk)

    def zero_grad(self) -> None:
        for chunk in self.trainable_chunks():
            chunk.grad.zero_()

    # ------------------------------------------------------------------------- values

    def refresh_payloads(self) -> None:
        """After an optimizer step: copy masters into persistent payloads, drop stale transient ones."""
        for chunk in self.chunks:
            if self._persistent(chunk):
                if chunk.master is not chunk.payload:
                    chunk.payload.data.copy_(chunk.master)
            else:
                self.release(chunk)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameter values (fp32 masters for trainable chunks) under every name, on the CPU.

        Gathers sharded chunks (one all-gather each), so every rank must call it.
        """
        out = {}
        for chunk in self.chunks:
            full = chunk.master.detach().to("cpu")
            if self.dp > 1:
                buf = torch.empty(chunk.layout.capacity, dtype=full.dtype)
                compat.all_gather_single(buf, full, group=self.group)
                full = buf
            for slot in chunk.layout.slots:
                out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        for alias, name in self.aliases.items():
            out[alias] = out[name]
        return out


_STATE_KINDS = {"master": "master", "grad": "grad", "exp_avg": "optim", "exp_avg_sq": "optim"}


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())

"""Chunk layout: how parameters pack into fixed-size chunks of flat buffers, and which chunk size to use.

Terms:
- a *chunk* is a contiguous flat buffer of `capacity` elements holding whole parameters back to back
  (Colossal-AI's Gemini calls it the same); its `capacity` is a multiple of `multiple` (the data-axis
  size times an alignment), so that it splits into equal, aligned shards over the data axis (ZeRO-3);
- a *slot* is one parameter's place in a chunk: offset, number of elements, shape;
- *waste* is the number of elements a layout allocates but no parameter uses (chunk tails and the
  padding up to `multiple`).

Packing keeps the order it is given (the order the model uses its parameters, so that chunks are
gathered and prefetched in sequence) and fills one chunk at a time: a parameter that does not fit in
the open chunk closes it and opens the next. A parameter larger than the chunk size gets a chunk of
its own, sized to it (a parameter never spans chunks, so it is always one contiguous view of one
buffer; the open chunk stays open for the parameters after it). The last chunk of a group is shrunk
to what it holds. Trainable and frozen parameters go to separate chunks: frozen chunks carry no
gradients and no optimizer states (LoRA's base weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.errors import ConfigError

# A chunk is the unit of a collective and of a host<->device copy; below about a million elements
# (4 MB in fp32) the fixed cost of each (tens of microseconds) starts to dominate its transfer time.
MIN_CHUNK_NUMEL = 1 << 20
# Above this a chunk is a large share of what a device holds at once, and prefetching it is coarse.
MAX_CHUNK_NUMEL = 1 << 26
# Shards start at multiples of 16 elements (64 bytes in fp32): vector loads stay aligned on every rank.
ALIGN_NUMEL = 16
# Wastes this close (as a fraction of all elements) to the least count as equal in the size search.
WASTE_TOLERANCE = 0.005
# Geometric grid of candidate chunk sizes: 8 steps per doubling.
_GRID_STEPS_PER_OCTAVE = 8
# Run sums of consecutive parameters are candidate sizes (a transformer layer packs with no waste);
# past this many candidates the run sums are thinned to keep the search to a fraction of a second.
_MAX_CANDIDATES = 1024


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter to pack: its (first) name, shape, dtype, and whether it trains."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool = True

    def __post_init__(self):
        if any(s < 0 for s in self.shape):
            raise ConfigError(f"parameter {self.name!r} has a negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one parameter lives in its chunk."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """One chunk: its capacity in elements and the slots it holds, in order."""

    index: int
    capacity: int
    slots: tuple[Slot, ...]
    requires_grad: bool

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def waste(self) -> int:
        return self.capacity - self.used


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack(specs: Sequence[ParamSpec], chunk_numel: int, *, multiple: int = ALIGN_NUMEL) -> tuple[ChunkLayout, ...]:
    """Pack parameters into chunks of `chunk_numel` elements (see the module docstring for the rules).

    Args:
        specs: the parameters in the order they are used; names must be unique (store tied weights once).
        chunk_numel: the chunk size in elements; rounded up to `multiple`.
        multiple: every capacity is a multiple of it (data-axis size times the alignment for ZeRO-3).

    Returns:
        The chunks, ordered by their first parameter's position in `specs`.
    """
    if chunk_numel < 1 or multiple < 1:
        raise ConfigError(f"chunk_numel and multiple must be positive; got {chunk_numel} and {multiple}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"parameter names must be unique to pack them; repeated: {dup[:5]}")
    chunk_numel = round_up(chunk_numel, multiple)
    placed: list[tuple[int, ChunkLayout]] = []  # (position of first parameter, chunk)
    for requires_grad in (True, False):
        group = [(i, s) for i, s in enumerate(specs) if s.requires_grad == requires_grad]
        placed.extend(_pack_group(group, chunk_numel, multiple, requires_grad))
    placed.sort(key=lambda t: t[0])
    return tuple(
        ChunkLayout(index=i, capacity=c.capacity, slots=c.slots, requires_grad=c.requires_grad)
        for i, (_, c) in enumerate(placed)
    )


def _pack_group(group, chunk_numel: int, multiple: int, requires_grad: bool) -> list[tuple[int, ChunkLayout]]:
    out: list[tuple[int, ChunkLayout]] = []
    open_slots: list[Slot] = []
    open_first, used = -1, 0

    def close(shrink: bool) -> None:
        if open_slots:
            cap = round_up(used, multiple) if shrink else chunk_numel
            out.append((open_first, ChunkLayout(-1, cap, tuple(open_slots), requires_grad)))

    for pos, spec in group:
        n = spec.numel
        if n > chunk_numel:  # a chunk of its own, sized to the parameter
            slot = Slot(spec.name, spec.shape, 0, n)
            out.append((pos, ChunkLayout(-1, round_up(max(n, 1), multiple), (slot,), requires_grad)))
            continue
        if used + n > chunk_numel:
            close(shrink=False)
            open_slots, used = [], 0
        if not open_slots:
            open_first = pos
        open_slots.append(Slot(spec.name, spec.shape, used, n))
        used += n
    close(shrink=True)
    return out


def packing_waste(sizes: Sequence[int], chunk_numel: int, *, multiple: int = ALIGN_NUMEL) -> int:
    """Elements a packing of parameters with these sizes (in order, one group) allocates but does not use."""
    return _packing_stats(sizes, chunk_numel, multiple)[0]


def _packing_stats(sizes: Sequence[int], chunk_numel: int, multiple: int) -> tuple[int, int]:
    """(waste, number of chunks) of packing `sizes` as :func:`pack` does."""
    chunk_numel = round_up(chunk_numel, multiple)
    waste, used, num_chunks = 0, 0, 0
    for n in sizes:
        if n > chunk_numel:
            waste += round_up(max(n, 1), multiple) - n
            num_chunks += 1
            continue
        if used + n > chunk_numel:
            waste += chunk_numel - used
            used = 0
        if used == 0:
            num_chunks += 1
        used += n
    return waste + (round_up(used, multiple) - used if used else 0), num_chunks


def choose_chunk_size(
    sizes: Sequence[int],
    candidates: Sequence[int] | None = None,
    *,
    min_numel: int = MIN_CHUNK_NUMEL,
    max_numel: int = MAX_CHUNK_NUMEL,
    multiple: int = ALIGN_NUMEL,
    waste_tolerance: float = WASTE_TOLERANCE,
) -> int:
    """The chunk size (elements) with the least packing waste for parameters of these sizes.

    Args:
        sizes: numbers of elements of the parameters, in packing order (pass trainable and frozen
            parameters separately, or together as an approximation).
        candidates: sizes to try; by default a geometric grid from `min_numel` to `max_numel` plus
            the sums of runs of consecutive parameters within those bounds (a repeated layer's total
            is a size with no waste).
        min_numel, max_numel: bounds on the size; chunks below `min_numel` would make each
            collective and copy latency-bound. Candidates outside them are dropped.
        multiple: capacities are rounded up to it (see :func:`pack`).
        waste_tolerance: wastes within this fraction of the total of the least one count as equal;
            among those the size giving the fewest chunks wins (fewer, larger collectives; and
            below the largest tensors every size has no waste, each tensor being its own chunk),
            then the smallest size.

    Returns:
        A size in `[min_numel, max_numel]`, rounded up to `multiple`.
    """
    if min_numel < 1 or max_numel < min_numel:
        raise ConfigError(f"need 1 <= min_numel <= max_numel; got min_numel={min_numel}, max_numel={max_numel}")
    sizes = [int(n) for n in sizes]
    pool = list(candidates) if candidates is not None else _default_candidates(sizes, min_numel, max_numel)
    pool = sorted({round_up(c, multiple) for c in pool if min_numel <= c <= max_numel})
    if not pool:
        raise ConfigError(f"no candidate chunk size lies in [{min_numel}, {max_numel}]; widen the bounds")
    stats = {c: _packing_stats(sizes, c, multiple) for c in pool}
    least = min(w for w, _ in stats.values())
    slack = waste_tolerance * sum(sizes)
    return min((c for c in pool if stats[c][0] <= least + slack), key=lambda c: (stats[c][1], c))


def _default_candidates(sizes: list[int], lo: int, hi: int) -> list[int]:
    grid, c = [], float(lo)
    while c <= hi:
        grid.append(int(c))
        c *= 2 ** (1 / _GRID_STEPS_PER_OCTAVE)
    runs: set[int] = set()
    for i in range(len(sizes)):
        total = 0
        for n in sizes[i:]:
            total += n
            if total > hi:
                break
            if total >= lo:
                runs.add(total)
    extra = sorted(runs)
    if len(extra) > _MAX_CANDIDATES:
        stride = len(extra) / _MAX_CANDIDATES
        extra = [extra[int(k * stride)] for k in range(_MAX_CANDIDATES)]
    return grid + extra


# Device bytes the offload program's chunks in flight may take, as a fraction of its budget: about two gathered
# payloads (the one in use and the one prefetched) and two gradient staging buffers, each at most 1/16 of it.
CHUNK_SHARE_OF_BUDGET = 16


def offload_chunk_numel(sizes: Sequence[int], *, dp: int, budget_bytes: float, compute_itemsize: int) -> int:
    """The chunk size (elements) the offload program packs parameters of these sizes into on a data axis of `dp`
    ranks, its device holding at most `budget_bytes`: the size with the least waste (`choose_chunk_size`) between
    MIN_CHUNK_NUMEL and MAX_CHUNK_NUMEL, and small enough that one payload (in the compute dtype,
    `compute_itemsize` bytes an element) and its fp32 gradient staging take at most 1/CHUNK_SHARE_OF_BUDGET of the
    budget. The solver prices the program's collectives on the chunks `pack` makes of it."""
    multiple = ALIGN_NUMEL * dp
    per_elem = compute_itemsize + torch.float32.itemsize  # payload + gradient staging
    cap = max(multiple, int(budget_bytes / (CHUNK_SHARE_OF_BUDGET * per_elem)))
    return choose_chunk_size(
        sizes, min_numel=min(MIN_CHUNK_NUMEL, cap), max_numel=min(MAX_CHUNK_NUMEL, cap), multiple=multiple
    )

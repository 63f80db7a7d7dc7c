"""The sharded program's gathers of split weights, one all-gather per layer.

A parameter split over the data axis (ZeRO >= 1) is gathered whole where an op reads it. The program gathers a
layer's split parameters together, as FSDP gathers one flat buffer per layer: the split trainable parameters are
grouped by layer (`layer_groups`: the repeated layer of `autopar.trace.layer_of_param`, the one the planner prices a
layer's gather for; a parameter outside repeated layers is a group of its own), in the order the graph first reads
them. When an op needs a parameter that no gather has brought yet, one all-gather brings its whole group
(`GroupGather`): each member's padded local piece (`split_gather`'s layout, `autopar.runtime.overlap.padded_piece`:
`torch.chunk`'s pieces padded to the longest, the split dim first) is packed into one flat send buffer, the ranks'
buffers are gathered into one, and each member's whole is cut out of it (`whole_from_pieces`) when its op takes
it. The gathered values are those `split_gather` gives, bit for bit.

Which members a gather brings (the same on every rank, so every rank issues the same collectives in the same
order): in a forward, those of the group not gathered yet in this forward; in a backward, those whose weight it
needs again (a recompute segment's parameters, a ZeRO-3 weight released after the forward) and has not gathered
yet in this backward; none that a gather issued ahead or a ZeRO-1/2 step's kept weight already holds. A member
that is read twice in one pass (a shared weight) is gathered alone for its second read.

`LayerGathers` holds the groups and the gathers not yet taken for `autopar.runtime.sharded.ShardedProgram`;
the prefetch of the next groups (`autopar.runtime.sharded_overlap`) issues the same group gathers asynchronously.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from autopar import compat
from autopar.runtime import overlap
from autopar.trace import layer_of_param


def layer_groups(names: Sequence[str]) -> list[list[int]]:
    """Positions in `names` (parameter names) grouped by the repeated layer each belongs to, the layer the planner
    prices one gather for (`autopar.trace.layer_of_param`); a name outside repeated layers is a group of its own.
    Groups come in the order of their first member, members in the order of `names`."""
    groups: dict[object, list[int]] = {}
    for k, name in enumerate(names):
        layer = layer_of_param(name)
        groups.setdefault(layer if layer[0] is not None else name, []).append(k)
    return list(groups.values())


class GroupGather:
    """One all-gather over `group` of several tensors split over it, `locals_[k]` being this rank's piece of member
    k (split on `dims[k]`, whole length `sizes[k]`), all of one dtype and device. `whole(k)` gives member k whole
    (after the wait, with `async_op`)."""

    def __init__(self, locals_: list[torch.Tensor], dims: list[int], sizes: list[int], group, *, async_op: bool):
        self.parts = dist.get_world_size(group)
        pieces = [overlap.padded_piece(t, d, n, self.parts) for t, d, n in zip(locals_, dims, sizes, strict=True)]
        self.layout: list[tuple[int, int, int, torch.Size]] = []  # (offset, dim, size, padded piece shape)
        offset = 0
        for piece, dim, size in zip(pieces, dims, sizes, strict=True):
            self.layout.append((offset, dim, size, piece.shape))
            offset += piece.numel()
        self.total = offset
        send = locals_[0].new_empty(self.total)
        for piece, (offset, _, _, shape) in zip(pieces, self.layout, strict=True):
            send[offset : offset + piece.numel()].view(shape).copy_(piece)
        self.out = send.new_empty(self.parts * self.total)
        self._left = len(self.layout)  # members not taken yet: the gathered buffer is freed with the last
        self.work = compat.all_gather_single(self.out, send, group=group, async_op=async_op)

    def wait(self) -> None:
        """Wait for the gather (once; later calls return at once)."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def whole(self, k: int) -> torch.Tensor:
        """Member k whole (each member taken once): every rank's padded piece in rank order, cut to its length, the
        split dim put back; a tensor of its own unless the gather had one member."""
        self.wait()
        offset, dim, size, shape = self.layout[k]
        rows = self.out.view(self.parts, self.total)[:, offset : offset + shape.numel()]
        whole = overlap.whole_from_pieces(rows.reshape(self.parts * shape[0], *shape[1:]), dim, size)
        self._left -= 1
        if not self._left:
            self.out = None
        return whole


class LayerGathers:
    """The layer groups and group gathers of a `ShardedProgram` (a mixin of it: see the module docstring)."""

    def _setup_layer_gathers(self, placeholders: list[str], kinds) -> None:
        """Groups of split trainable parameters by layer, in the order the graph first reads them."""
        graph = self.traced.graph_module.graph
        position = {node: k for k, node in enumerate(graph.nodes)}
        first_use = {}
        for node, kind in zip((n for n in graph.nodes if n.op == "placeholder"), kinds, strict=True):
            i = self._index_of.get(node.name) if kind == "param" else None
            if i is not None and node.users and self._split_dim[i] is not None and self.shards[i].requires_grad:
                first_use[i] = min(position[u] for u in node.users)
        order = sorted(first_use, key=first_use.get)
        self._groups = [[order[k] for k in group] for group in layer_groups([self._param_names[i] for i in order])]
        self._group_of = {i: g for g, members in enumerate(self._groups) for i in members}
        # parameter index -> (its group's gather, its place in it): gathered (or in flight) and not taken yet
        self._prefetched: dict[int, tuple[GroupGather, int]] = {}
        self._sources: list[torch.Tensor | None] = [None] * len(self._param_names)  # this step's local pieces
        self._pass_backward = False  # whether the pass `_pass_gathered` is of is a backward
        self._pass_gathered: set[int] = set()  # parameters gathered in this forward (backward)

    def _new_pass(self) -> None:
        """A forward starts: no parameter is gathered in it yet."""
        self._pass_backward = False
        self._pass_gathered = set()

    def _check_pass(self) -> None:
        if self._pass_backward != self._in_backward:
            self._pass_backward = self._in_backward
            self._pass_gathered = set()

    def _wanted(self, j: int) -> bool:
        """Whether a gather of split parameter j's group brings j too (see the module docstring)."""
        if j in self._prefetched or j in self._held or j in self._pass_gathered or self._sources[j] is None:
            return False
        if self._in_backward:
            return j not in self._regathered and (j in self._recomputed or bool(self._handles.get(j)))
        return True

    def _issue_gather(self, members: list[int], event: str, *, async_op: bool) -> None:
        """One all-gather of `members`' pieces (`_sources`; one per dtype, should they differ), recorded as `event`
        with its first member's name; what it brings waits in `_prefetched` until taken."""
        self._check_pass()
        self._pass_gathered.update(members)
        runs: dict[tuple, list[int]] = {}
        for j in members:
            runs.setdefault((self._sources[j].dtype, self._sources[j].device), []).append(j)
        for run in runs.values():
            self._record(event, self._param_names[run[0]])
            dims = [self._split_dim[j] for j in run]
            gathered = GroupGather(
                [self._sources[j] for j in run],
                dims,
                [self._shapes[j][d] for j, d in zip(run, dims, strict=True)],
                self._dp_group,
                async_op=async_op,
            )
            for k, j in enumerate(run):
                self._prefetched[j] = (gathered, k)

    def _group_members(self, g: int) -> list[int]:
        """The members of group g a gather of it brings now."""
        self._check_pass()
        return [j for j in self._groups[g] if self._wanted(j)]

    def _whole(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Split parameter i whole: brought by a gather issued before (its group's, or one ahead), else by its
        group's gather issued now."""
        ready = self._prefetched.pop(i, None)
        if ready is None:
            self._check_pass()
            if self._sources[i] is None:
                self._sources[i] = local.detach()
            g = self._group_of.get(i)
            others = [j for j in self._groups[g] if j != i and self._wanted(j)] if g is not None else []
            self._issue_gather([i, *others], "gather", async_op=False)
            ready = self._prefetched.pop(i)
        gathered, k = ready
        return gathered.whole(k)

    def _drop_prefetched(self) -> None:
        """Wait for gathers nothing took (issued ahead of a forward that stopped early) and forget them."""
        if not getattr(self, "_prefetched", None):  # a program without split parameters gathers nothing
            return
        for gathered, _ in self._prefetched.values():
            gathered.wait()
        self._prefetched.clear()


__all__ = ["GroupGather", "LayerGathers", "layer_groups"]

"""Collective communication time: the alpha-beta model of ring algorithms.

A collective over n ranks runs as a number of steps; each step pays the link's latency
(alpha) and the collective moves some bytes through every rank's link, priced at the link's
bus bandwidth (1/beta):

    time = steps · alpha + moved_bytes / bandwidth

with S the size of the full (unsharded) tensor:

| collective      | moved bytes per rank | steps  |
|-----------------|----------------------|--------|
| all-reduce      | 2(n-1)/n · S         | 2(n-1) |
| all-gather      | (n-1)/n · S          | n-1    |
| reduce-scatter  | (n-1)/n · S          | n-1    |
| all-to-all      | (n-1)/n² · S         | n-1    |
| broadcast       | (n-1)/n · S          | n-1    |
| send/recv       | S                    | 1      |

The moved-bytes factors are the ones nccl-tests uses to turn times into bus bandwidth, so a
link's `bandwidth_bytes_per_s` is directly the bus bandwidth those tests report. In an
all-to-all each rank holds a shard of S/n and keeps 1/n of it, so it sends (n-1)/n of its own
shard, (n-1)/n² of the whole tensor: nccl-tests' alltoall busbw is (n-1)/n times the per-rank
buffer over the time. Broadcast is priced like an all-gather (a pipelined ring broadcast).

That per-step model is how a measured link is priced (gloo between CPU ranks, whose figures
`calibrate` fits to it). A GPU cluster's mesh axes are priced as NCCL runs them instead:
`ClusterSpec.link_for_axis` hands a `cost_model.nccl.GroupLink` (the group's ranks per node,
the node's NICs), and all-reduce, all-gather, reduce-scatter and broadcast on it take the
cheapest of NCCL's algorithms and protocols, with one latency per call (`cost_model.nccl`).
All-to-all and send/recv are point-to-point in NCCL, outside its tuning model: on a group
link they keep the per-step model, on one adapter across nodes (an all-to-all cannot
aggregate the NICs of a node; sjeaugey, NVIDIA/nccl-tests#267) and on NVLink inside one.
So does a collective the slowest link carries a measurement of (`per_collective`): a
measurement replaces the model.

A link's figures are fitted to all-reduces; where a backend runs another collective well off that price
(gloo's all-gather and reduce-scatter on CPU ranks), the link carries that collective's own fitted latency
and bandwidth (`LinkSpec.per_collective`), used in the same formula.
"""

from __future__ import annotations

from enum import StrEnum

from autopar.cost_model.devices import LinkSpec
from autopar.cost_model.nccl import GroupLink
from autopar.errors import ConfigError


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


def collective_steps(kind: Collective, num_ranks: int) -> int:
    """Latency-bound steps of the ring algorithm of `kind` over `num_ranks` ranks."""
    if num_ranks <= 1:
        return 0
    if kind == Collective.ALL_REDUCE:
        return 2 * (num_ranks - 1)
    if kind == Collective.SEND_RECV:
        return 1
    return num_ranks - 1


def collective_moved_bytes(kind: Collective, num_bytes: float, num_ranks: int) -> float:
    """Bytes each rank sends (and receives) for a collective on a full tensor of `num_bytes`."""
    if num_ranks <= 1:
        return 0.0
    if kind == Collective.ALL_REDUCE:
        return 2.0 * (num_ranks - 1) / num_ranks * num_bytes
    if kind == Collective.SEND_RECV:
        return float(num_bytes)
    if kind == Collective.ALL_TO_ALL:
        return (num_ranks - 1) / num_ranks**2 * num_bytes
    return (num_ranks - 1) / num_ranks * num_bytes


# the collectives NCCL's tuning model prices (src/graph/tuning.cc); the others are point-to-point
_TUNED = frozenset({Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.BROADCAST})


def estimate_collective_time(kind: Collective, num_bytes: float, num_ranks: int, link: LinkSpec | GroupLink) -> float:
    """Seconds for collective `kind` on a tensor of `num_bytes` (full, unsharded size) over `num_ranks` ranks.

    Args:
        kind: which collective.
        num_bytes: size of the full tensor: the all-reduced tensor, the gathered result, the
            input of a reduce-scatter, the whole tensor an all-to-all re-splits (the sum of
            every rank's shard), the tensor sent.
        num_ranks: ranks taking part; 1 costs nothing.
        link: the slowest link the ranks' ring crosses (priced per ring step), or the group's `GroupLink`
            (priced as NCCL runs the collective on that group's topology).
    """
    kind = Collective(kind)
    if num_ranks < 1:
        raise ConfigError(f"a collective needs at least one rank, got num_ranks={num_ranks}")
    if num_bytes < 0:
        raise ConfigError(f"a collective cannot move a negative number of bytes ({num_bytes})")
    if num_ranks == 1:
        return 0.0
    if isinstance(link, GroupLink):
        measured = any(k == kind.value for k, _, _ in link.per_collective)
        if kind in _TUNED and not measured:
            return link.collective_time_s(kind.value, num_bytes, num_ranks)
        link = link.slowest
    latency, bandwidth = link.alpha_beta(kind.value)
    return collective_steps(kind, num_ranks) * latency + collective_moved_bytes(kind, num_bytes, num_ranks) / bandwidth

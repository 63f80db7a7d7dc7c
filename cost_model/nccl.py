"""Collectives priced as NCCL prices them: algorithm and protocol by size, per hop type, on the group's topology.

NCCL picks, for every call, the (algorithm, protocol) pair its own model says is fastest, and that model is
`src/graph/tuning.cc` in NVIDIA/nccl (`ncclTopoTuneModel`, `ncclTopoGetAlgoTime`; read at 5067397c, 2025). This
module follows it term by term:

    time = latency(algorithm, protocol) + bytes / bandwidth(algorithm, protocol)

over the algorithms NCCL runs on a node with NVLink and InfiniBand and no in-network reduction: ring (every
collective), tree (all-reduce only) and PAT (all-gather and reduce-scatter on one rank per node). NVLink SHARP
(NVLS) and CollNet are not modelled, so an H100 node's all-reduce is priced on rings, below the ~480 GB/s NVLS
reaches (sjeaugey, NVIDIA/nccl-tests#212).

Latency (`_latency_s`), in NCCL's own figures (`ncclTunerConstantsDefaults`, µs): a base per (algorithm,
protocol) plus a per-hop latency by hop type (NVLink inside a node, the network across nodes):

- ring: base + (steps - inter_steps) · max(NVLink hop, network overhead) + inter_steps · network hop, with
  steps = 2(n-1) for an all-reduce and n-1 for all-gather and reduce-scatter, inter_steps the same counts over
  nodes (2(N-1), N-1). The network overhead is NCCL's per-post cost of a network send on the host CPU, 1 µs on
  Intel and 2 µs on AMD hosts, tripled for the Simple protocol. Across nodes a large (Simple) all-reduce's
  latency is multiplied by 1.4 (NCCL's "plateau effect of ring", sm80 and newer).
- tree (all-reduce): base + 2((ppn-1) · NVLink hop + log2(N) · network hop), ppn the group's ranks per node.
- PAT: base + log2(N) · network hop / 3.5 + 2.8 µs · n.
- With one rank per node NCCL prices the network hop at the tree's figure for every algorithm.

Bandwidth (`_bus_bandwidth`): the group's bus bandwidth B (below) times NCCL's per-protocol factors: LL 0.5
(capped by `ll_max_bandwidth`), LL128 0.92, Simple 1; tree all-reduce 0.92 on top, then NCCL's tree correction
by size (`treeCorrectionFactor`) and its conversion to algorithm bandwidth (0.5 for tree, n/steps for ring:
an all-reduce of S bytes on a ring moves 2(n-1)/n·S through each rank's link). PAT runs at 0.75 B. The
per-channel caps of the tuning model (`perChMax*`) are left out: they bound few-channel graphs, and the
groups priced here run 8 to 32 channels (NVIDIA/nccl-tests#100 shows 24 on a DGX A100), above every cap.

B, the bus bandwidth a group reaches, is where the topology enters (`GroupLink.bus_bandwidth`): inside a node
it is the NVLink figure, the all-reduce bus bandwidth nccl-tests measure there; across nodes NCCL runs a
channel per NIC, so a group with ppn ranks on each of N nodes reaches min(ppn, NICs per node) NICs' worth,
capped by the NVLink figure the ring also crosses inside each node:

    B = min(nvlink, min(ppn, nics_per_node) · nic)

nic being one adapter's achieved bandwidth. For tree on at most two nodes NCCL prices the intra-node graph's
bandwidth (`nNodes <= 2 ? bwIntra : bwInter`): the tree sends each byte once between the two nodes.

What differs from NCCL's own model: B comes from measured bus bandwidths (nccl-tests) rather than NCCL's
topology search, whose line-rate figures are higher; latencies are NCCL's estimates, not measurements. The
report `examples/reports/calibration.md` sets these prices next to published nccl-tests results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from autopar.errors import ConfigError

if TYPE_CHECKING:  # devices imports this module
    from autopar.cost_model.devices import LinkSpec

_US = 1e-6


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"
    PAT = "pat"


class Protocol(StrEnum):
    LL = "ll"
    LL128 = "ll128"
    SIMPLE = "simple"


# tuning.cc `baseLatencies` (µs), per algorithm (LL, LL128, Simple)
BASE_LATENCY_US = {
    Algorithm.TREE: (6.8, 14.0, 8.4),
    Algorithm.RING: (6.6, 14.0, 8.4),
    Algorithm.PAT: (8.0, 8.0, 8.0),
}
# tuning.cc `hwLatencies` (µs) for the NVLink and network hop types, per algorithm (LL, LL128, Simple)
NVLINK_HOP_US = {
    Algorithm.TREE: (0.6, 1.25, 4.0),
    Algorithm.RING: (0.6, 1.9, 3.4),
    Algorithm.PAT: (0.0, 0.0, 4.0),
}
NET_HOP_US = {
    Algorithm.TREE: (5.0, 8.5, 14.0),
    Algorithm.RING: (2.7, 4.0, 14.0),
    Algorithm.PAT: (0.0, 0.0, 14.0),
}
# tuning.cc `treeCorrectionFactor`: tree all-reduce bandwidth by log2(bytes / 64), 64 B to 256 MB, per protocol
TREE_CORRECTION = {
    Protocol.LL: (
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.7,
        0.7,
        0.7,
        0.7,
        0.6,
        0.5,
        0.4,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
    ),
    Protocol.LL128: (
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.8,
        0.8,
        0.7,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.8,
        0.9,
        0.9,
        0.9,
        0.9,
        1.0,
        1.0,
        1.0,
    ),
    Protocol.SIMPLE: (
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.8,
        0.7,
        0.6,
        0.6,
        0.5,
        0.5,
        0.5,
        0.5,
        0.6,
        0.7,
        0.8,
        0.7,
        0.7,
        0.8,
        0.9,
        0.9,
        0.9,
    ),
}
_PROTOCOL_INDEX = {Protocol.LL: 0, Protocol.LL128: 1, Protocol.SIMPLE: 2}
# tuning.cc: LL moves 8 bytes of data in 16 on the wire; LL128 120 in 128 (0.92 as NCCL writes it)
LL_SHARE = 0.5
LL128_SHARE = 0.92
TREE_ALLREDUCE_SHARE = 0.92
PAT_SHARE = 0.75
# tuning.cc: with Simple over the network, the per-post overhead is paid three times
SIMPLE_NET_OVERHEAD_TIMES = 3
# ncclTopoGetAlgoTime applies the ring plateau from 64 bytes per channel and rank; the channel count is NCCL's
# topology search's, 24 on a DGX A100 (NVIDIA/nccl-tests#100 logs "Channel 23/24"), taken for every node here
PLATEAU_BYTES_PER_CHANNEL = 64
RING_CHANNELS = 24


@dataclass(frozen=True, slots=True)
class NcclNode:
    """What NCCL's tuning model assumes of a node besides its link speeds (tuning.cc, by GPU generation and host).

    Fields:
        name: the preset's name ("ampere-amd").
        ll_max_bandwidth_bytes_per_s: the LL protocol's bus-bandwidth cap (`llMaxBws`) on one node, on two
            nodes and on more: on one node it depends on the GPU generation, across nodes on the host CPU.
        net_overhead_s: NCCL's cost of posting one network send on the host (`getNetOverhead`): 1 µs on Intel
            hosts, 2 µs on AMD ones.
        ring_plateau: the factor on a Simple ring all-reduce's latency across nodes (1.4 on sm80 and newer).
    """

    name: str
    ll_max_bandwidth_bytes_per_s: tuple[float, float, float]
    net_overhead_s: float
    ring_plateau: float = 1.4

    def __post_init__(self):
        caps = self.ll_max_bandwidth_bytes_per_s
        if len(caps) != 3 or any(not isinstance(c, (int, float)) or c <= 0 for c in caps):
            raise ConfigError(
                f"nccl node {self.name!r}: ll_max_bandwidth_bytes_per_s must be three positive rates "
                f"(one node, two nodes, more), got {caps!r}"
            )
        if not isinstance(self.net_overhead_s, (int, float)) or self.net_overhead_s < 0:
            raise ConfigError(f"nccl node {self.name!r}: net_overhead_s must be >= 0, got {self.net_overhead_s!r}")
        if not isinstance(self.ring_plateau, (int, float)) or self.ring_plateau < 1:
            raise ConfigError(f"nccl node {self.name!r}: ring_plateau must be >= 1, got {self.ring_plateau!r}")

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "ll_max_bandwidth_bytes_per_s": list(self.ll_max_bandwidth_bytes_per_s),
            "net_overhead_s": self.net_overhead_s,
            "ring_plateau": self.ring_plateau,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> NcclNode:
        if isinstance(d, NcclNode):
            return d
        known = {"name", "ll_max_bandwidth_bytes_per_s", "net_overhead_s", "ring_plateau"}
        if not isinstance(d, Mapping) or not {"name", "ll_max_bandwidth_bytes_per_s", "net_overhead_s"} <= set(d):
            raise ConfigError(f"nccl node: expected a mapping with the fields {sorted(known)}, got {d!r}")
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"nccl node: unknown fields {sorted(unknown)}; known fields are {sorted(known)}")
        return cls(
            name=str(d["name"]),
            ll_max_bandwidth_bytes_per_s=tuple(float(v) for v in d["ll_max_bandwidth_bytes_per_s"]),
            net_overhead_s=float(d["net_overhead_s"]),
            ring_plateau=float(d.get("ring_plateau", 1.4)),
        )


# tuning.cc `llMaxBws` (GB/s): one node by GPU generation (Ampere 87.7, Hopper 141), across nodes by host CPU
# (Intel 39.0 on two nodes and 20.4 on more; AMD 22.5 and 19.0); `getNetOverhead`: Intel 1 µs, AMD 2 µs.
# DGX A100 hosts are AMD EPYC 7742, DGX H100/H200 hosts Intel Xeon 8480C (NVIDIA DGX datasheets).
NCCL_AMPERE_AMD = NcclNode("ampere-amd", (87.7e9, 22.5e9, 19.0e9), 2e-6)
NCCL_HOPPER_INTEL = NcclNode("hopper-intel", (141.0e9, 39.0e9, 20.4e9), 1e-6)


def _protocol_figure(table: Mapping, algorithm: Algorithm, protocol: Protocol) -> float:
    return table[algorithm][_PROTOCOL_INDEX[protocol]]


def _algorithms(kind: str, ranks_per_node: int, num_nodes: int) -> tuple[Algorithm, ...]:
    """What NCCL may run for `kind` (tuning.cc: tree for all-reduce only, PAT with one rank per node)."""
    if kind == "all_reduce":
        return (Algorithm.RING, Algorithm.TREE)
    if kind in ("all_gather", "reduce_scatter") and ranks_per_node == 1 and num_nodes > 1:
        return (Algorithm.RING, Algorithm.PAT)
    return (Algorithm.RING,)


def _steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1 if kind in ("all_gather", "reduce_scatter") else n


@dataclass(frozen=True, slots=True)
class GroupLink:
    """The links one mesh axis's groups cross, with the shape NCCL sees: ranks per node, NICs per node.

    `link_for_axis` of a GPU cluster returns one; `cost_model.comm.estimate_collective_time` prices it with
    `collective_time_s`. `bandwidth_bytes_per_s` and `latency_s` summarise it for reports (the bus bandwidth
    of a large collective, one latency of a small all-reduce's cheapest algorithm).

    Fields:
        ranks_per_node: the group's ranks on each node it spans (the whole group when it stays in a node).
        num_nodes: nodes the group spans.
        nvlink: the link inside a node (its bandwidth: the all-reduce bus bandwidth nccl-tests measure there).
        nic: one network adapter (its bandwidth: the adapter's achieved rate).
        nics_per_node: the adapters of a node that collectives use.
        node: the NCCL constants of the node (GPU generation, host CPU).
    """

    ranks_per_node: int
    num_nodes: int
    nvlink: LinkSpec
    nic: LinkSpec
    nics_per_node: int
    node: NcclNode

    def __post_init__(self):
        for name in ("ranks_per_node", "num_nodes", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"group link: {name} must be a positive integer, got {value!r}")

    @property
    def num_ranks(self) -> int:
        return self.ranks_per_node * self.num_nodes

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1

    @property
    def name(self) -> str:
        if not self.crosses_nodes:
            return self.nvlink.name
        nics = min(self.ranks_per_node, self.nics_per_node)
        return f"{self.nic.name} x{nics} ({self.ranks_per_node} per node)"

    @property
    def slowest(self) -> LinkSpec:
        """The physical link a group's ring is paced by: the adapter across nodes, NVLink inside one."""
        return self.nic if self.crosses_nodes else self.nvlink

    @property
    def per_collective(self) -> tuple[tuple[str, float, float], ...]:
        """Collectives measured on their own on the slowest link (`LinkSpec.per_collective`): a measurement
        replaces NCCL's model for them (`cost_model.comm.estimate_collective_time`)."""
        return self.slowest.per_collective

    @property
    def bus_bandwidth(self) -> float:
        """B: bytes/s the group's ring moves through each rank (see the module docstring)."""
        if not self.crosses_nodes:
            return self.nvlink.bandwidth_bytes_per_s
        nics = min(self.ranks_per_node, self.nics_per_node)
        return min(self.nvlink.bandwidth_bytes_per_s, nics * self.nic.bandwidth_bytes_per_s)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bus_bandwidth

    @property
    def latency_s(self) -> float:
        return self.collective_time_s("all_reduce", 0.0, self.num_ranks) if self.num_ranks > 1 else 0.0

    def shape_for(self, num_ranks: int) -> tuple[int, int]:
        """(ranks per node, nodes) of a group of `num_ranks` laid out like this one."""
        per_node = min(self.ranks_per_node, num_ranks)
        return per_node, max(1, math.ceil(num_ranks / per_node))

    def collective_time_s(self, kind: str, num_bytes: float, num_ranks: int) -> float:
        """Seconds of the cheapest (algorithm, protocol) NCCL would run for `kind` on `num_bytes` over the group.

        `num_bytes` is the full tensor's size (the all-reduced tensor, the gathered result, the scattered
        input), NCCL's own `nBytes` for these collectives.
        """
        key = (self, kind, num_bytes, num_ranks)
        found = _TIMES.get(key)
        if found is None:
            if len(_TIMES) >= _MAX_TIMES:
                _TIMES.clear()
            found = _TIMES[key] = min(t for t, _, _ in self.choices(kind, num_bytes, num_ranks))
        return found

    def choices(self, kind: str, num_bytes: float, num_ranks: int) -> list[tuple[float, Algorithm, Protocol]]:
        """(seconds, algorithm, protocol) of every pair NCCL would weigh, cheapest first."""
        if num_ranks <= 1:
            return [(0.0, Algorithm.RING, Protocol.SIMPLE)]
        ppn, nodes = self.shape_for(num_ranks)
        out = []
        for algorithm in _algorithms(kind, ppn, nodes):
            for protocol in Protocol:
                if algorithm == Algorithm.PAT and protocol != Protocol.SIMPLE:
                    continue
                bandwidth = self._algorithm_bandwidth(kind, algorithm, protocol, num_bytes, num_ranks, ppn, nodes)
                latency = self._latency_s(kind, algorithm, protocol, num_bytes, num_ranks, ppn, nodes)
                out.append((latency + num_bytes / bandwidth, algorithm, protocol))
        return sorted(out, key=lambda c: c[0])

    # ---------------------------------------------------------------------------------- the model's terms

    def _graph_bandwidth(self, algorithm: Algorithm, ppn: int, nodes: int) -> float:
        """B of the module docstring for this shape; tree on at most two nodes runs at the intra-node figure."""
        intra = self.nvlink.bandwidth_bytes_per_s
        if nodes == 1:
            return intra
        nics = min(ppn, self.nics_per_node)
        inter = min(intra, nics * self.nic.bandwidth_bytes_per_s)
        if algorithm == Algorithm.TREE and nodes <= 2 and ppn > 1:
            return intra
        return inter

    def _bus_bandwidth(self, kind: str, algorithm: Algorithm, protocol: Protocol, ppn: int, nodes: int) -> float:
        bus = self._graph_bandwidth(algorithm, ppn, nodes)
        ll_cap = self.node.ll_max_bandwidth_bytes_per_s[min(nodes, 3) - 1]
        if algorithm == Algorithm.RING:
            if protocol == Protocol.LL:
                return min(ll_cap, bus * LL_SHARE)
            return bus * LL128_SHARE if protocol == Protocol.LL128 else bus
        if algorithm == Algorithm.TREE:
            bus *= TREE_ALLREDUCE_SHARE
            if protocol == Protocol.LL:
                return min(bus / 3.8, ll_cap)
            if protocol == Protocol.LL128:
                return bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0)
            return bus
        return bus * PAT_SHARE

    def _algorithm_bandwidth(self, kind, algorithm, protocol, num_bytes, n, ppn, nodes) -> float:
        """Bytes of the full tensor per second: bus bandwidth converted as tuning.cc does, tree corrected by size."""
        bus = self._bus_bandwidth(kind, algorithm, protocol, ppn, nodes)
        if algorithm == Algorithm.RING:
            bus *= n / _steps(kind, n)
        elif algorithm == Algorithm.TREE:
            bus *= 0.5
            log_size = int(math.log2(num_bytes / 64)) if num_bytes >= 64 else -1
            if 0 <= log_size < 23:
                bus *= TREE_CORRECTION[protocol][log_size]
        return bus

    def _latency_s(self, kind, algorithm, protocol, num_bytes, n, ppn, nodes) -> float:
        base = _protocol_figure(BASE_LATENCY_US, algorithm, protocol) * _US
        intra = _protocol_figure(NVLINK_HOP_US, algorithm, protocol) * _US
        # with one rank per node every algorithm's network hop is priced at the tree's figure
        net_table_algorithm = Algorithm.TREE if ppn == 1 else algorithm
        inter = _protocol_figure(NET_HOP_US, net_table_algorithm, protocol) * _US
        if algorithm == Algorithm.RING and kind == "broadcast":
            # tuning.cc prices a broadcast's chunks at one hop each, Simple at the tree's hop figure
            hop_table = NET_HOP_US if nodes > 1 else NVLINK_HOP_US
            hop_algorithm = Algorithm.TREE if protocol == Protocol.SIMPLE else Algorithm.RING
            return base + n * _protocol_figure(hop_table, hop_algorithm, protocol) * _US
        if algorithm == Algorithm.RING:
            if nodes > 1:
                overhead = self.node.net_overhead_s * (SIMPLE_NET_OVERHEAD_TIMES if protocol == Protocol.SIMPLE else 1)
                intra = max(intra, overhead)
            steps, inter_steps = _steps(kind, n), (0 if nodes == 1 else _steps(kind, nodes))
            latency = base + (steps - inter_steps) * intra + inter_steps * inter
            plateau = (
                kind == "all_reduce"
                and protocol == Protocol.SIMPLE
                and nodes > 1
                and num_bytes >= PLATEAU_BYTES_PER_CHANNEL * RING_CHANNELS * n
            )
            return latency * (self.node.ring_plateau if plateau else 1.0)
        if algorithm == Algorithm.TREE:
            return base + 2 * ((ppn - 1) * intra + math.log2(nodes) * inter)
        return base + math.log2(nodes) * inter / 3.5 + 2.8 * _US * n


# `GroupLink.collective_time_s`, each (link, kind, bytes, ranks) priced once: the programs of one plan price the same
# collectives of the same parameters on equal links again and again (every mesh, stage view and micro-batch count),
# and the price is a pure function of them; equal links (a cluster makes one for every mesh it is asked) share entries
_TIMES: dict[tuple, float] = {}
_MAX_TIMES = 1 << 18

__all__ = [
    "NCCL_AMPERE_AMD",
    "NCCL_HOPPER_INTEL",
    "Algorithm",
    "GroupLink",
    "NcclNode",
    "Protocol",
]

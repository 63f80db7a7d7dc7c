"""Published nccl-tests results next to the cost model's price of the same collective (`cost_model.nccl`).

nccl-tests report a bus bandwidth: the collective's bytes times its ring factor (2(n-1)/n for an all-reduce)
over its time, so a bus bandwidth is comparable across rank counts. Each point below names the system, the
group, the message size and the figure published, with where it was published; `predicted_bus_bandwidth`
prices it on the matching preset cluster. The published figures are maintainers' statements and users'
measurements in NVIDIA's issue trackers, found by searching them; none was measured by this project.
Some points are where a preset's per-link figure comes from (`defines`): those agree by construction and show
only that the per-link figure survives the pricing; the others check the model independently (adapters
multiplied by ranks per node, NCCL's choice of algorithm at scale, its latency).
"""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class NcclTestsPoint:
    """One published nccl-tests figure and the cluster it is priced on."""

    system: str
    cluster: str  # autopar cluster string
    ranks: int
    inner: int  # stride of the group's ranks (1: consecutive ranks, whole nodes)
    collective: str
    num_bytes: float
    published: str  # as published: "230 GB/s" or "46-47 us"
    low: float  # published range, in the unit of `measure`
    high: float
    measure: str  # "busbw_gb_s" or "latency_us"
    source: str
    nics_per_node: int | None = None  # a cluster built with another adapter count than the preset's
    note: str = ""
    # the preset figure this point is the source of ("" when the point checks the model independently)
    defines: str = ""


POINTS: tuple[NcclTestsPoint, ...] = (
    NcclTestsPoint(
        "DGX A100, one node",
        "8xA100-80GB",
        8,
        1,
        "all_reduce",
        8 * GIB,
        "~230 GB/s at 8 GB; 232.5 GB/s at 4 GB",
        230,
        232.5,
        "busbw_gb_s",
        "sjeaugey, NVIDIA/nccl-tests#149; NVIDIA/nccl-tests#175",
        defines="NVLink3's 230 GB/s",
    ),
    NcclTestsPoint(
        "DGX A100 nodes, 8 HDR adapters each",
        "4x8xA100-80GB",
        32,
        1,
        "all_reduce",
        8 * GIB,
        "192 GB/s",
        192,
        192,
        "busbw_gb_s",
        "AddyLaddy, NVIDIA/nccl#812",
        note="node count not given; 4 nodes priced (rings beyond 2 nodes)",
    ),
    NcclTestsPoint(
        "A800, one node",
        "8xA800-80GB",
        8,
        1,
        "all_reduce",
        8 * GIB,
        "~160 GB/s",
        160,
        160,
        "busbw_gb_s",
        "sjeaugey, NVIDIA/nccl#412",
        defines="the A800's NVLink 160 GB/s",
    ),
    NcclTestsPoint(
        "A800 nodes, one HDR adapter each",
        "12x8xA800-80GB",
        96,
        1,
        "all_reduce",
        8 * GIB,
        "24 GB/s",
        24,
        24,
        "busbw_gb_s",
        "sjeaugey, NVIDIA/nccl#412 (12 nodes)",
        nics_per_node=1,
        defines="HDR's 24 GB/s per adapter",
    ),
    NcclTestsPoint(
        "HGX H100, one node, rings",
        "8xH100-80GB",
        8,
        1,
        "all_reduce",
        8 * GIB,
        "~370 GB/s (NCCL_ALGO=RING)",
        365,
        370,
        "busbw_gb_s",
        "sjeaugey, NVIDIA/nccl-tests#212; NVIDIA/nccl#1455",
        defines="NVLink4's 370 GB/s",
    ),
    NcclTestsPoint(
        "HGX H100, 2 GPUs, rings",
        "8xH100-80GB",
        2,
        1,
        "all_reduce",
        4 * GIB,
        "365-370 GB/s from 2 to 8 GPUs (NCCL_ALGO=RING)",
        365,
        370,
        "busbw_gb_s",
        "NVIDIA/nccl#1455",
    ),
    NcclTestsPoint(
        "H100 nodes, one GPU and one NDR adapter each",
        "2x8xH100-80GB",
        2,
        8,
        "all_reduce",
        8 * GIB,
        "46-49 GB/s per NDR adapter",
        46,
        49,
        "busbw_gb_s",
        "AddyLaddy, NVIDIA/nccl-tests#290 and #267",
        defines="NDR's 48 GB/s per adapter",
    ),
    NcclTestsPoint(
        "H200, 248 nodes of 8 (1984 GPUs)",
        "248x8xH200-141GB",
        1984,
        1,
        "all_reduce",
        512 * 2**20,
        "~350 GB/s, at times below 300 (default algorithms)",
        300,
        350,
        "busbw_gb_s",
        "NVIDIA/nccl-tests#283",
        note="NCCL's NVLS tree is not modelled",
    ),
    NcclTestsPoint(
        "2 nodes of 8 H20, NDR, 4-64 B",
        "2x8xH100-80GB",
        16,
        1,
        "all_reduce",
        64,
        "46-47 us (NCCL_ALGO=NVLSTree)",
        46,
        47.8,
        "latency_us",
        "NVIDIA/nccl#1244",
        note="forced NVLS tree, not modelled: priced on NCCL's default choices",
    ),
)


def _cluster(point: NcclTestsPoint):
    import autopar

    if point.nics_per_node is None:
        return autopar.ClusterSpec.parse(point.cluster)
    return autopar.ClusterSpec.from_overrides(
        {"cluster": point.cluster, "device": {"nics_per_node": point.nics_per_node}}, source="nccl-tests point"
    )


def predicted(point: NcclTestsPoint) -> dict:
    """The cost model's time, bus bandwidth and choice of algorithm for `point`."""
    link = _cluster(point).link_for_axis(point.ranks, point.inner)
    seconds, algorithm, protocol = link.choices(point.collective, point.num_bytes, point.ranks)[0]
    n = point.ranks
    factor = 2 * (n - 1) / n if point.collective == "all_reduce" else (n - 1) / n
    bus = point.num_bytes * factor / seconds / 1e9
    value = bus if point.measure == "busbw_gb_s" else seconds * 1e6
    return {
        "seconds": seconds,
        "bus_bandwidth_gb_s": bus,
        "value": value,
        "algorithm": f"{algorithm.value}/{protocol.value}",
        "link": link.name,
        "within_published": point.low * 0.9 <= value <= point.high * 1.1,
    }


def markdown(points=POINTS) -> str:
    """The comparison as a Markdown table."""
    from autopar.bench.common import md_table

    rows = []
    for p in points:
        got = predicted(p)
        size = f"{p.num_bytes / GIB:g} GiB" if p.num_bytes >= GIB else f"{p.num_bytes / 2**20:g} MiB"
        if p.num_bytes < 2**20:
            size = f"{p.num_bytes:g} B"
        unit = "GB/s" if p.measure == "busbw_gb_s" else "us"
        mid = (p.low + p.high) / 2
        rows.append(
            [
                p.system,
                f"{p.ranks} ({p.cluster}{f', {p.nics_per_node} NIC/node' if p.nics_per_node else ''})",
                f"{p.collective} {size}",
                p.published,
                f"{got['value']:,.1f} {unit}",
                f"{got['value'] / mid:.2f}",
                got["algorithm"],
                f"source of {p.defines}" if p.defines else "independent",
                f"{p.source}{'; ' + p.note if p.note else ''}",
            ]
        )
    header = [
        "system",
        "ranks",
        "collective",
        "published",
        "priced",
        "priced / published",
        "NCCL choice",
        "check",
        "source",
    ]
    return md_table(header, rows)


__all__ = ["POINTS", "NcclTestsPoint", "markdown", "predicted"]

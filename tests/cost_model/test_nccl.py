"""Collectives priced as NCCL runs them (cost_model.nccl), each case against a hand computation.

The constants are NCCL's (src/graph/tuning.cc): base latency per (algorithm, protocol), per-hop latency by hop
type, the protocols' shares of the bus bandwidth. Bandwidths are the presets' achieved bus bandwidths: NVLink
230 GB/s (A100) and 370 GB/s (H100), one HDR adapter 24 GB/s, one NDR adapter 48 GB/s, 8 adapters a node.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import DeviceSpec, LinkSpec, get_device
from autopar.cost_model.nccl import NCCL_AMPERE_AMD, Algorithm, GroupLink, NcclNode, Protocol
from autopar.errors import ConfigError

US = 1e-6
GIB8 = 8 * 2**30  # large enough that latency is a rounding error and NCCL runs Simple


def _link(cluster: str, axis: int, inner: int):
    return autopar.ClusterSpec.parse(cluster).link_for_axis(axis, inner)


def _best(link, kind, nbytes, n):
    t, algorithm, protocol = link.choices(kind, nbytes, n)[0]
    assert t == pytest.approx(estimate_collective_time(kind, nbytes, n, link))
    return t, algorithm, protocol


def test_large_all_reduce_inside_a_dgx_a100_is_a_simple_ring_at_the_nvlink_bus_bandwidth():
    link = _link("8xA100-80GB", 8, 1)
    t, algorithm, protocol = _best(link, "all_reduce", GIB8, 8)
    assert (algorithm, protocol) == (Algorithm.RING, Protocol.SIMPLE)
    # base 8.4 µs + 2(n-1) = 14 NVLink hops of 3.4 µs; 2·7/8 of the bytes through each rank at 230 GB/s
    assert t == pytest.approx((8.4 + 14 * 3.4) * US + 2 * 7 / 8 * GIB8 / 230e9)


def test_small_all_reduce_pays_one_latency_per_call_on_the_ll_protocol():
    link = _link("8xA100-80GB", 8, 1)
    t, algorithm, protocol = _best(link, "all_reduce", 8, 8)
    assert (algorithm, protocol) == (Algorithm.RING, Protocol.LL)
    # LL ring: base 6.6 µs + 14 hops of 0.6 µs; the tree's 6.8 + 2·7·0.6 = 15.2 µs loses by 0.2 µs.
    # LL's bandwidth: half the bus bandwidth, capped at Ampere's 87.7 GB/s, times n / 2(n-1)
    assert t == pytest.approx((6.6 + 14 * 0.6) * US + 8 / (min(87.7e9, 230e9 / 2) * 8 / 14))


def test_a_group_spanning_whole_nodes_uses_every_adapter_of_each_node():
    # FSDP over 128 GPUs of 16 DGX A100: 8 ranks on each node, 8 HDR adapters of 24 GB/s: 192 GB/s
    link = _link("16x8xA100-80GB", 128, 1)
    assert (link.ranks_per_node, link.num_nodes) == (8, 16)
    assert link.bus_bandwidth == pytest.approx(192e9)
    t, algorithm, protocol = _best(link, "all_gather", GIB8, 128)
    assert (algorithm, protocol) == (Algorithm.RING, Protocol.SIMPLE)
    # 127 steps, 15 of them across nodes at 14 µs; the other 112 at max(NVLink 3.4 µs, AMD post overhead 2 µs x 3)
    latency = (8.4 + 112 * 6.0 + 15 * 14.0) * US
    assert t == pytest.approx(latency + 127 / 128 * GIB8 / 192e9)


def test_one_rank_per_node_gets_one_adapter():
    # data parallel with tp = 8 inside each node: one rank of each group per node, one HDR adapter
    link = _link("16x8xA100-80GB", 16, 8)
    assert (link.ranks_per_node, link.num_nodes) == (1, 16)
    assert link.bus_bandwidth == pytest.approx(24e9)
    t, algorithm, protocol = _best(link, "reduce_scatter", GIB8, 16)
    assert (algorithm, protocol) == (Algorithm.RING, Protocol.SIMPLE)
    # every step crosses the network; with one rank per node NCCL prices the hop at the tree's 14 µs
    assert t == pytest.approx((8.4 + 15 * 14.0) * US + 15 / 16 * GIB8 / 24e9)


def test_ranks_per_node_below_the_adapters_use_that_many_adapters():
    # axis of 8 with stride 2 on 4 nodes of 8: 4 ranks of a group on each of 2 nodes, 4 adapters
    link = _link("4x8xA100-80GB", 8, 2)
    assert (link.ranks_per_node, link.num_nodes) == (4, 2)
    assert link.bus_bandwidth == pytest.approx(4 * 24e9)


def test_fewer_adapters_than_gpus_cap_the_bandwidth():
    cluster = autopar.ClusterSpec.from_overrides({"cluster": "4x8xA100-80GB", "device": {"nics_per_node": 2}})
    assert cluster.link_for_axis(32, 1).bus_bandwidth == pytest.approx(2 * 24e9)


def test_nvlink_caps_the_adapters():
    # 8 NDR adapters of 48 GB/s (384) behind NVLink rings of 370 GB/s
    assert _link("4x8xH100-80GB", 32, 1).bus_bandwidth == pytest.approx(370e9)


def test_tree_on_two_nodes_runs_at_the_intra_node_bandwidth():
    link = _link("2x8xA100-80GB", 16, 1)
    t, algorithm, protocol = _best(link, "all_reduce", GIB8, 16)
    assert (algorithm, protocol) == (Algorithm.TREE, Protocol.SIMPLE)
    # base 8.4 + 2·(7 NVLink hops of 4.0 µs + log2(2) network hops of 14 µs); bus 0.92 · 230 GB/s, halved
    latency = (8.4 + 2 * (7 * 4.0 + 1 * 14.0)) * US
    assert t == pytest.approx(latency + GIB8 / (0.5 * 0.92 * 230e9))
    # the ring it beats: across the network at 192 GB/s, its latency times NCCL's 1.4 plateau
    ring = [c for c in link.choices("all_reduce", GIB8, 16) if c[1:] == (Algorithm.RING, Protocol.SIMPLE)][0][0]
    ring_latency = 1.4 * (8.4 + (30 - 2) * 6.0 + 2 * 14.0) * US
    assert ring == pytest.approx(ring_latency + 2 * 15 / 16 * GIB8 / 192e9)


def test_tree_latency_grows_with_the_log_of_the_nodes():
    # a small all-reduce over 128 GPUs: one latency per call, log2(16) = 4 network hops up and down the tree,
    # not the old 254 ring steps at 23.5 µs each (6 ms)
    link = _link("16x8xA100-80GB", 128, 1)
    t, algorithm, protocol = _best(link, "all_reduce", 8, 128)
    assert (algorithm, protocol) == (Algorithm.TREE, Protocol.LL)
    assert t == pytest.approx((6.8 + 2 * (7 * 0.6 + 4 * 5.0)) * US, rel=1e-3)  # 8 bytes at ~10 GB/s: < 0.1%


def test_tree_correction_by_size():
    # tuning.cc's tree correction at log2(1 MiB / 64) = 14: 0.5 for Simple
    link = _link("2x8xA100-80GB", 16, 1)
    nbytes = 2**20
    simple = [c for c in link.choices("all_reduce", nbytes, 16) if c[1:] == (Algorithm.TREE, Protocol.SIMPLE)]
    latency = (8.4 + 2 * (7 * 4.0 + 14.0)) * US
    assert simple[0][0] == pytest.approx(latency + nbytes / (0.5 * 0.92 * 230e9 * 0.5))


def test_pat_with_one_rank_per_node():
    # all-gather of 1 MiB over 16 nodes, one rank each: PAT's base 8 µs, log2(16)·14/3.5 µs, 2.8 µs per rank,
    # at 0.75 of one adapter
    link = _link("16x8xA100-80GB", 16, 8)
    t, algorithm, protocol = _best(link, "all_gather", 2**20, 16)
    assert (algorithm, protocol) == (Algorithm.PAT, Protocol.SIMPLE)
    assert t == pytest.approx((8.0 + 4 * 14.0 / 3.5 + 2.8 * 16) * US + 2**20 / (0.75 * 24e9))


def test_point_to_point_collectives_keep_the_per_step_model_on_one_adapter():
    link = _link("4x8xA100-80GB", 32, 1)
    nic = link.nic
    expected = 31 * nic.latency_s + 31 / 32**2 * 1e9 / nic.bandwidth_bytes_per_s
    assert estimate_collective_time(Collective.ALL_TO_ALL, 1e9, 32, link) == pytest.approx(expected)
    inside = _link("8xA100-80GB", 8, 1)
    nvlink = inside.nvlink
    assert estimate_collective_time(Collective.SEND_RECV, 1e6, 2, inside) == pytest.approx(
        nvlink.latency_s + 1e6 / nvlink.bandwidth_bytes_per_s
    )


def test_collectives_grow_with_size_and_ranks():
    link = _link("16x8xH100-80GB", 128, 1)
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        times = [estimate_collective_time(kind, 4.0**k, 128, link) for k in range(2, 17)]
        assert all(b >= a for a, b in zip(times, times[1:], strict=False)), kind


def test_broadcast_prices_its_chunks_per_hop():
    link = _link("8xA100-80GB", 8, 1)
    t, algorithm, protocol = _best(link, "broadcast", GIB8, 8)
    assert (algorithm, protocol) == (Algorithm.RING, Protocol.SIMPLE)
    # n hops at the tree's Simple NVLink figure (4.0 µs); broadcast's bus bandwidth is its algorithm bandwidth
    assert t == pytest.approx((8.4 + 8 * 4.0) * US + GIB8 / 230e9)


def test_axis_shapes():
    c = autopar.ClusterSpec.parse("16x8xA100-80GB")
    assert c.axis_shape(8, 1) == (8, 1)  # tp inside a node
    assert c.axis_shape(16, 8) == (1, 16)  # dp outside tp = 8
    assert c.axis_shape(128, 1) == (8, 16)  # FSDP over every GPU
    assert c.axis_shape(32, 4) == (2, 16)  # dp outside tp = 4
    assert c.axis_shape(1, 8) == (1, 1)
    assert autopar.ClusterSpec.parse("2x8xA100-80GB").axis_shape(3, 1) == (1, 3)  # straddles irregularly
    assert autopar.ClusterSpec.parse("8xA100-80GB").axis_shape(8, 1) == (8, 1)


def test_cpu_clusters_keep_their_measured_links():
    c = autopar.ClusterSpec.parse("cpu:4")
    assert c.link_for_axis(4, 1) is c.intra_node_link


def test_group_link_reads_for_reports():
    link = _link("16x8xA100-80GB", 16, 8)
    assert link.crosses_nodes and link.num_ranks == 16
    assert link.name == "ib-hdr-200g x1 (1 per node)"
    assert link.bandwidth_bytes_per_s == link.bus_bandwidth
    assert 0 < link.latency_s < 1e-3
    assert _link("8xA100-80GB", 8, 1).name == "nvlink3"


def test_nccl_node_round_trips_and_checks():
    d = NCCL_AMPERE_AMD.to_dict()
    assert NcclNode.from_dict(d) == NCCL_AMPERE_AMD
    with pytest.raises(ConfigError, match="ll_max"):
        NcclNode("x", (1.0, 2.0), 1e-6)
    with pytest.raises(ConfigError, match="unknown fields"):
        NcclNode.from_dict({**d, "colour": 1})
    with pytest.raises(ConfigError, match="positive integer"):
        GroupLink(0, 1, LinkSpec("a", 1.0, 0.0), LinkSpec("b", 1.0, 0.0), 8, NCCL_AMPERE_AMD)


def test_device_round_trips_nccl_and_adapters():
    dev = get_device("H100-80GB")
    assert dev.nics_per_node == 8 and dev.nccl.name == "hopper-intel"
    assert DeviceSpec.from_dict(dev.to_dict()) == dev
    plain = dataclasses.replace(dev, nics_per_node=1, nccl=None)
    assert "nccl" not in plain.to_dict() and "nics_per_node" not in plain.to_dict()
    with pytest.raises(ConfigError, match="nics_per_node"):
        dataclasses.replace(dev, nics_per_node=0)


def test_a_measured_collective_replaces_the_model():
    measured = {"all_gather": {"latency_s": 9e-6, "bandwidth_bytes_per_s": 150e9}}
    cluster = autopar.ClusterSpec.from_overrides(
        {"cluster": "2xA100-80GB", "intra_node_link": {"per_collective": measured}}, source="test"
    )
    link = cluster.link_for_axis(2, 1)
    assert link.per_collective == (("all_gather", 9e-6, 150e9),)
    # the measured all-gather on its own ring model: 1 step, half the tensor through each rank
    assert estimate_collective_time(Collective.ALL_GATHER, 1e9, 2, link) == pytest.approx(9e-6 + 0.5e9 / 150e9)
    # the all-reduce keeps NCCL's model
    assert estimate_collective_time(Collective.ALL_REDUCE, 1e9, 2, link) == pytest.approx(
        link.collective_time_s("all_reduce", 1e9, 2)
    )


def test_collective_times_are_priced_once_per_equal_link_and_stay_the_model_s():
    from autopar.cost_model import nccl

    nccl._TIMES.clear()
    a, b = _link("4x8xH100-80GB", 16, 1), _link("4x8xH100-80GB", 16, 1)
    assert a == b and a is not b  # a cluster makes a new link for every mesh it is asked
    for nbytes in (1.0, 3e6, GIB8):
        cheapest = min(t for t, _, _ in a.choices("all_gather", nbytes, 16))
        assert a.collective_time_s("all_gather", nbytes, 16) == cheapest  # exact: the same float, kept
        assert b.collective_time_s("all_gather", nbytes, 16) == cheapest
    assert len(nccl._TIMES) == 3  # equal links share the entries
    assert a.collective_time_s("all_reduce", 3e6, 16) != a.collective_time_s("all_gather", 3e6, 16)

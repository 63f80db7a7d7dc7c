"""ClusterSpec: parsing cluster strings and files, serialisation, and which link a mesh axis crosses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopar.cluster import ClusterSpec, parse_quantity
from autopar.cost_model.devices import DType, get_device
from autopar.errors import ConfigError


def test_parse_nodes_devices_kind():
    c = ClusterSpec.parse("4x8xA100-80GB")
    assert (c.num_nodes, c.devices_per_node, c.world_size) == (4, 8, 32)
    assert c.device is get_device("A100-80GB") and c.device.memory_bytes == 80 * 10**9
    assert c.intra_node_link.name == "nvlink3" and c.inter_node_link.name == "ib-hdr-200g"
    assert c.host_link.name == "pcie4"
    assert c.describe() == "4 nodes x 8 A100-80GB (32 devices)"


def test_parse_one_node_and_case():
    c = ClusterSpec.parse("8xh100-80gb")
    assert (c.num_nodes, c.devices_per_node, c.device.name) == (1, 8, "H100-80GB")
    assert c.describe() == "1 node x 8 H100-80GB (8 devices)"


def test_parse_cpu_ranks_share_the_host_memory():
    c = ClusterSpec.parse("cpu:4")
    cpu = get_device("cpu")
    assert (c.num_nodes, c.devices_per_node, c.world_size, c.device.kind) == (1, 4, 4, "cpu")
    assert c.host_memory_bytes == cpu.memory_bytes
    assert c.device.memory_bytes == cpu.memory_bytes // 4
    assert c.intra_node_link.name == "loopback-gloo"


MALFORMED = [
    "4x",
    "0x8xA100-80GB",
    "4x0xA100-80GB",
    "cpu:0",
    "8xB300",
    "abc",
    "",
    "4x8x",
    "x8xA100-80GB",
    "4x8xA100-80GBx",
    "cpu:",
    "-1xA100-80GB",
    "4 x 8 x A100-80GB",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_cluster_strings(text):
    with pytest.raises(ConfigError) as info:
        ClusterSpec.parse(text)
    message = str(info.value)
    assert repr(text) in message
    if text in ("8xB300", "4x8xA100-80GBx"):  # well-formed, but no such device
        assert "unknown device" in message and "A100-80GB" in message and "H200-141GB" in message
    elif text in ("0x8xA100-80GB", "4x0xA100-80GB", "cpu:0"):
        assert "at least 1" in message
    else:
        assert "NODESxDEVICESxKIND" in message and "cpu:N" in message and "A100-80GB" in message


def test_parse_rejects_non_strings():
    with pytest.raises(ConfigError):
        ClusterSpec.parse(8)


def test_from_file_yaml_overrides(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "cluster: 2x8xA100-80GB\n"
        "device:\n"
        "  memory_bytes: 40GB\n"
        "  matmul_efficiency: 0.7\n"
        "  matmul_flops_per_s: {bf16: 300TFLOP/s}\n"
        "inter_node_link: {bandwidth_bytes_per_s: 12.5GB/s, latency_s: 30us}\n"
        "host_memory_bytes: 512GiB\n"
    )
    c = ClusterSpec.from_file(path)
    assert c.num_nodes == 2 and c.devices_per_node == 8
    assert c.device.memory_bytes == 40 * 10**9
    assert c.device.matmul_efficiency == 0.7
    assert c.device.peak_matmul_flops(DType.BF16) == 300e12
    assert c.device.peak_matmul_flops(DType.TF32) == 156e12  # the dtypes not overridden keep their rates
    assert c.inter_node_link.bandwidth_bytes_per_s == 12.5e9 and c.inter_node_link.latency_s == pytest.approx(30e-6)
    assert c.inter_node_link.name == "ib-hdr-200g"
    assert c.intra_node_link == get_device("A100-80GB").intra_node_link
    assert c.host_memory_bytes == 512 * 2**30


def test_from_file_json_calibration_output(tmp_path):
    # the shape `python -m autopar.cost_model.calibrate` prints
    measured = {
        "cluster": "cpu:2",
        "device": {
            "memory_bandwidth_bytes_per_s": 1.2e10,
            "matmul_flops_per_s": {"fp32": 5e10, "tf32": 5e10},
            "vector_flops_per_s": 4e9,
            "kernel_overhead_s": 6e-6,
        },
        "intra_node_link": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4},
        "host_link": {"bandwidth_bytes_per_s": 6e9},
        "host_memory_bytes": 16e9,
    }
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(measured))
    c = ClusterSpec.from_file(path)
    assert c.world_size == 2 and c.device.kind == "cpu"
    assert c.device.peak_matmul_flops("fp32") == 5e10 and c.device.kernel_overhead_s == 6e-6
    assert c.intra_node_link.latency_s == 1e-4 and c.host_link.bandwidth_bytes_per_s == 6e9
    assert c.host_memory_bytes == 16 * 10**9
    assert c.device.memory_bytes == 8 * 10**9  # the two ranks share the host's RAM


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("cluster: 8xA100-80GB\nnodes: 2\n", "unknown keys"),
        ("cluster: 8xA100-80GB\ndevice: {tflops: 3}\n", "unknown device fields"),
        ("cluster: 8xA100-80GB\ndevice: {intra_node_link: {latency_s: 1}}\n", "top-level"),
        ("cluster: 8xA100-80GB\nhost_link: {speed: 1}\n", "unknown link fields"),
        ("device: {memory_bytes: 1}\n", "'cluster' key"),
        ("cluster: 8xA100-80GB\ndevice: {memory_bytes: 80 furlongs}\n", "memory_bytes"),
        ("cluster: 8xA100-80GB\ndevice: {memory_efficiency: 2}\n", "memory_efficiency"),
        ("cluster: [unclosed\n", "neither valid YAML nor JSON"),
        ("cluster: 8xB300\n", "unknown device"),
    ],
)
def test_from_file_errors(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_file(path)


def test_from_file_missing(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ClusterSpec.from_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["4x8xA100-80GB", "8xH200-141GB", "cpu:3", "1x1xA100-40GB"])
def test_dict_round_trip(text):
    c = ClusterSpec.parse(text)
    assert ClusterSpec.from_dict(c.to_dict()) == c
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c  # as stored inside plan JSON
    tweaked = replace(c, host_memory_bytes=123, intra_node_link=replace(c.intra_node_link, latency_s=7e-6))
    assert ClusterSpec.from_dict(json.loads(json.dumps(tweaked.to_dict()))) == tweaked


def test_from_dict_rejects_other_fields():
    d = ClusterSpec.parse("8xA100-80GB").to_dict()
    with pytest.raises(ConfigError):
        ClusterSpec.from_dict({**d, "extra": 1})
    del d["host_link"]
    with pytest.raises(ConfigError):
        ClusterSpec.from_dict(d)


def test_link_for_axis():
    c = ClusterSpec.parse("4x8xA100-80GB")
    intra, inter = c.intra_node_link, c.inter_node_link

    def shape(axis, inner):
        link = c.link_for_axis(axis, inner)
        assert link.nvlink == intra and link.nic == inter and link.nics_per_node == 8
        return link.ranks_per_node, link.num_nodes

    assert shape(8, 1) == (8, 1)  # tp = 8 inside the node
    assert shape(4, 8) == (1, 4)  # dp = 4 across the nodes, outside tp = 8: one rank a node
    assert shape(2, 4) == (2, 1)  # 2 x 4 = 8 ranks: still one node
    assert shape(2, 8) == (1, 2)
    assert shape(16, 1) == (8, 2)  # two whole nodes
    assert shape(32, 1) == (8, 4)
    assert shape(1, 8) == (1, 1)  # a size-1 axis moves nothing
    assert shape(3, 1) == (1, 3)  # groups of 3 consecutive ranks straddle the 8-rank nodes: the slowest case
    single = ClusterSpec.parse("8xH100-80GB")
    assert not single.link_for_axis(8, 1).crosses_nodes
    assert single.link_for_axis(4, 2).num_nodes == 1
    # CPU ranks keep their measured links, the slowest a group crosses
    cpu = ClusterSpec.parse("cpu:4")
    assert cpu.link_for_axis(4, 1) == cpu.intra_node_link
    with pytest.raises(ConfigError):
        c.link_for_axis(0, 1)


def test_nics_per_node_from_a_cluster_file():
    c = ClusterSpec.from_overrides({"cluster": "2x8xA100-80GB", "device": {"nics_per_node": 4}})
    assert c.device.nics_per_node == 4 and c.link_for_axis(16, 1).bus_bandwidth == pytest.approx(4 * 24e9)
    with pytest.raises(ConfigError, match="positive whole number"):
        ClusterSpec.from_overrides({"cluster": "2x8xA100-80GB", "device": {"nics_per_node": 0.5}})
    assert ClusterSpec.from_dict(c.to_dict()) == c


def test_parse_quantity():
    assert parse_quantity("80GB", "memory_bytes") == 80e9
    assert parse_quantity("1.5 TiB", "memory_bytes") == 1.5 * 2**40
    assert parse_quantity("25GB/s", "bandwidth_bytes_per_s") == 25e9
    assert parse_quantity("312TFLOP/s", "vector_flops_per_s") == 312e12
    assert parse_quantity("2us", "latency_s") == pytest.approx(2e-6)
    assert parse_quantity(3, "latency_s") == 3.0
    with pytest.raises(ConfigError):
        parse_quantity("25GB", "bandwidth_bytes_per_s")
    with pytest.raises(ConfigError):
        parse_quantity(True, "memory_bytes")

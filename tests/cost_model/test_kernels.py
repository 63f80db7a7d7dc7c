"""Kernel efficiency by shape (cost_model.kernels): tile and wave quantization, measured anchors, attention kernels,
and the device files that carry them."""

from __future__ import annotations

import json
import math

import pytest
import torch

import autopar
from autopar.cost_model.compute import OpCost, estimate_compute_time, estimate_node_cost
from autopar.cost_model.devices import DeviceSpec, get_device
from autopar.cost_model.kernels import (
    AttentionKernel,
    MatmulPoint,
    local_shape,
    matmul_efficiency,
    parse_matmul_points,
    quantization,
)
from autopar.errors import ConfigError
from tests.cost_model.test_compute import _meta, call_node

aten = torch.ops.aten


def test_wave_quantization_hand_computed():
    # 2048 x 2048 on 108 SMs: 256x128 tiles make 8·16 = 128 tiles, 2 waves of 108 (59% busy); 128x128 tiles make
    # 256, 3 waves of 108 (79% busy): the better one
    assert quantization(108, 1, 2048, 2048) == pytest.approx(256 / 324)
    # a tile half past the edge costs a whole tile: 2100 x 2048 pads to 17 x 16 tiles of 128x128 = 272, 3 waves
    assert quantization(108, 1, 2100, 2048) == pytest.approx(2100 * 2048 / (3 * 108 * 128 * 128))
    # large GEMMs fill their waves: 16384 x 14336 on 132 SMs is 7168 tiles of 256x128 in 55 waves (98.7% busy),
    # or 14336 of 128x128 in 109 (99.6%)
    assert quantization(132, 1, 16384, 14336) == pytest.approx(14336 / (109 * 132))
    assert quantization(0, 1, 7, 7) == 1.0  # no SM count: achieved rates already (a CPU)


def test_efficiency_is_anchored_on_the_nearest_measured_point():
    points = (MatmulPoint("bf16", 1024, 10240, 5120, 0.869), MatmulPoint("bf16", 8192, 8192, 8192, 0.80))
    q_anchor = quantization(108, 1, 8192, 8192)
    # 8192 x 8192 x 4096 is nearest the 8192^3 point: its efficiency times the quantization ratio
    got = matmul_efficiency(0.869, points, 108, "bf16", (1, 8192, 8192, 4096))
    assert got == pytest.approx(0.80 * quantization(108, 1, 8192, 8192) / q_anchor)
    # a small GEMM loses most of its SMs
    small = matmul_efficiency(0.869, points, 108, "bf16", (1, 256, 256, 256))
    assert small == pytest.approx(0.869 * quantization(108, 1, 256, 256) / quantization(108, 1, 1024, 10240))
    assert small < 0.1
    # no point of that dtype: the plateau times the quantization
    assert matmul_efficiency(0.9, points, 108, "fp32", (1, 2048, 2048, 64)) == pytest.approx(
        0.9 * quantization(108, 1, 2048, 2048)
    )


def test_presets_reach_their_measured_points():
    a100, h100 = get_device("A100-80GB"), get_device("H100-80GB")
    # at a measured shape the device gives back what was measured (stas00/ml-engineering MAMF: 271.2 of 312)
    assert a100.matmul_efficiency_at("bf16", (1, 1024, 10240, 5120)) == pytest.approx(271.2 / 312)
    assert h100.matmul_efficiency_at("bf16", (1, 2048, 2048, 13312)) == pytest.approx(794.5 / 989)
    assert a100.matmul_efficiency == pytest.approx(271.2 / 312)
    # a transformer's GEMMs are large: within a few percent of the plateau
    eff = h100.matmul_efficiency_at("bf16", (1, 16384, 14336, 4096))
    assert 0.95 * h100.matmul_efficiency < eff <= h100.matmul_efficiency * 1.001


def test_local_shape_splits_the_largest_dimension_first():
    # FSDP 8 over 16 sequences of 8192: the token rows
    assert local_shape((1, 131072, 4096, 4096), 8) == (1, 16384, 4096, 4096)
    # a divisor with an odd factor divides the largest dimension by what is left
    assert local_shape((1, 60000, 4096, 4096), 6) == pytest.approx((1, 10000, 4096, 4096))
    assert local_shape((1, 4096, 4096, 4096), 1) == (1, 4096, 4096, 4096)


def test_gemm_shapes_of_the_ops():
    x, w = _meta(4, 512, 1024, dtype=torch.bfloat16), _meta(4096, 1024, dtype=torch.bfloat16)
    lin = estimate_node_cost(call_node(aten.linear.default, (x, w), _meta(4, 512, 4096, dtype=torch.bfloat16)))
    assert lin.gemm == (1, 4 * 512, 4096, 1024)
    a, b = _meta(12, 256, 64), _meta(12, 64, 256)
    assert estimate_node_cost(call_node(aten.bmm.default, (a, b), _meta(12, 256, 256))).gemm == (12, 256, 256, 64)


def test_gemm_backward_is_the_harmonic_mean_of_its_two_products():
    h100 = get_device("H100-80GB")
    m, n, k = 1024, 256, 8192
    cost = OpCost(2.0 * m * n * k, 0.0, 4.0 * m * n * k, 0.0, is_matmul=True, gemm=(1, m, n, k))
    dx = h100.matmul_efficiency_at("bf16", (1, m, k, n))
    dw = h100.matmul_efficiency_at("bf16", (1, k, n, m))
    expected = 4.0 * m * n * k / (989.4e12 * 2 / (1 / dx + 1 / dw)) + h100.kernel_overhead_s
    assert estimate_compute_time(cost, h100, "bf16", backward=True) == pytest.approx(expected)


def test_attention_runs_at_its_kernel_s_efficiencies():
    a100 = get_device("A100-80GB")
    q = _meta(2, 16, 2048, 128, dtype=torch.bfloat16)
    node = call_node(aten.scaled_dot_product_attention.default, (q, q, q), q, {"is_causal": True})
    cost = estimate_node_cost(node)
    assert cost.attention == "sdpa"
    # FlashAttention-2 on A100: 73% of peak forward, 63% backward
    fwd = estimate_compute_time(cost, a100, "bf16")
    bwd = estimate_compute_time(cost, a100, "bf16", backward=True)
    assert fwd == pytest.approx(cost.flops / (312e12 * 0.73) + 5e-6)
    assert bwd == pytest.approx(cost.backward_flops / (312e12 * 0.63) + 5e-6)
    # a device listing no attention kernel prices it as a GEMM at its plateau (the CPU's achieved rate)
    cpu = get_device("cpu")
    assert estimate_compute_time(cost, cpu, "bf16") == pytest.approx(
        max(cost.flops / cpu.peak_matmul_flops("bf16"), cost.bytes_accessed / cpu.memory_bandwidth_bytes_per_s)
        + cpu.kernel_overhead_s
    )


def test_device_round_trips_its_tables():
    h100 = get_device("H100-80GB")
    d = h100.to_dict()
    assert d["num_sms"] == 132 and d["matmul_efficiency_table"][0]["dtype"] == "bf16"
    assert DeviceSpec.from_dict(json.loads(json.dumps(d))) == h100
    assert "matmul_efficiency_table" not in get_device("cpu").to_dict()


def test_a_measured_device_file_sets_the_tables(tmp_path):
    measured = {
        "notes": {"measured": "2027-01-01 on one H100 SXM", "script": "autopar bench gpu"},
        "matmul_efficiency": [
            {"dtype": "bf16", "m": 4096, "n": 4096, "k": 4096, "flops_per_s": 700e12},
            {"dtype": "bf16", "m": 8192, "n": 8192, "k": 8192, "efficiency": 0.75},
        ],
        "attention_efficiency": [{"kernel": "sdpa", "forward": 0.55, "backward": 0.45}],
    }
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(measured))
    cluster = autopar.ClusterSpec.from_overrides({"cluster": "8xH100-80GB", "device": str(path)})
    dev = cluster.device
    assert dev.matmul_efficiency_table == (
        MatmulPoint("bf16", 4096, 4096, 4096, 700e12 / 989.4e12),
        MatmulPoint("bf16", 8192, 8192, 8192, 0.75),
    )
    assert dev.matmul_efficiency == pytest.approx(0.75)  # the plateau: the best point
    assert dev.attention_kernel("sdpa") == AttentionKernel("sdpa", 0.55, 0.45)
    assert dev.attention_kernel("triton") is None  # the file's list replaces the preset's
    # the same fields inline, in a cluster file's device section
    inline = autopar.ClusterSpec.from_overrides(
        {"cluster": "8xH100-80GB", "device": {k: v for k, v in measured.items() if k != "notes"}}
    )
    assert inline.device == dev
    assert autopar.ClusterSpec.from_dict(cluster.to_dict()) == cluster


def test_bad_tables_are_config_errors():
    with pytest.raises(ConfigError, match="efficiency"):
        parse_matmul_points([{"dtype": "bf16", "m": 1, "n": 1, "k": 1, "efficiency": 1.5}])
    with pytest.raises(ConfigError, match="list"):
        parse_matmul_points({"dtype": "bf16"})
    with pytest.raises(ConfigError, match="whole number"):
        parse_matmul_points([{"dtype": "bf16", "m": 1.5, "n": 1, "k": 1, "efficiency": 0.5}])
    with pytest.raises(ConfigError, match="device file"):
        autopar.ClusterSpec.from_overrides({"cluster": "8xH100-80GB", "device": "/nonexistent/device.json"})
    with pytest.raises(ConfigError, match="attention"):
        autopar.ClusterSpec.from_overrides(
            {"cluster": "8xH100-80GB", "device": {"attention_efficiency": [{"kernel": "sdpa", "forward": 2}]}}
        )
    assert math.isfinite(get_device("A800-80GB").matmul_efficiency)

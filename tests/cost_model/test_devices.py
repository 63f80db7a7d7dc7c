"""Device presets, dtype mapping, serialisation, and the calibration fit."""

from __future__ import annotations

import pytest
import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model import calibrate
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import DEVICE_PRESETS, DeviceSpec, DType, LinkSpec, get_device
from autopar.errors import ConfigError


def test_presets_cover_the_documented_devices():
    assert set(DEVICE_PRESETS) == {
        "A100-40GB",
        "A100-80GB",
        "A800-80GB",
        "H100-80GB",
        "H100-96GB-500W",
        "H200-141GB",
        "cpu",
    }
    for name, spec in DEVICE_PRESETS.items():
        assert spec.name == name
        assert spec.kind == ("cpu" if name == "cpu" else "gpu")


def test_get_device_is_case_insensitive_and_lists_known_names():
    assert get_device("a100-80gb") is DEVICE_PRESETS["A100-80GB"]
    assert get_device(" H200-141GB ") is DEVICE_PRESETS["H200-141GB"]
    with pytest.raises(ConfigError) as info:
        get_device("B300")
    assert "B300" in str(info.value) and "A100-80GB" in str(info.value) and "cpu" in str(info.value)


def test_datasheet_figures_in_si_units():
    a100 = get_device("A100-40GB")
    assert a100.memory_bytes == 40 * 10**9  # datasheet GB are 10^9 bytes
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(1.555e12)
    assert a100.peak_matmul_flops(DType.BF16) == pytest.approx(312e12)
    assert a100.peak_matmul_flops(torch.float16) == pytest.approx(312e12)
    assert a100.peak_matmul_flops("tf32") == pytest.approx(156e12)
    # plain fp32 matmuls run on the CUDA cores, not the tensor cores
    assert a100.peak_matmul_flops(torch.float32) == pytest.approx(19.5e12)
    h200 = get_device("H200-141GB")
    assert h200.memory_bytes == 141 * 10**9
    # the H200 measurement the efficiency comes from: ~780 of 989.4 TFLOP/s on a large bf16 GEMM
    assert h200.peak_matmul_flops(DType.BF16) * h200.matmul_efficiency == pytest.approx(780e12)
    assert h200.memory_bandwidth_bytes_per_s * h200.memory_efficiency == pytest.approx(4.3e12)


def test_skus_people_train_on():
    a100, a800 = get_device("A100-80GB"), get_device("A800-80GB")
    # A800: an A100 80GB whose NVLink is cut from 600 to 400 GB/s; ~160 GB/s all-reduce bus bandwidth (nccl#412)
    assert a800.peak_matmul_flops("bf16") == a100.peak_matmul_flops("bf16")
    assert a800.memory_bandwidth_bytes_per_s == a100.memory_bandwidth_bytes_per_s
    assert a800.intra_node_link.bandwidth_bytes_per_s == pytest.approx(160e9)
    gt, sxm = get_device("H100-96GB-500W"), get_device("H100-80GB")
    # Grand Teton: 96 GB HBM2e at 2.4 TB/s; peak between the NVL (835) and the SXM (989.4) at a 500 W cap
    assert gt.memory_bytes == 96 * 10**9 and gt.memory_bandwidth_bytes_per_s == pytest.approx(2.4e12)
    assert 835e12 < gt.peak_matmul_flops("bf16") < sxm.peak_matmul_flops("bf16")
    assert gt.peak_matmul_flops("bf16") == pytest.approx(989.4e12 * (500 / 700) ** (1 / 3))
    for name in ("A100-80GB", "A800-80GB", "H100-80GB", "H100-96GB-500W", "H200-141GB"):
        assert get_device(name).nics_per_node == 8, name
    assert get_device("H100-96GB-500W").inter_node_link.bandwidth_bytes_per_s == pytest.approx(48e9)


def test_link_figures():
    assert get_device("A100-80GB").intra_node_link.bandwidth_bytes_per_s == pytest.approx(230e9)
    assert get_device("H100-80GB").intra_node_link.bandwidth_bytes_per_s == pytest.approx(370e9)
    # one adapter's achieved bandwidth: HDR 24 GB/s (NVIDIA/nccl#412), NDR 48 GB/s (NVIDIA/nccl-tests#267)
    assert get_device("A100-80GB").inter_node_link.bandwidth_bytes_per_s == pytest.approx(24e9)
    assert get_device("H100-80GB").inter_node_link.bandwidth_bytes_per_s == pytest.approx(48e9)
    for spec in DEVICE_PRESETS.values():
        # the network is slower than the node's own links
        assert spec.inter_node_link.bandwidth_bytes_per_s <= spec.intra_node_link.bandwidth_bytes_per_s
        assert spec.inter_node_link.latency_s >= spec.intra_node_link.latency_s


def test_dtype_from_torch():
    assert DType.from_torch(torch.float32) is DType.FP32
    assert DType.from_torch(torch.bfloat16) is DType.BF16
    assert DType.from_torch(torch.float16) is DType.FP16
    assert DType("bf16").element_size_bytes == 2 and DType.FP32.element_size_bytes == 4
    with pytest.raises(ConfigError):
        DType.from_torch(torch.float64)
    with pytest.raises(ConfigError):
        get_device("cpu").peak_matmul_flops("int8")


@pytest.mark.parametrize("name", sorted(DEVICE_PRESETS))
def test_device_round_trips_through_dict(name):
    spec = DEVICE_PRESETS[name]
    assert DeviceSpec.from_dict(spec.to_dict()) == spec


def test_invalid_specs_raise_config_error():
    spec = get_device("H100-80GB")
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        DeviceSpec.from_dict({**spec.to_dict(), "matmul_efficiency": 1.5})
    with pytest.raises(ConfigError, match="unknown fields"):
        DeviceSpec.from_dict({**spec.to_dict(), "tflops": 1})
    with pytest.raises(ConfigError, match="bandwidth"):
        LinkSpec("broken", bandwidth_bytes_per_s=0.0, latency_s=1e-6)
    with pytest.raises(ConfigError, match="overlap_efficiency"):
        DeviceSpec.from_dict({**spec.to_dict(), "overlap_efficiency": 1.2})


def test_overlap_efficiency_is_one_on_gpus_and_measured_on_cpu():
    assert all(d.overlap_efficiency == 1.0 for d in DEVICE_PRESETS.values() if d.kind == "gpu")
    assert 0 < get_device("cpu").overlap_efficiency < 1
    # the default is left out of the dict, so a GPU preset's (and a plan's) JSON reads as before it existed
    assert "overlap_efficiency" not in get_device("H100-80GB").to_dict()
    assert get_device("cpu").to_dict()["overlap_efficiency"] == get_device("cpu").overlap_efficiency


def test_overlap_efficiency_formula():
    # 10 ms of compute and 4 ms of all-reduce: one after the other 14 ms; 11 ms together saves 3 of the 4 ms
    assert calibrate.overlap_efficiency(10e-3, 4e-3, 11e-3) == pytest.approx(0.75, rel=1e-12)
    assert calibrate.overlap_efficiency(4e-3, 10e-3, 10e-3) == pytest.approx(1.0, rel=1e-12)
    # slower together than apart (contention): nothing hides; never negative
    assert calibrate.overlap_efficiency(10e-3, 4e-3, 15e-3) == 0.0
    with pytest.raises(ValueError, match="positive"):
        calibrate.overlap_efficiency(0.0, 4e-3, 4e-3)


def test_overlap_efficiency_is_the_median_over_turns():
    # turn k: compute 10 ms, comm 4 ms, both as listed; eta per turn 0.75, 0.5, 1.0, 0.0 (a disturbed turn), 0.75
    samples = {"compute": [10e-3] * 5, "comm": [4e-3] * 5, "both": [11e-3, 12e-3, 10e-3, 30e-3, 11e-3]}
    assert calibrate.paired_overlap_efficiency(samples) == pytest.approx(0.75, rel=1e-12)
    with pytest.raises(ValueError):
        calibrate.paired_overlap_efficiency({"compute": [1.0], "comm": [1.0, 1.0], "both": [1.0]})


def test_cpu_preset_holds_measured_rates():
    cpu = get_device("cpu")
    # measured figures, not datasheet ones: efficiencies are 1 and the rates are plausible for one core
    assert cpu.matmul_efficiency == 1.0 and cpu.memory_efficiency == 1.0
    assert 1e9 < cpu.peak_matmul_flops(DType.FP32) < 1e12
    assert 1e9 < cpu.memory_bandwidth_bytes_per_s < 1e12
    assert cpu.intra_node_link.name == "loopback-gloo"


def test_ring_fit_recovers_alpha_and_beta():
    alpha, bandwidth, n = 40e-6, 2e9, 2
    times = {s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth for s in calibrate._COLLECTIVE_SIZES_BYTES}
    fit_alpha, fit_bandwidth = calibrate.fit_ring("all_reduce", times, n)
    # exact ring times: both come back up to float rounding
    assert fit_alpha == pytest.approx(alpha, rel=1e-9)
    assert fit_bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_ring_fit_latency_is_robust_to_a_few_slow_small_all_reduces():
    alpha, bandwidth, n = 1e-3, 1e9, 4
    exact = {s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth for s in calibrate._COLLECTIVE_SIZES_BYTES}
    noisy = dict(exact)
    for s in (4, 64, 4096):  # three of the ten sizes under 1 MiB, each 3x slower (a busy machine)
        noisy[s] *= 3
    fit_alpha, _ = calibrate.fit_ring("all_reduce", noisy, n)
    # the median over the ten small sizes still lands on an undisturbed one: within 1%
    assert fit_alpha == pytest.approx(alpha, rel=0.01)


def test_link_fit_prices_each_measured_collective_on_its_own_ring_model():
    # gloo-like: the all-reduce on one alpha-beta pair, the reduce-scatter on a slower one of its own
    n = 2
    ar, rs = (600e-6, 1.3e9), (1.5e-3, 0.45e9)
    sizes = calibrate._COLLECTIVE_SIZES_BYTES
    times = {
        "all_reduce": {s: 2 * (n - 1) * ar[0] + 2 * (n - 1) / n * s / ar[1] for s in sizes},
        "reduce_scatter": {s: (n - 1) * rs[0] + (n - 1) / n * s / rs[1] for s in sizes},
    }
    link = calibrate.fit_link(times, n)
    assert link["latency_s"] == pytest.approx(ar[0], rel=1e-9)
    assert link["bandwidth_bytes_per_s"] == pytest.approx(ar[1], rel=1e-9)
    got = link["per_collective"]["reduce_scatter"]
    assert (got["latency_s"], got["bandwidth_bytes_per_s"]) == pytest.approx(rs, rel=1e-9)
    # the fitted link prices a 16 MiB reduce-scatter as measured, not as half the all-reduce's bytes
    cluster = ClusterSpec.from_overrides({"cluster": "cpu:2", "intra_node_link": link}, source="test")
    s = 16 << 20
    priced = estimate_collective_time(Collective.REDUCE_SCATTER, s, n, cluster.intra_node_link)
    assert priced == pytest.approx(times["reduce_scatter"][s], rel=1e-9)
    # the all-gather, not measured here, keeps the all-reduce's figures: (n-1)·alpha + (n-1)/n·S / bandwidth
    assert estimate_collective_time(Collective.ALL_GATHER, s, n, cluster.intra_node_link) == pytest.approx(
        ar[0] + s / 2 / ar[1], rel=1e-12
    )
    # and the cluster file keeps the figures through a round trip
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all", "send_recv"])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_fit_recovers_each_collectives_own_figures(kind, n):
    link = LinkSpec("fitted", bandwidth_bytes_per_s=1e9, latency_s=1e-4, per_collective=((kind, 7e-4, 0.4e9),))
    times = {s: estimate_collective_time(Collective(kind), s, n, link) for s in calibrate._COLLECTIVE_SIZES_BYTES}
    # exact model times of the kind's own steps and moved bytes: its figures come back up to float rounding
    assert calibrate.fit_ring(kind, times, n) == pytest.approx((7e-4, 0.4e9), rel=1e-9)


def test_link_fit_keeps_the_all_reduce_figures_for_a_collective_it_cannot_fit():
    n, sizes = 2, calibrate._COLLECTIVE_SIZES_BYTES
    times = {
        "all_reduce": {s: 2 * 5e-4 + s / 1e9 for s in sizes},
        "all_gather": {s: 7e-4 + s / 2 / 0.8e9 for s in sizes},
        "reduce_scatter": {s: 1e-3 for s in sizes},
    }  # a busy machine: flat in size
    with pytest.warns(UserWarning, match="reduce_scatter is priced with the all-reduce's figures"):
        link = calibrate.fit_link(times, n)
    assert set(link["per_collective"]) == {"all_gather"}
    assert link["bandwidth_bytes_per_s"] == pytest.approx(1e9, rel=1e-9)


def test_per_collective_figures_must_name_a_collective():
    with pytest.raises(ConfigError, match="not a collective"):
        ClusterSpec.from_overrides(
            {
                "cluster": "cpu:2",
                "intra_node_link": {"per_collective": {"gather": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}},
            },
            source="test",
        )
    with pytest.raises(ConfigError, match="missing fields"):
        ClusterSpec.from_overrides(
            {"cluster": "cpu:2", "intra_node_link": {"per_collective": {"all_gather": {"latency_s": 1e-3}}}},
            source="test",
        )


def test_ring_fit_refuses_times_that_do_not_grow():
    times = {s: 1e-3 for s in calibrate._COLLECTIVE_SIZES_BYTES}
    with pytest.raises(ValueError, match="too busy"):
        calibrate.fit_ring("all_reduce", times, 2)


def test_host_costs_are_measured_per_call():
    host = calibrate.measure_host_overheads(repeats=1)
    assert set(host) == {
        "op_forward_s",
        "op_cold_extra_s",
        "op_backward_s",
        "view_forward_s",
        "view_backward_s",
        "grad_call_s",
    }
    # bookkeeping calls, far below a millisecond; the cold extra is a difference of two timings, so it may be 0
    assert all(0 < t < 1e-3 for k, t in host.items() if k != "op_cold_extra_s"), host
    assert 0 <= host["op_cold_extra_s"] < 1e-3
    # one autograd.grad call runs a backward node and starts and finishes the engine: more than the node alone
    assert host["grad_call_s"] > host["op_backward_s"]


def test_optimizer_step_is_split_into_tensors_and_bytes():
    opt = calibrate.measure_optimizer_step(repeats=1)
    assert 0 < opt["optimizer_tensor_s"] < 1e-2 and opt["optimizer_s_per_param_byte"] >= 0


@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_collectives_are_measured_at_the_sizes_each_one_moves():
    """Every collective a link can be fitted for is timed on real gloo ranks, at full-tensor sizes each one can
    split (an all-to-all re-splits every rank's shard, so its sizes divide by world squared), up to its limit."""
    world = 2
    times = calibrate.measure_gloo_collectives(world, 1, max_bytes=4 << 10, kinds=calibrate.CONTEXT_COLLECTIVES)
    assert set(times) == set(calibrate.CONTEXT_COLLECTIVES)
    for kind, by_size in times.items():
        unit = 4 * (world * world if kind == "all_to_all" else world)
        assert by_size and all(size % unit == 0 and 0 < size <= 4 << 10 for size in by_size), (kind, by_size)
        assert all(t > 0 for t in by_size.values())


class _Work:
    def __init__(self, log: list, n: int):
        self.log, self.n = log, n

    def wait(self):
        self.log.append(("wait", self.n))


def test_collectives_kept_in_flight_are_timed_as_issued():
    """All-gathers and reduce-scatters are measured as the sharded program issues them (`_IN_FLIGHT` out at once,
    the oldest waited for before the next goes out; every one waited for before the run ends), taking turns over
    sets of buffers so that the two in flight never share one; the others one after another, each complete before
    the next."""
    assert calibrate._IN_FLIGHT == {"all_gather": 2, "reduce_scatter": 2}
    log: list = []

    def issue():
        n = sum(1 for e in log if e[0] == "issue")
        log.append(("issue", n))
        return _Work(log, n)

    turns: list = []

    def on(buffers):
        def call():
            turns.append(buffers)
            return issue()

        return call

    calibrate.run_in_a_row([on("a"), on("b")], 4, 2)()
    assert log == [
        ("issue", 0),
        ("issue", 1),
        ("wait", 0),
        ("issue", 2),
        ("wait", 1),
        ("issue", 3),
        ("wait", 2),
        ("wait", 3),
    ]
    assert turns == ["a", "b", "a", "b"]  # the two in flight never share buffers
    calls: list = []
    calibrate.run_in_a_row([lambda: calls.append(len(calls))], 3, None)()
    assert calls == [0, 1, 2]

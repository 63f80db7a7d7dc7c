"""The GPU checks' parts that run without a GPU: argument parsing, the timeout wrapper, the report files, the device
file's format, and the one-line refusal where there is no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autopar.bench import device_file, gpu, gpu_measure
from autopar.bench.device_file import AttentionPoint, DeviceMeasurement, MatmulPoint
from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError

PY = sys.executable


def _measurement(**changes) -> DeviceMeasurement:
    kw = dict(
        device_name="NVIDIA H100 80GB HBM3",
        preset="H100-80GB",
        torch_version="2.11.0+cu130",
        measured_on="2026-12-07",
        peak_flops_per_s=(("bf16", 989.4e12), ("fp32", 66.9e12)),
        memory_bandwidth_bytes_per_s=3.0e12,
        matmul=(
            MatmulPoint("bf16", 1024, 1024, 1024, 0.40),
            MatmulPoint("bf16", 16384, 16384, 16384, 0.78),
            MatmulPoint("bf16", 16384, 4096, 1024, 0.66),
            MatmulPoint("fp32", 4096, 4096, 4096, 0.85),
        ),
        attention=(
            AttentionPoint("sdpa-flash", "forward", 4096, 0.5),
            AttentionPoint("sdpa-flash", "backward", 4096, 0.4),
            AttentionPoint("sdpa-flash", "forward", 131072, 0.6),
        ),
        skipped=("attention autopar-triton 131072: time budget spent",),
    )
    kw.update(changes)
    return DeviceMeasurement(**kw)


# ------------------------------------------------------------------------------------------------ device file


def test_device_file_round_trips_through_json(tmp_path):
    m = _measurement()
    path = m.write(tmp_path / "device_measurement.json")
    data = json.loads(path.read_text())
    assert data["format"] == device_file.FORMAT and data["version"] == 1
    assert data["matmul_efficiency"]["bf16"]["16384x4096x1024"] == 0.66  # keyed by dtype, then "MxNxK"
    assert data["attention_efficiency"]["sdpa-flash"]["backward"] == {"4096": 0.4}
    assert DeviceMeasurement.read(path) == m


def test_device_file_lookups_take_the_nearest_measured_point():
    m = _measurement()
    assert m.matmul_efficiency("bf16", 16384, 16384, 16384) == 0.78
    assert m.matmul_efficiency("bf16", 12000, 4000, 1500) == 0.66  # nearest by log ratio of each size
    assert m.matmul_efficiency("bf16", 900, 1100, 1000) == 0.40
    assert m.attention_efficiency("sdpa-flash", "forward", 100_000) == 0.6
    assert m.attention_efficiency("sdpa-flash", "forward", 5000) == 0.5
    with pytest.raises(ConfigError, match="no matmul measured in fp16"):
        m.matmul_efficiency("fp16", 1, 1, 1)
    with pytest.raises(ConfigError, match="autopar-triton"):
        m.attention_efficiency("autopar-triton", "forward", 4096)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format="other"), "not a device file"),
        (lambda d: d.update(version=2), "reads version 1"),
        (lambda d: d.update(colour="blue"), "unknown keys \\['colour'\\]"),
        (lambda d: d["matmul_efficiency"]["bf16"].update({"1024x1024": 0.5}), "MxNxK"),
        (lambda d: d["matmul_efficiency"]["bf16"].update({"1024x0x1024": 0.5}), "positive whole number"),
        (lambda d: d["matmul_efficiency"]["bf16"].update({"8x8x8": -0.1}), "positive efficiency"),
        (lambda d: d["matmul_efficiency"].update(int8={"8x8x8": 0.5}), "not one of"),
        (lambda d: d["attention_efficiency"]["sdpa-flash"].update(sideways={"8": 0.5}), "direction"),
    ],
)
def test_device_file_refuses_what_it_cannot_read(change, message):
    d = _measurement().to_dict()
    change(d)
    with pytest.raises(ConfigError, match=message):
        DeviceMeasurement.from_dict(d)


def test_device_file_read_names_the_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="x.json.*not valid JSON"):
        DeviceMeasurement.read(bad)


def test_cluster_overrides_are_a_cluster_file_the_cost_model_reads():
    m = _measurement()
    overrides = m.cluster_overrides("8xH100-80GB")
    cluster = ClusterSpec.from_overrides(overrides)
    assert cluster.device.matmul_efficiency == 0.78  # the largest square bf16 shape
    assert cluster.device.memory_efficiency == pytest.approx(3.0e12 / 3.35e12)
    assert cluster.world_size == 8


def test_preset_for_gpu_names():
    assert gpu_measure.preset_for("NVIDIA H100 80GB HBM3", 85 * 10**9) == "H100-80GB"
    assert gpu_measure.preset_for("NVIDIA H200", 150 * 10**9) == "H200-141GB"
    assert gpu_measure.preset_for("NVIDIA A100-SXM4-40GB", 42 * 10**9) == "A100-40GB"
    assert gpu_measure.preset_for("NVIDIA A100-SXM4-80GB", 85 * 10**9) == "A100-80GB"
    with pytest.raises(ConfigError, match="--preset"):
        gpu_measure.preset_for("Tesla T4", 16 * 10**9)


def test_measurement_runs_on_the_cpu_and_writes_a_readable_device_file(tmp_path, monkeypatch, capsys):
    """The measurement's own steps at tiny sizes on the CPU (no figure is checked: a CPU is not what it measures)."""
    monkeypatch.setattr(gpu_measure, "SMOKE_MATMUL_SIZES", (16,))
    monkeypatch.setattr(gpu_measure, "SMOKE_ATTENTION", ((32,), 32, 2, 16))
    monkeypatch.setattr(gpu_measure, "KERNELS", ("sdpa-flash",))
    m = gpu_measure.run(torch.device("cpu"), "cpu", gpu_measure.Deadline(60), smoke=True)
    assert {p.dtype for p in m.matmul} == set(gpu_measure.DTYPES) and len(m.matmul) == 4
    assert {(p.kernel, p.direction) for p in m.attention} == {("sdpa-flash", "forward"), ("sdpa-flash", "backward")}
    device_path, cluster_path = gpu_measure.write_outputs(m, tmp_path, "cpu:2")
    assert DeviceMeasurement.read(device_path) == m
    assert ClusterSpec.from_file(cluster_path).world_size == 2
    out = capsys.readouterr().out
    assert "matmul" in out and "attention" in out and "assumed by cpu" in out


def test_measurement_skips_points_past_its_deadline():
    m = gpu_measure.run(torch.device("cpu"), "cpu", gpu_measure.Deadline(0), smoke=True)
    assert not m.matmul and not m.attention
    assert m.skipped and all("time budget spent" in s for s in m.skipped)
    assert len(m.skipped) == 4 * len(gpu_measure.SMOKE_MATMUL_SIZES) ** 3 + 2 * len(gpu_measure.SMOKE_ATTENTION[0])


# ------------------------------------------------------------------------------------------------ the driver


def test_select_and_list(capsys):
    assert [c.name for c in gpu.select(None)] == ["smoke", "cost", "memory", "kernels", "cp_blocks"]
    assert [c.name for c in gpu.select("cp_blocks, smoke")] == ["smoke", "cp_blocks"]  # in the order they run
    with pytest.raises(ConfigError, match="unknown checks \\['nope'\\]"):
        gpu.select("smoke,nope")
    assert gpu.main(["--list", "--only", "cost"]) == 0
    assert "autopar.bench.gpu_measure --out {out}" in capsys.readouterr().out
    assert gpu.main(["--only", "nope"]) == 2
    assert capsys.readouterr().out.count("\n") == 1


def test_parse_args():
    args = gpu.parse_args([])
    assert args.out == Path("out/gpu") and args.budget_s == gpu.DEFAULT_BUDGET_S and args.only is None
    assert gpu.parse_args(["--out", "x", "--budget-s", "60"]).budget_s == 60


@pytest.mark.subprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_timeout_kills_the_check_and_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    start = time.monotonic()
    code, output, seconds = gpu.run_with_timeout([PY, "-c", script], 3, echo=False)
    assert code is None and "started" in output
    assert seconds < 15 and time.monotonic() - start < 20  # 3 s limit, plus the interpreter's start under load
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not _running(child)  # the grandchild went with it


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a killed one may linger as a zombie until its new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.subprocess
def test_run_checks_reports_each_status_and_keeps_to_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "MIN_CHECK_S", 1.0)
    checks = (
        gpu.Check("ok", "passes", ("-c", "print('fine {preset} {out}')"), 30),
        gpu.Check("bad", "fails", ("-c", "import sys; print('no'); sys.exit(3)"), 30),
        gpu.Check("slow", "times out", ("-c", "import time; time.sleep(60)"), 2),
        gpu.Check("late", "no time left", ("-c", "import time; time.sleep(60)"), 60),
    )
    report = gpu.run_checks(checks, tmp_path, "H100-80GB", budget_s=8, environment={"gpu": "test"}, echo=False)
    got = {r.name: r for r in report.results}
    assert [r.status for r in report.results][:3] == ["passed", "failed", "timeout"]
    assert f"fine H100-80GB {tmp_path}" in got["ok"].output and got["bad"].returncode == 3
    # the last check got what was left of the 8 s (less than its own 60), or was skipped for want of it
    assert got["late"].status in ("timeout", "skipped") and got["late"].timeout_s < 8
    assert not report.passed
    data = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert data["passed"] is False and [c["name"] for c in data["checks"]] == ["ok", "bad", "slow", "late"]
    md = (tmp_path / "gpu_checks.md").read_text()
    assert "| bad: fails | failed | 3 |" in md and "## slow: timeout" in md


@pytest.mark.subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("module", ["autopar.bench.gpu", "autopar.bench.gpu_measure", "autopar.bench.gpu_smoke"])
def test_without_a_gpu_each_entry_point_says_so_in_one_line(module, tmp_path):
    argv = [PY, "-m", module] + ([] if module.endswith("gpu_smoke") else ["--out", str(tmp_path)])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.count("\n") == 1 and "no CUDA device" in proc.stdout and "GPU machine" in proc.stdout
    assert "Traceback" not in proc.stderr

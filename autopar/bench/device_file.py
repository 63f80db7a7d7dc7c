"""The device file: what one GPU measured of matmul and attention efficiency, in a form the cost model reads.

`python -m autopar.bench.gpu_measure` writes it (``device_measurement.json``); the cost model reads it with
`DeviceMeasurement.read`. Efficiencies are achieved FLOP/s over the peak of the device preset named in the file
(`peak_flops_per_s`, copied from that preset when measured, so the file is read the same way if a preset changes).

Format (JSON, ``"version": 1``)::

    {
      "format": "autopar-device-measurement",
      "version": 1,
      "device_name": "NVIDIA H100 80GB HBM3",          # as torch.cuda.get_device_name() says
      "preset": "H100-80GB",                            # the DeviceSpec preset it was measured as
      "torch_version": "2.11.0+cu130",
      "measured_on": "2026-12-05",                      # UTC date
      "peak_flops_per_s": {"bf16": 9.894e14, "fp16": 9.894e14, "tf32": 4.947e14, "fp32": 6.69e13},
      "memory_bandwidth_bytes_per_s": 3.0e12,           # a device-to-device copy, bytes read plus written; or null
      "matmul_efficiency": {                            # dtype -> "MxNxK" -> achieved / peak
        "bf16": {"4096x4096x4096": 0.74, "16384x4096x1024": 0.70},
        "fp32": {"4096x4096x4096": 0.80}
      },
      "attention": {"dtype": "bf16", "head_dim": 128, "num_heads": 16, "causal": true},
      "attention_efficiency": {                         # kernel -> direction -> sequence length -> achieved / peak
        "sdpa-flash": {"forward": {"4096": 0.52}, "backward": {"4096": 0.41}},
        "autopar-triton": {"forward": {"4096": 0.40}, "backward": {"4096": 0.30}}
      },
      "skipped": ["attention autopar-triton 131072: time budget spent"]
    }

Terms: a matmul "MxNxK" is ``C[M, N] = A[M, K] @ B[K, N]`` (2·M·N·K FLOPs); ``fp32`` is a matmul with TF32 off
(CUDA cores; its peak is the non-tensor fp32 rate) and ``tf32`` the same fp32 tensors with TF32 on. Attention
is batch x `num_heads` x sequence x `head_dim`, the same number of key/value heads as query heads; its FLOPs are
the kernel convention: forward ``4·b·h·s²·d``, backward 2.5 times the forward, both halved when causal. The
backward efficiency is the backward's own (forward+backward time less forward time). ``skipped`` lists the
points the run did not measure, and why.

`DeviceMeasurement.cluster_overrides` gives the figures that `autopar.ClusterSpec.from_overrides` (and a
cluster file) take today: `matmul_efficiency` at the largest square bf16 shape measured and `memory_efficiency`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import ConfigError

FORMAT = "autopar-device-measurement"
VERSION = 1
DTYPES = ("bf16", "fp16", "tf32", "fp32")
DIRECTIONS = ("forward", "backward")
_KEYS = {
    "format",
    "version",
    "device_name",
    "preset",
    "torch_version",
    "measured_on",
    "peak_flops_per_s",
    "memory_bandwidth_bytes_per_s",
    "matmul_efficiency",
    "attention",
    "attention_efficiency",
    "skipped",
}


def _efficiency(value, where: str) -> float:
    # no upper bound: on a GPU it stays near or below 1, but a CPU's "peak" is itself a measurement
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: expected a positive efficiency (achieved / peak FLOP/s), got {value!r}")
    return float(value)


def _count(value, where: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(n) != str(value).strip():
        raise ConfigError(f"{where}: expected a positive whole number, got {value!r}")
    return n


def _shape_key(key: str, where: str) -> tuple[int, int, int]:
    parts = str(key).lower().split("x")
    if len(parts) != 3:
        raise ConfigError(f"{where}: a matmul shape is written 'MxNxK' (e.g. '4096x4096x1024'), got {key!r}")
    m, n, k = (_count(p, f"{where} {key!r}") for p in parts)
    return m, n, k


@dataclass(frozen=True, slots=True)
class MatmulPoint:
    """One matmul shape in one format: achieved FLOP/s over the preset's peak for that format."""

    dtype: str
    m: int
    n: int
    k: int
    efficiency: float

    @property
    def key(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True, slots=True)
class AttentionPoint:
    """One attention kernel, direction and sequence length: achieved FLOP/s over the preset's peak in the
    attention's format (bf16 on a GPU)."""

    kernel: str
    direction: str
    seq_len: int
    efficiency: float


@dataclass(frozen=True, slots=True)
class DeviceMeasurement:
    """A device file's content (see the module docstring for the JSON it reads and writes)."""

    device_name: str
    preset: str
    torch_version: str
    measured_on: str
    peak_flops_per_s: tuple[tuple[str, float], ...]
    memory_bandwidth_bytes_per_s: float | None
    matmul: tuple[MatmulPoint, ...]
    attention_dtype: str = "bf16"
    attention_head_dim: int = 128
    attention_num_heads: int = 16
    attention_causal: bool = True
    attention: tuple[AttentionPoint, ...] = ()
    skipped: tuple[str, ...] = ()

    def __post_init__(self):
        peaks = dict(self.peak_flops_per_s)
        for p in self.matmul:
            if p.dtype not in DTYPES:
                raise ConfigError(f"device file: matmul dtype {p.dtype!r} is not one of {list(DTYPES)}")
            if p.dtype not in peaks:
                raise ConfigError(f"device file: matmul_efficiency has {p.dtype} but peak_flops_per_s does not")
        for p in self.attention:
            if p.direction not in DIRECTIONS:
                raise ConfigError(f"device file: attention direction {p.direction!r} is not one of {DIRECTIONS}")
        if self.attention and self.attention_dtype not in peaks:
            raise ConfigError(f"device file: attention is in {self.attention_dtype}, which peak_flops_per_s lacks")
        bw = self.memory_bandwidth_bytes_per_s
        if bw is not None and not (isinstance(bw, (int, float)) and bw > 0):
            raise ConfigError(f"device file: memory_bandwidth_bytes_per_s must be positive or null, got {bw!r}")
        # one order whatever the order measured or read: equal contents compare equal
        matmul = sorted(self.matmul, key=lambda p: (DTYPES.index(p.dtype), p.m, p.n, p.k))
        attention = sorted(self.attention, key=lambda p: (p.kernel, DIRECTIONS.index(p.direction), p.seq_len))
        object.__setattr__(self, "matmul", tuple(matmul))
        object.__setattr__(self, "attention", tuple(attention))

    # ------------------------------------------------------------------------------------------- queries

    def matmul_efficiency(self, dtype: str, m: int, n: int, k: int) -> float:
        """The efficiency measured at the shape nearest (m, n, k) in `dtype`: nearest by the sum of
        |log| ratios of the three sizes (matmul efficiency changes with the order of magnitude of a size, not
        with its last digits). ConfigError when nothing was measured in `dtype`."""
        points = [p for p in self.matmul if p.dtype == dtype]
        if not points:
            measured = sorted({p.dtype for p in self.matmul})
            raise ConfigError(f"device file of {self.device_name}: no matmul measured in {dtype}; it has {measured}")

        def distance(p: MatmulPoint) -> float:
            return sum(abs(math.log(a / b)) for a, b in ((p.m, m), (p.n, n), (p.k, k)))

        return min(points, key=distance).efficiency

    def attention_efficiency(self, kernel: str, direction: str, seq_len: int) -> float:
        """The efficiency measured for `kernel` and `direction` at the sequence length nearest `seq_len` (by
        |log| ratio). ConfigError when that kernel and direction were not measured."""
        points = [p for p in self.attention if p.kernel == kernel and p.direction == direction]
        if not points:
            kernels = sorted({p.kernel for p in self.attention})
            raise ConfigError(f"device file of {self.device_name}: no {direction} of {kernel!r}; kernels: {kernels}")
        return min(points, key=lambda p: abs(math.log(p.seq_len / seq_len))).efficiency

    def cluster_overrides(self, cluster: str) -> dict:
        """A cluster file's mapping for `cluster` (e.g. '8xH100-80GB') with the scalar figures DeviceSpec takes:
        matmul_efficiency at the largest square bf16 shape measured, memory_efficiency from the copy bandwidth
        (capped at 1; the preset's bandwidth is the datasheet's)."""
        from autopar.cost_model.devices import get_device

        device: dict = {}
        squares = [p for p in self.matmul if p.dtype == "bf16" and p.m == p.n == p.k]
        if squares:
            device["matmul_efficiency"] = min(1.0, max(squares, key=lambda p: p.m).efficiency)
        if self.memory_bandwidth_bytes_per_s is not None:
            datasheet = get_device(self.preset).memory_bandwidth_bytes_per_s
            device["memory_efficiency"] = min(1.0, self.memory_bandwidth_bytes_per_s / datasheet)
        return {"cluster": cluster, "device": device} if device else {"cluster": cluster}

    # ------------------------------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        matmul: dict[str, dict[str, float]] = {}
        for p in self.matmul:
            matmul.setdefault(p.dtype, {})[p.key] = p.efficiency
        attention: dict[str, dict[str, dict[str, float]]] = {}
        for p in self.attention:
            attention.setdefault(p.kernel, {}).setdefault(p.direction, {})[str(p.seq_len)] = p.efficiency
        return {
            "format": FORMAT,
            "version": VERSION,
            "device_name": self.device_name,
            "preset": self.preset,
            "torch_version": self.torch_version,
            "measured_on": self.measured_on,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "matmul_efficiency": matmul,
            "attention": {
                "dtype": self.attention_dtype,
                "head_dim": self.attention_head_dim,
                "num_heads": self.attention_num_heads,
                "causal": self.attention_causal,
            },
            "attention_efficiency": attention,
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_dict(cls, d, source: str = "device file") -> DeviceMeasurement:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise ConfigError(f'{source}: not a device file (expected a JSON object with "format": "{FORMAT}")')
        if d.get("version") != VERSION:
            raise ConfigError(f"{source}: version {d.get('version')!r}; this autopar reads version {VERSION}")
        missing = {"device_name", "preset", "peak_flops_per_s", "matmul_efficiency"} - set(d)
        unknown = set(d) - _KEYS
        if missing or unknown:
            raise ConfigError(f"{source}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
        peaks = d["peak_flops_per_s"]
        if not isinstance(peaks, Mapping) or not all(isinstance(v, (int, float)) and v > 0 for v in peaks.values()):
            raise ConfigError(f"{source}: peak_flops_per_s must map dtype names to positive FLOP/s, got {peaks!r}")
        matmul = tuple(
            MatmulPoint(str(dtype), *_shape_key(key, f"{source}: {dtype}"), _efficiency(e, f"{source}: {dtype} {key}"))
            for dtype, table in _mapping(d["matmul_efficiency"], f"{source}: matmul_efficiency").items()
            for key, e in _mapping(table, f"{source}: matmul_efficiency[{dtype}]").items()
        )
        att = _mapping(d.get("attention", {}), f"{source}: attention")
        attention = tuple(
            AttentionPoint(kernel, direction, _count(s, f"{source}: {kernel} {direction}"), _efficiency(e, source))
            for kernel, by_dir in _mapping(d.get("attention_efficiency", {}), f"{source}: attention_efficiency").items()
            for direction, table in _mapping(by_dir, f"{source}: attention_efficiency[{kernel}]").items()
            for s, e in _mapping(table, f"{source}: attention_efficiency[{kernel}][{direction}]").items()
        )
        return cls(
            device_name=str(d["device_name"]),
            preset=str(d["preset"]),
            torch_version=str(d.get("torch_version", "")),
            measured_on=str(d.get("measured_on", "")),
            peak_flops_per_s=tuple((str(k), float(v)) for k, v in peaks.items()),
            memory_bandwidth_bytes_per_s=d.get("memory_bandwidth_bytes_per_s"),
            matmul=matmul,
            attention_dtype=str(att.get("dtype", "bf16")),
            attention_head_dim=_count(att.get("head_dim", 128), f"{source}: attention head_dim"),
            attention_num_heads=_count(att.get("num_heads", 16), f"{source}: attention num_heads"),
            attention_causal=bool(att.get("causal", True)),
            attention=attention,
            skipped=tuple(str(s) for s in d.get("skipped", ())),
        )

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def read(cls, path: str | Path) -> DeviceMeasurement:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ConfigError(f"cannot read device file {str(p)!r}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"device file {str(p)!r} is not valid JSON: {e}") from e
        return cls.from_dict(data, source=f"device file {str(p)!r}")


def _mapping(value, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value

"""Kernel efficiency by shape: the share of a device's peak a matmul of a given (m, n, k) and dtype reaches, and the
shares the attention kernels reach forward and backward.

Matmuls. A GEMM of M x K by K x N runs as output tiles, each on one SM; NVIDIA's "Matrix Multiplication Background
User's Guide" (docs.nvidia.com/deeplearning/performance, "Dimension Quantization Effects") names the two losses
that make efficiency depend on shape: tile quantization (a tile half past the edge of the matrix costs a whole
tile) and wave quantization (tiles run in waves of one per SM; a last wave that fills a few SMs costs a whole
wave). The share of the SMs' work that is useful is

    q(batch, m, n) = batch·m·n / (waves · SMs · Tm·Tn),   waves = ceil(batch·ceil(m/Tm)·ceil(n/Tn) / SMs)

taking the best of cuBLAS's large tiles (Tm x Tn = 256x128, 128x256, 128x128; the guide's "Typical Tile
Dimensions In cuBLAS"). K does not quantize (it only sets arithmetic intensity, which the roofline's byte term
prices). The efficiency of a shape is then anchored on measured points (`MatmulPoint`, from the device's table):

    efficiency(m, n, k) = e_p · q(m, n) / q(m_p, n_p)

with p the table's point of the same dtype nearest in log2 space (the measured efficiency carries everything the
tile model does not), and, with no point of that dtype, the device's plateau `matmul_efficiency` times q. A
device with no SM count (a CPU, whose rates are achieved rates) gets its plateau.

A GPU device file (what a measurement on the GPU writes; `ClusterSpec.from_overrides` reads it under `device`)
gives the table as `matmul_efficiency`, a list of points::

    {"matmul_efficiency": [{"dtype": "bf16", "m": 8192, "n": 8192, "k": 8192, "efficiency": 0.79}, ...],
     "attention_efficiency": [{"kernel": "sdpa", "forward": 0.34, "backward": 0.34}, ...]}

(`efficiency` a share of the device's peak for that dtype; `flops_per_s` may stand instead, divided by the peak.)
Reading such a list sets the table and the plateau (the largest efficiency listed).

Attention. Fused attention kernels run well below a GEMM's efficiency and differently forward and backward; a
device lists (kernel, forward share, backward share) for the kernels the programs run (`attention_efficiency`):
"sdpa" for PyTorch's scaled_dot_product_attention (its flash backend is FlashAttention-2) and "triton" for
autopar's own Triton kernel. The backward's share is of its FLOPs as the cost model counts them (2.5x forward,
the recompute of the scores included), the convention of the FlashAttention papers' benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autopar.errors import ConfigError

# cuBLAS's large tiles (the Matrix Multiplication Background guide, "Typical Tile Dimensions In cuBLAS")
TILES = ((256, 128), (128, 256), (128, 128))


@dataclass(frozen=True, slots=True)
class MatmulPoint:
    """One measured GEMM: `efficiency` of the dtype's peak at M x K by K x N."""

    dtype: str
    m: int
    n: int
    k: int
    efficiency: float

    def __post_init__(self):
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"matmul point: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.efficiency, (int, float)) or not 0 < self.efficiency <= 1:
            raise ConfigError(f"matmul point {self.m}x{self.n}x{self.k}: efficiency must be in (0, 1]")

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "m": self.m, "n": self.n, "k": self.k, "efficiency": self.efficiency}


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """A fused attention kernel's share of the matrix peak, forward and backward."""

    kernel: str
    forward: float
    backward: float

    def __post_init__(self):
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"attention kernel {self.kernel!r}: {name} must be in (0, 1], got {value!r}")

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "forward": self.forward, "backward": self.backward}


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"{what} must be a whole number, got {value!r}")
    return int(value)


def parse_matmul_points(value, peak_of=None) -> tuple[MatmulPoint, ...]:
    """A list of {"dtype", "m", "n", "k", "efficiency" | "flops_per_s"} (or MatmulPoints) as a sorted tuple.

    `peak_of(dtype) -> FLOP/s` turns a measured `flops_per_s` into an efficiency.
    """
    if isinstance(value, Mapping) or isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(
            f"matmul_efficiency table: expected a list of {{dtype, m, n, k, efficiency}} points, got {value!r}"
        )
    points = []
    for entry in value:
        if isinstance(entry, MatmulPoint):
            points.append(entry)
            continue
        if not isinstance(entry, Mapping) or not {"dtype", "m", "n", "k"} <= set(entry):
            raise ConfigError(f"matmul_efficiency point: expected dtype, m, n, k and efficiency, got {entry!r}")
        unknown = set(entry) - {"dtype", "m", "n", "k", "efficiency", "flops_per_s"}
        if unknown:
            raise ConfigError(f"matmul_efficiency point: unknown fields {sorted(unknown)}")
        dtype = str(entry["dtype"]).lower()
        if "efficiency" in entry:
            efficiency = _number(entry["efficiency"], "matmul_efficiency point efficiency")
        elif "flops_per_s" in entry and peak_of is not None:
            efficiency = _number(entry["flops_per_s"], "matmul_efficiency point flops_per_s") / peak_of(dtype)
        else:
            raise ConfigError(f"matmul_efficiency point {entry!r}: give its efficiency (or flops_per_s)")
        m, n, k = (_count(entry[d], f"matmul_efficiency point {d}") for d in ("m", "n", "k"))
        points.append(MatmulPoint(dtype, m, n, k, efficiency))
    return tuple(sorted(points, key=lambda p: (p.dtype, p.m, p.n, p.k)))


def parse_attention_kernels(value) -> tuple[AttentionKernel, ...]:
    """A list of {"kernel", "forward", "backward"} (or AttentionKernels) as a tuple sorted by kernel."""
    if isinstance(value, Mapping) or isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"attention_efficiency: expected a list of {{kernel, forward, backward}}, got {value!r}")
    out = {}
    for entry in value:
        if isinstance(entry, AttentionKernel):
            out[entry.kernel] = entry
            continue
        if not isinstance(entry, Mapping) or set(entry) != {"kernel", "forward", "backward"}:
            raise ConfigError(f"attention_efficiency entry: expected kernel, forward and backward, got {entry!r}")
        kernel = str(entry["kernel"])
        forward, backward = (_number(entry[k], f"attention_efficiency {k}") for k in ("forward", "backward"))
        out[kernel] = AttentionKernel(kernel, forward, backward)
    return tuple(out[k] for k in sorted(out))


def quantization(num_sms: int, batch: float, m: float, n: float) -> float:
    """q of the module docstring: the useful share of the SM-tile slots a GEMM's waves occupy (1 with no SMs)."""
    if num_sms <= 0:
        return 1.0
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / num_sms)
        best = max(best, batch * m * n / (waves * num_sms * tm * tn))
    return min(best, 1.0)


def local_shape(shape: tuple[int, int, int, int], divisor: float) -> tuple[float, float, float, float]:
    """(batch, m, n, k) of one device's share of a GEMM split `divisor` ways.

    Which dimensions a split divides (the batch rows for data parallelism, n or k for a tensor-parallel
    weight) is the caller's; not told, the largest dimension is halved while the divisor has a factor 2 left,
    and any remaining factor divides the largest. Data parallelism and micro-batching divide the token rows,
    the largest dimension of a transformer's GEMMs, so the split lands there first.
    """
    dims = [float(d) for d in shape]
    left = float(divisor)
    while left >= 2 and left == int(left) and int(left) % 2 == 0:
        i = max(range(4), key=lambda j: dims[j])
        dims[i] /= 2
        left /= 2
    if left > 1:
        i = max(range(4), key=lambda j: dims[j])
        dims[i] /= left
    return dims[0], dims[1], dims[2], dims[3]


def _log_distance(p: MatmulPoint, m: float, n: float, k: float) -> float:
    return sum((math.log2(a) - math.log2(b)) ** 2 for a, b in ((p.m, m), (p.n, n), (p.k, k)))


def matmul_efficiency(
    plateau: float,
    points: tuple[MatmulPoint, ...],
    num_sms: int,
    dtype: str,
    shape: tuple[float, float, float, float],
) -> float:
    """Efficiency of the GEMM (batch, m, n, k) in `dtype` (see the module docstring)."""
    batch, m, n, k = (max(d, 1.0) for d in shape)
    q = quantization(num_sms, batch, m, n)
    same = [p for p in points if p.dtype == dtype]
    if not same:
        return plateau * q
    nearest = min(same, key=lambda p: _log_distance(p, m, n, k))
    return min(1.0, nearest.efficiency * q / quantization(num_sms, 1, nearest.m, nearest.n))


__all__ = [
    "TILES",
    "AttentionKernel",
    "MatmulPoint",
    "local_shape",
    "matmul_efficiency",
    "parse_attention_kernels",
    "parse_matmul_points",
    "quantization",
]

"""Device and link specifications: the hardware tables the cost model prices against.

Everything here is frozen data with units in the field names. The cost model never queries
the machine it runs on: planning for 512 H100s happens on a laptop. The one preset measured
on a real machine, "cpu", was measured once by `python -m autopar.cost_model.calibrate` and
written down here; re-run that command to get figures for another machine and pass them in
as overrides (see `autopar.cluster.ClusterSpec.from_file`).

The GPU presets are the SKUs people train on, each in the node it usually ships in:

- "A100-40GB", "A100-80GB": A100 SXM4 in a DGX A100 (NVIDIA A100 and DGX A100 datasheets):
  312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32; 40 GB at 1.555 TB/s or 80 GB at 2.039 TB/s;
  NVLink3 (600 GB/s both directions); 8 ConnectX-6 HDR adapters; 2x AMD EPYC 7742 hosts.
- "A800-80GB": the A100 80GB with NVLink cut to 400 GB/s both directions (NVIDIA A800
  datasheet; compute and memory as A100 80GB), in a DGX A800 (8 HDR adapters, AMD hosts, as
  DGX A100). Clusters built with fewer adapters set `nics_per_node` in their cluster file.
- "H100-80GB": H100 SXM5 in a DGX H100 (datasheets): 989.4 TFLOP/s bf16/fp16, 494.7 tf32,
  66.9 fp32; 80 GB HBM3 at 3.35 TB/s; NVLink4 (900 GB/s both directions); 8 ConnectX-7 NDR
  adapters; 2x Intel Xeon 8480C hosts.
- "H100-96GB-500W": the Grand Teton H100 of torchtitan's published runs
  (pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md`): 96 GB HBM2e at
  2.4 TB/s, run at the default 500 W power limit, 8 per host fully connected by NVLink,
  400 Gb/s RDMA per GPU; hosts are 2x Intel Xeon Sapphire Rapids (OCP Grand Teton). Its
  peak "is between SXM and NVL" (torchtitan), and is taken as the SXM's scaled by the
  clock the cap leaves: a GPU's power grows about as the cube of its clock when voltage
  follows frequency, so 500 W of 700 W leaves (500/700)^(1/3) = 0.894 of the clock, 884
  TFLOP/s bf16. The same rule puts the 400 W H100 NVL (same 132 SMs) at 821 against its
  datasheet's 835 TFLOP/s.
- "H200-141GB": H200 SXM (datasheet): the H100's compute, 141 GB HBM3e at 4.8 TB/s, in a
  DGX H200 (as DGX H100).

- Peak rates are dense (no sparsity). Matrix work runs at the tensor-core rate of its dtype;
  plain fp32 matmuls (TF32 disabled, PyTorch's default for matmuls) run on the CUDA cores at
  the non-tensor fp32 rate.
- Matmuls (`cost_model.kernels`): efficiency by shape from the tile and wave quantization of
  the device's SMs (A100 108, H100 and H200 132), anchored on measured GEMMs. The measured
  points are the "Maximum Achievable Matmul FLOPS" of stas00/ml-engineering
  (compute/accelerator/README.md, mamf-finder.py: the best bf16 `torch.mm` over a sweep of
  shapes, mean of 100 iterations): A100 SXM 271.2 of 312 TFLOP/s at 1024x10240x5120 (torch
  2.6, CUDA 12.6) and 267.9 at 6912x16384x2048 (CUDA 12.1); H100 SXM 794.5 of 989 at
  2048x2048x13312 (torch 2.7, CUDA 12.6) and 792.1 at 6144x17920x2816 (CUDA 12.1). H200: an
  8192^3 bf16 matmul measured 769-798 TFLOP/s on one H200 in this project (780 taken). The
  A800 is an A100's compute; the Grand Teton H100's points are the SXM's, as shares of its
  lower, power-capped peak. `matmul_efficiency`, the plateau, is the best point's; other
  dtypes have no point and get the plateau times the tile model.
- Attention (`attention_efficiency`, `cost_model.kernels`): PyTorch's SDPA runs
  FlashAttention-2 on these GPUs. FlashAttention-2 (Dao, arXiv 2307.08691): "reaching
  50-73% of the theoretical maximum FLOPs/s on A100", up to 73% forward and 63% backward in
  its benchmarks (section 4.1); on H100, without Hopper-specific instructions, up to 335
  TFLOP/s forward and backward, 34% of 989.4. autopar's Triton kernel (an FA2-style kernel,
  after Triton's fused-attention tutorial) is taken at the same figures: not measured.
  FlashAttention-3 (Shah et al., arXiv 2407.08608; 740 TFLOP/s fp16 forward on H100, 75%)
  runs in none of the programs priced here.
- `memory_efficiency` = 4.3/4.8: a device-to-device copy measured about 4.3 TB/s (bytes read
  plus written) on one H200; assumed for the other GPUs too.
- `kernel_overhead_s` = 5 µs for GPUs: eager PyTorch dispatch plus kernel launch, an assumed
  round figure (not measured here).

Links. A GPU cluster prices its collectives as NCCL runs them (`cost_model.nccl`): the
group's ranks per node and the node's NICs (`nics_per_node`, `inter_node_link` being one
adapter) set its bus bandwidth across nodes, NCCL's tuning constants (`nccl`) its latency
and its choice of algorithm and protocol. Bandwidths are achieved bus bandwidths (what
nccl-tests report), not line rates:

- NVLink inside a DGX A100: 230 GB/s all-reduce bus bandwidth ("some other bottlenecks on
  the GPUs limits it to ~230GB/s", sjeaugey, NVIDIA/nccl-tests#149; 232.5 GB/s measured in
  NVIDIA/nccl-tests#175); inside an A800 node 160 GB/s ("you should get ~160GB/s
  intra-node", sjeaugey, NVIDIA/nccl#412); inside an H100/H200 node 370 GB/s with rings ("with the protocol
  overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s", sjeaugey,
  NVIDIA/nccl-tests#212; 365-370 GB/s from 2 to 8 GPUs, NVIDIA/nccl#1455). NVLink SHARP
  (~480 GB/s) is not modelled.
- Network adapters, one per GPU on DGX A100 (8x ConnectX-6 HDR 200 Gb/s) and DGX H100/H200
  (8x ConnectX-7 NDR 400 Gb/s), per the DGX datasheets. Achieved: 24 GB/s per HDR adapter
  ("~160GB/s intra-node and 24GB/s inter-node" for one HDR NIC, sjeaugey, NVIDIA/nccl#412;
  192 GB/s all-reduce bus bandwidth across DGX A100s with 8 HDR NICs, AddyLaddy,
  NVIDIA/nccl#812), 48 GB/s per NDR adapter ("CX-7 NICs at NDR rate (400Gbps) should achieve
  up to 48-49GB/s per NIC", AddyLaddy, NVIDIA/nccl-tests#267; 46-48 GB/s in
  NVIDIA/nccl-tests#290); the Grand Teton's 400 Gb/s RDMA adapters are taken at the NDR
  figure.
- Latency of a point-to-point transfer (pipeline activations, all-to-all steps, which NCCL
  runs outside its tuning model): NCCL's own estimate of one Simple-protocol hop, its base
  latency 8.4 µs plus the hop, 3.4 µs over NVLink and 14 µs over the network
  (`src/graph/tuning.cc`): 11.8 µs and 22.4 µs. Collectives on a group pay NCCL's latency
  per call instead (`cost_model.nccl`).
- Host link: PCIe Gen4 ~32 GB/s per direction for A100, Gen5 ~64 GB/s for H100/H200, 10 µs
  latency per transfer (assumed).

Host optimizer (`host_adamw_params_per_s`, what offloaded optimizer states cost): AdamW updates per
second the host's CPU runs for one device, i.e. on that device's share of the host. AdamW over flat
fp32 buffers reads the weight, gradient and two moments and writes three of them back: 28 bytes per
parameter, so on a many-core host it is bound by memory bandwidth. Measured here: torch's fused CPU
AdamW over whole chunks ran 81M parameters in 255.9 ms on one shared core (0.317e9 parameters/s; see `CPU`).
DGX hosts, from the datasheets, at half of the DRAM peak (no measurement on such a host yet):
DGX A100, 2x EPYC 7742 with 16 channels of DDR4-3200 (409.6 GB/s): 204.8e9 / 28 / 8 GPUs = 0.91e9 per
GPU; DGX H100/H200, 2x Xeon 8480C with 16 channels of DDR5-4800 (614.4 GB/s): 1.37e9 per GPU.

Overlap efficiency (`overlap_efficiency`, eta): of the compute that runs while a collective is in flight, the
share that hides it, so hidden = eta min(communication, compute it overlaps) (`passes.sharding` prices the
data-parallel program's gradient all-reduces so). GPUs: 1 (NCCL runs on its own SMs and copy engines; the few
SMs it takes are not modelled). CPU ranks: gloo's threads run on the cores the compute needs; measured (see
`CPU`) by `calibrate.measure_overlap_efficiency`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from types import MappingProxyType

import torch

from autopar.cost_model.kernels import (
    AttentionKernel,
    MatmulPoint,
    matmul_efficiency,
    parse_attention_kernels,
    parse_matmul_points,
)
from autopar.cost_model.nccl import NCCL_AMPERE_AMD, NCCL_HOPPER_INTEL, NcclNode
from autopar.errors import ConfigError


class DType(StrEnum):
    """Numeric formats the cost model prices (TF32 is fp32 storage with tensor-core matmuls)."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        """The DType of a torch floating dtype (float32 maps to FP32: PyTorch does not use TF32 by default)."""
        found = _FROM_TORCH.get(dtype)
        if found is None:
            raise ConfigError(
                f"dtype {dtype} has no cost-model format: expected one of {sorted(map(str, _FROM_TORCH))}"
            )
        return found

    @classmethod
    def coerce(cls, dtype: DType | torch.dtype | str) -> DType:
        """Accept a DType, a torch dtype or a name such as "bf16"."""
        if isinstance(dtype, torch.dtype):
            return cls.from_torch(dtype)
        try:
            return cls(str(dtype).lower())
        except ValueError:
            raise ConfigError(f"unknown dtype {dtype!r}: expected one of {[d.value for d in cls]}") from None

    @property
    def element_size_bytes(self) -> int:
        return 4 if self in (DType.FP32, DType.TF32) else 2


_FROM_TORCH = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{owner}: {name} must be a positive number, got {value!r}")


def _check_alpha_beta(owner: str, latency_s, bandwidth_bytes_per_s) -> None:
    _check_positive(owner, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    if not isinstance(latency_s, (int, float)) or latency_s < 0:
        raise ConfigError(f"{owner}: latency_s must be >= 0, got {latency_s!r}")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One kind of link, priced by the alpha-beta model: `latency_s` per step plus bytes / bandwidth.

    `per_collective` holds (kind, latency_s, bandwidth_bytes_per_s) for collectives whose own measurement
    replaces the link's figures (which are fitted to all-reduces): on GPUs NCCL runs every collective near the
    link's bus bandwidth and the list is empty; gloo's all-gather and reduce-scatter on CPU ranks do not
    (measured by `calibrate.measure_gloo_collectives`: at 16 MiB on 2 ranks, a reduce-scatter took longer than
    the all-reduce that moves twice its bytes).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    per_collective: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        _check_alpha_beta(f"link {self.name!r}", self.latency_s, self.bandwidth_bytes_per_s)
        for entry in self.per_collective:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)):
                raise ConfigError(
                    f"link {self.name!r}: per_collective entries are (kind, latency_s, "
                    f"bandwidth_bytes_per_s), got {entry!r}"
                )
            _check_alpha_beta(f"link {self.name!r} ({entry[0]})", entry[1], entry[2])

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency_s per step, bandwidth bytes/s) that collective `kind` is priced with on this link."""
        for k, latency, bandwidth in self.per_collective:
            if k == kind:
                return latency, bandwidth
        return self.latency_s, self.bandwidth_bytes_per_s

    def to_dict(self) -> dict:
        d = {"name": self.name, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}
        if self.per_collective:  # left out when empty, so that files written before it read the same
            d["per_collective"] = {k: {"latency_s": a, "bandwidth_bytes_per_s": b} for k, a, b in self.per_collective}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> LinkSpec:
        _check_keys("link", d, {f.name for f in fields(cls)}, required=True, optional={"per_collective"})
        return cls(
            name=str(d["name"]),
            bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
            latency_s=float(d["latency_s"]),
            per_collective=parse_per_collective(d.get("per_collective", {}), f"link {d['name']!r}"),
        )


def parse_per_collective(value, owner: str) -> tuple[tuple[str, float, float], ...]:
    """{kind: {"latency_s": ..., "bandwidth_bytes_per_s": ...}} as LinkSpec stores it, sorted by kind; `kind` must
    name a collective of `cost_model.comm.Collective`."""
    from autopar.cost_model.comm import Collective

    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{owner}: per_collective must map a collective to its latency_s and bandwidth_bytes_per_s, got {value!r}"
        )
    out = []
    for kind, figures in value.items():
        if kind not in {c.value for c in Collective}:
            raise ConfigError(
                f"{owner}: per_collective names {kind!r}, not a collective: expected one of "
                f"{[c.value for c in Collective]}"
            )
        _check_keys(f"{owner} per_collective[{kind!r}]", figures, {"latency_s", "bandwidth_bytes_per_s"}, required=True)
        out.append((str(kind), float(figures["latency_s"]), float(figures["bandwidth_bytes_per_s"])))
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator (or CPU rank) kind: peak rates, achievable fractions and its links."""

    name: str
    kind: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    matmul_flops_per_s: tuple[tuple[DType, float], ...]
    vector_flops_per_s: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead_s: float
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec
    host_link: LinkSpec
    # AdamW parameter updates per second the host CPU runs for this device (see the module docstring)
    host_adamw_params_per_s: float = 1e9
    # eta: the share of communication that hides behind compute running at the same time (see the module
    # docstring): 1 where the link has engines of its own (GPUs: NCCL's kernels take a few SMs), less where the
    # communication runs on the cores the compute needs (gloo on CPU)
    overlap_efficiency: float = 1.0
    # network adapters of a node that collectives use (`inter_node_link` is one of them), and NCCL's tuning
    # constants for the node (None: collectives are priced per ring step on the links, as gloo's are measured)
    nics_per_node: int = 1
    nccl: NcclNode | None = None
    # kernel efficiency by shape (`cost_model.kernels`): the SMs GEMM tiles run on (0: no tile model, a CPU),
    # measured GEMMs that anchor the efficiency of other shapes, and the fused attention kernels' shares
    num_sms: int = 0
    matmul_efficiency_table: tuple[MatmulPoint, ...] = ()
    attention_efficiency: tuple[AttentionKernel, ...] = ()

    def __post_init__(self):
        owner = f"device {self.name!r}"
        if self.kind not in ("gpu", "cpu"):
            raise ConfigError(f"{owner}: kind must be 'gpu' or 'cpu', got {self.kind!r}")
        _check_positive(
            owner,
            memory_bytes=self.memory_bytes,
            vector_flops_per_s=self.vector_flops_per_s,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s,
            host_adamw_params_per_s=self.host_adamw_params_per_s,
        )
        for name in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{owner}: {name} must be in (0, 1], got {value!r}")
        eta = self.overlap_efficiency
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
            raise ConfigError(f"{owner}: overlap_efficiency must be in [0, 1], got {eta!r}")
        if isinstance(self.nics_per_node, bool) or not isinstance(self.nics_per_node, int) or self.nics_per_node < 1:
            raise ConfigError(f"{owner}: nics_per_node must be a positive integer, got {self.nics_per_node!r}")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 0:
            raise ConfigError(f"{owner}: num_sms must be a whole number >= 0, got {self.num_sms!r}")
        if not all(isinstance(p, MatmulPoint) for p in self.matmul_efficiency_table):
            raise ConfigError(f"{owner}: matmul_efficiency_table must hold MatmulPoints")
        for point in self.matmul_efficiency_table:
            if point.dtype not in {d.value for d in DType}:
                raise ConfigError(
                    f"{owner}: a measured matmul names dtype {point.dtype!r}: expected one of {[d.value for d in DType]}"
                )
        if not all(isinstance(a, AttentionKernel) for a in self.attention_efficiency):
            raise ConfigError(f"{owner}: attention_efficiency must hold AttentionKernels")
        if self.nccl is not None and not isinstance(self.nccl, NcclNode):
            raise ConfigError(f"{owner}: nccl must be an NcclNode or None, got {self.nccl!r}")
        if not isinstance(self.kernel_overhead_s, (int, float)) or self.kernel_overhead_s < 0:
            raise ConfigError(f"{owner}: kernel_overhead_s must be >= 0, got {self.kernel_overhead_s!r}")
        if not self.matmul_flops_per_s:
            raise ConfigError(f"{owner}: matmul_flops_per_s lists no dtype")
        for dtype, rate in self.matmul_flops_per_s:
            if not isinstance(dtype, DType):
                raise ConfigError(f"{owner}: matmul_flops_per_s keys must be DType, got {dtype!r}")
            _check_positive(owner, **{f"matmul_flops_per_s[{dtype}]": rate})

    def peak_matmul_flops(self, dtype: DType | torch.dtype | str) -> float:
        """Peak matrix-unit FLOP/s for `dtype` (a DType, a torch dtype or a name like "bf16")."""
        dt = DType.coerce(dtype)
        for d, rate in self.matmul_flops_per_s:
            if d == dt:
                return rate
        known = [d.value for d, _ in self.matmul_flops_per_s]
        raise ConfigError(f"device {self.name} has no matmul rate for {dt.value}: it lists {known}")

    def matmul_efficiency_at(self, dtype: DType | torch.dtype | str, shape: tuple[float, float, float, float]) -> float:
        """Share of the `dtype` peak a GEMM of (batch, m, n, k) reaches on this device (`cost_model.kernels`)."""
        return matmul_efficiency(
            self.matmul_efficiency, self.matmul_efficiency_table, self.num_sms, DType.coerce(dtype).value, shape
        )

    def attention_kernel(self, kernel: str) -> AttentionKernel | None:
        """The device's figures for attention kernel `kernel`, None when it lists none."""
        for entry in self.attention_efficiency:
            if entry.kernel == kernel:
                return entry
        return None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        # defaults are left out, so that files written before the fields existed read the same
        if self.overlap_efficiency == 1.0:
            del d["overlap_efficiency"]
        if self.nics_per_node == 1:
            del d["nics_per_node"]
        if self.nccl is None:
            del d["nccl"]
        else:
            d["nccl"] = self.nccl.to_dict()
        for name in ("num_sms", "matmul_efficiency_table", "attention_efficiency"):
            if not d[name]:
                del d[name]
            elif name != "num_sms":
                d[name] = [entry.to_dict() for entry in d[name]]
        d["matmul_flops_per_s"] = {dt.value: rate for dt, rate in self.matmul_flops_per_s}
        for name in _LINK_FIELDS:
            d[name] = d[name].to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> DeviceSpec:
        optional = {f.name for f in fields(cls) if f.default is not MISSING}  # files written before they existed
        _check_keys("device", d, {f.name for f in fields(cls)}, required=True, optional=optional)
        kw = dict(d)
        kw["matmul_flops_per_s"] = parse_matmul_table(kw["matmul_flops_per_s"])
        for name in _LINK_FIELDS:
            kw[name] = kw[name] if isinstance(kw[name], LinkSpec) else LinkSpec.from_dict(kw[name])
        kw["memory_bytes"] = int(kw["memory_bytes"])
        if "nics_per_node" in kw:
            kw["nics_per_node"] = _whole_count(kw["nics_per_node"], "nics_per_node")
        if kw.get("nccl") is not None:
            kw["nccl"] = NcclNode.from_dict(kw["nccl"])
        if "num_sms" in kw:
            kw["num_sms"] = _whole_count(kw["num_sms"], "num_sms")
        if "matmul_efficiency_table" in kw:
            kw["matmul_efficiency_table"] = parse_matmul_points(kw["matmul_efficiency_table"])
        if "attention_efficiency" in kw:
            kw["attention_efficiency"] = parse_attention_kernels(kw["attention_efficiency"])
        return cls(**kw)


_LINK_FIELDS = ("intra_node_link", "inter_node_link", "host_link")


def parse_matmul_table(value) -> tuple[tuple[DType, float], ...]:
    """A {dtype name: FLOP/s} mapping (or pairs) as the sorted tuple DeviceSpec stores."""
    items = value.items() if isinstance(value, Mapping) else value
    table = {DType.coerce(k): float(v) for k, v in items}
    return tuple(sorted(table.items(), key=lambda kv: list(DType).index(kv[0])))


def _whole_count(value, field: str) -> int:
    """A count read from a file: an int, or a float with no fraction (JSON and YAML may write 8.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"{field} must be a whole number, got {value!r}")
    return int(value)


def _check_keys(what: str, d, allowed: set[str], *, required: bool, optional: set[str] = frozenset()) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{what}: expected a mapping of fields, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{what}: unknown fields {sorted(unknown)}; known fields are {sorted(allowed)}")
    missing = allowed - set(d) - optional if required else set()
    if missing:
        raise ConfigError(f"{what}: missing fields {sorted(missing)}")


def _gpu(
    name: str,
    *,
    memory_gb: float,
    bandwidth_tb_s: float,
    bf16_tflops: float,
    tf32_tflops: float,
    fp32_tflops: float,
    nvlink: LinkSpec,
    nic: LinkSpec,
    pcie: LinkSpec,
    host_adamw: float,
    nccl: NcclNode,
    num_sms: int,
    matmul_points: tuple[MatmulPoint, ...],
    attention: tuple[AttentionKernel, ...],
    nics_per_node: int = 8,
) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        kind="gpu",
        memory_bytes=int(memory_gb * 1e9),
        memory_bandwidth_bytes_per_s=bandwidth_tb_s * 1e12,
        matmul_flops_per_s=(
            (DType.FP32, fp32_tflops * 1e12),
            (DType.TF32, tf32_tflops * 1e12),
            (DType.BF16, bf16_tflops * 1e12),
            (DType.FP16, bf16_tflops * 1e12),
        ),
        vector_flops_per_s=fp32_tflops * 1e12,
        matmul_efficiency=max(p.efficiency for p in matmul_points),
        memory_efficiency=4.3 / 4.8,
        kernel_overhead_s=5e-6,
        intra_node_link=nvlink,
        inter_node_link=nic,
        host_link=pcie,
        host_adamw_params_per_s=host_adamw,
        nics_per_node=nics_per_node,
        nccl=nccl,
        num_sms=num_sms,
        matmul_efficiency_table=matmul_points,
        attention_efficiency=attention,
    )


# see the module docstring for every figure's source
NVLINK3 = LinkSpec("nvlink3", bandwidth_bytes_per_s=230e9, latency_s=11.8e-6)
NVLINK3_A800 = LinkSpec("nvlink3-a800", bandwidth_bytes_per_s=160e9, latency_s=11.8e-6)
NVLINK4 = LinkSpec("nvlink4", bandwidth_bytes_per_s=370e9, latency_s=11.8e-6)
IB_HDR = LinkSpec("ib-hdr-200g", bandwidth_bytes_per_s=24e9, latency_s=22.4e-6)
IB_NDR = LinkSpec("ib-ndr-400g", bandwidth_bytes_per_s=48e9, latency_s=22.4e-6)
RDMA_400G = LinkSpec("rdma-400g", bandwidth_bytes_per_s=48e9, latency_s=22.4e-6)
PCIE4 = LinkSpec("pcie4", bandwidth_bytes_per_s=32e9, latency_s=10e-6)
PCIE5 = LinkSpec("pcie5", bandwidth_bytes_per_s=64e9, latency_s=10e-6)

# Measured on this project's CI machine (2-vCPU AMD EPYC 9004-series "Genoa" under KVM, with AVX-512 BF16; 25.3 GB
# RAM; torch 2.13.0+cpu) on 2026-12-07 with
#   OMP_NUM_THREADS=1 .venv/bin/python -m autopar.cost_model.calibrate --runs 1
# run 7 times over 90 minutes; each figure is the best of the 7 runs (other jobs only slow a run down), with the
# spread of the 7 after it. Other jobs kept the load average at 14-25 on the 2 vCPUs throughout: these figures are
# the machine as a test meets it when it is shared, well below an idle core's. Matmuls ran on one thread (one rank
# per core, the way the gloo tests run): fp32 1024^3 at 36.6 GFLOP/s (9.7-36.6); bf16 512^3 at 202 (15-202), the
# AVX-512 BF16 path; fp16 has no fast path (0.85 GFLOP/s, 0.18-0.85). Vector FMA 9.51 GFLOP/s (6.7-9.5). Memory
# bandwidth is a 256 MiB copy counting bytes read and written: 7.44 GB/s (1.9-7.4). Kernel overhead 5.73 µs
# (5.7-21.8). The link is a gloo all-reduce between 2 processes over localhost fitted to the ring model: 0.523 GB/s
# bus bandwidth (0.15-0.52), 952 µs per step (0.95-10.0 ms). Efficiencies are 1 because the rates are achieved
# rates. The host link of a CPU rank is a memory copy (half the read+write bandwidth); the inter-node link is an
# assumption, not a measurement. The previous figures (2026-12-02: fp32 64.8, bf16 1.29 GFLOP/s, 13.4 GB/s) were
# taken on an earlier machine without AVX-512 BF16.
LOOPBACK_GLOO = LinkSpec("loopback-gloo", bandwidth_bytes_per_s=0.523e9, latency_s=952e-6)
# Between machines gloo runs over TCP: assumed 10 GbE (1.25 GB/s, 50 µs), capped by gloo's own rate on loopback.
TCP_10GBE = LinkSpec(
    "tcp-10gbe",
    bandwidth_bytes_per_s=min(1.25e9, LOOPBACK_GLOO.bandwidth_bytes_per_s),
    latency_s=max(50e-6, LOOPBACK_GLOO.latency_s),
)
HOST_MEMORY = LinkSpec("host-memory", bandwidth_bytes_per_s=3.72e9, latency_s=0.0)
CPU = DeviceSpec(
    name="cpu",
    kind="cpu",
    memory_bytes=25_276_182_528,  # the whole RAM; a cpu:N cluster gives each rank 1/N of it
    memory_bandwidth_bytes_per_s=7.44e9,
    matmul_flops_per_s=((DType.FP32, 36.6e9), (DType.TF32, 36.6e9), (DType.BF16, 202e9), (DType.FP16, 0.852e9)),
    vector_flops_per_s=9.51e9,
    matmul_efficiency=1.0,
    memory_efficiency=1.0,
    kernel_overhead_s=5.73e-6,
    intra_node_link=LOOPBACK_GLOO,
    inter_node_link=TCP_10GBE,
    host_link=HOST_MEMORY,
    # fused AdamW over whole chunks on one core: `python -m autopar.memory bench --threads 1 --repeats 7`, 81.0M
    # parameters in 255.9 ms (2026-12-07; the best of three runs, 255.9-541.2 ms under a load average of 17-21)
    host_adamw_params_per_s=0.317e9,
    # gloo's all-reduce hides behind compute only partly on CPU ranks: its threads need the cores the compute runs
    # on. Measured 2026-12-07 on the same machine with
    #   OMP_NUM_THREADS=1 .venv/bin/python -c "from autopar.cost_model.calibrate import measure_overlap_efficiency \
    #     as m; print([m(2, repeats=9)['eta'] for _ in range(7)])"
    # (2 ranks, a 16 MiB all-reduce against as long a run of 256^3 fp32 matmuls, launched asynchronously, then waited
    # on): 0.0, 0.4, 0.28, 0.7, 1.0, 1.0, 0.57, median 0.57, under a load average of about 20 on the 2 vCPUs (the
    # calibrate runs above measured 0.55-1.0 the same way); `bench run` measures it afresh each run.
    overlap_efficiency=0.57,
)

# the clock a 500 W cap leaves an H100 SXM built for 700 W, as a share of its rated peak (see the module docstring)
GRAND_TETON_CLOCK = (500.0 / 700.0) ** (1.0 / 3.0)

# Measured GEMMs (bf16, M x N x K, share of the datasheet peak; see the module docstring for the sources)
A100_MATMULS = (
    MatmulPoint("bf16", 1024, 10240, 5120, 271.2 / 312),
    MatmulPoint("bf16", 6912, 16384, 2048, 267.9 / 312),
)
H100_MATMULS = (
    MatmulPoint("bf16", 2048, 2048, 13312, 794.5 / 989),
    MatmulPoint("bf16", 6144, 17920, 2816, 792.1 / 989),
)
H200_MATMULS = (MatmulPoint("bf16", 8192, 8192, 8192, 780.0 / 989.4),)
# FlashAttention-2 (PyTorch's SDPA flash backend), and autopar's Triton kernel taken at the same figures
A100_ATTENTION = (AttentionKernel("sdpa", 0.73, 0.63), AttentionKernel("triton", 0.73, 0.63))
H100_ATTENTION = (
    AttentionKernel("sdpa", 335 / 989.4, 335 / 989.4),
    AttentionKernel("triton", 335 / 989.4, 335 / 989.4),
)

_A100 = {
    "tf32_tflops": 156,
    "bf16_tflops": 312,
    "fp32_tflops": 19.5,
    "pcie": PCIE4,
    "host_adamw": 0.91e9,
    "num_sms": 108,
    "matmul_points": A100_MATMULS,
    "attention": A100_ATTENTION,
}
_H100 = {
    "tf32_tflops": 494.7,
    "bf16_tflops": 989.4,
    "fp32_tflops": 66.9,
    "pcie": PCIE5,
    "host_adamw": 1.37e9,
    "num_sms": 132,
    "matmul_points": H100_MATMULS,
    "attention": H100_ATTENTION,
}
_GRAND_TETON = {k: (v * GRAND_TETON_CLOCK if k.endswith("_tflops") else v) for k, v in _H100.items()}

DEVICE_PRESETS: Mapping[str, DeviceSpec] = MappingProxyType(
    {
        "A100-40GB": _gpu(
            "A100-40GB", memory_gb=40, bandwidth_tb_s=1.555, nvlink=NVLINK3, nic=IB_HDR, nccl=NCCL_AMPERE_AMD, **_A100
        ),
        "A100-80GB": _gpu(
            "A100-80GB", memory_gb=80, bandwidth_tb_s=2.039, nvlink=NVLINK3, nic=IB_HDR, nccl=NCCL_AMPERE_AMD, **_A100
        ),
        "A800-80GB": _gpu(
            "A800-80GB",
            memory_gb=80,
            bandwidth_tb_s=2.039,
            nvlink=NVLINK3_A800,
            nic=IB_HDR,
            nccl=NCCL_AMPERE_AMD,
            **_A100,
        ),
        "H100-80GB": _gpu(
            "H100-80GB", memory_gb=80, bandwidth_tb_s=3.35, nvlink=NVLINK4, nic=IB_NDR, nccl=NCCL_HOPPER_INTEL, **_H100
        ),
        "H100-96GB-500W": _gpu(
            "H100-96GB-500W",
            memory_gb=96,
            bandwidth_tb_s=2.4,
            nvlink=NVLINK4,
            nic=RDMA_400G,
            nccl=NCCL_HOPPER_INTEL,
            **_GRAND_TETON,
        ),
        "H200-141GB": _gpu(
            "H200-141GB",
            memory_gb=141,
            bandwidth_tb_s=4.8,
            nvlink=NVLINK4,
            nic=IB_NDR,
            nccl=NCCL_HOPPER_INTEL,
            **{**_H100, "matmul_points": H200_MATMULS},
        ),
        "cpu": CPU,
    }
)


def get_device(name: str) -> DeviceSpec:
    """The preset named `name`, case-insensitively ("a100-80gb" works); ConfigError lists the known names."""
    wanted = str(name).strip().lower()
    for key, spec in DEVICE_PRESETS.items():
        if key.lower() == wanted:
            return spec
    raise ConfigError(f"unknown device {name!r}: known devices are {', '.join(DEVICE_PRESETS)}")

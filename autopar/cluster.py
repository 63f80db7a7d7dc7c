"""ClusterSpec: how many devices of which kind, and the links between them.

A cluster is written as a string (`ClusterSpec.parse`):

- ``NODESxDEVICESxKIND``: "4x8xA100-80GB" is 4 nodes of 8 A100-80GB each;
- ``DEVICESxKIND``: "8xH100-80GB" is one node of 8;
- ``cpu:N``: N local CPU ranks talking gloo over localhost (one node of N "cpu" devices).

or as a YAML/JSON file (`ClusterSpec.from_file`) that names such a string and overrides
figures of the device preset and its links, e.g. with what `python -m
autopar.cost_model.calibrate` measured::

    cluster: 4x8xA100-80GB
    device: {memory_bytes: 40GB, matmul_efficiency: 0.7}
    inter_node_link: {bandwidth_bytes_per_s: 12.5GB/s}
    host_memory_bytes: 2TB

Sizes and rates may be numbers or strings with units; "GB" is 10^9 bytes (datasheet units)
and "GiB" is 2^30.

Ranks are numbered node-major: ranks 0..D-1 are node 0, and so on. A device-mesh axis laid
out with stride `inner_size` (the product of the sizes of the axes inside it) therefore
stays inside a node exactly when its groups of consecutive-stride ranks never straddle a
node boundary, and otherwise puts D / inner_size of each group's ranks on a node
(`axis_shape`); `link_for_axis` hands that shape to the collectives' pricing.

A GPU node's network is `inter_node_link` (one adapter) times the device's `nics_per_node`;
a cluster with fewer adapters per node than GPUs sets it::

    cluster: 16x8xA100-80GB
    device: {nics_per_node: 4}

`device` may also name a device file (JSON or YAML) holding such fields, as a measurement on
the GPU writes it: its `matmul_efficiency` may be a list of measured GEMMs and its
`attention_efficiency` the attention kernels' shares (the format is `cost_model.kernels`'s);
a `notes` key saying what was measured, on what and when is kept out of the device::

    cluster: 8xH100-80GB
    device: h100-measured.json

CPU ranks of one node share the host's memory, so a "cpu" cluster gives each rank
``memory_bytes / devices_per_node`` of the measured RAM (and a file that sets
`host_memory_bytes` of a cpu cluster divides that figure the same way, unless it also sets
`device.memory_bytes`, which is then taken as the per-rank figure).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from autopar.cost_model.devices import (
    DEVICE_PRESETS,
    DeviceSpec,
    LinkSpec,
    get_device,
    parse_matmul_table,
    parse_per_collective,
)
from autopar.cost_model.kernels import parse_attention_kernels, parse_matmul_points
from autopar.cost_model.nccl import GroupLink, NcclNode
from autopar.errors import ConfigError

_EXPECTED = "NODESxDEVICESxKIND (e.g. '4x8xA100-80GB'), DEVICESxKIND (e.g. '8xH100-80GB') or cpu:N (e.g. 'cpu:4')"
_NODES_DEVICES_KIND = re.compile(r"^(\d+)[xX](\d+)[xX]([A-Za-z][\w.-]*)$")
_DEVICES_KIND = re.compile(r"^(\d+)[xX]([A-Za-z][\w.-]*)$")
_CPU = re.compile(r"^cpu:(\d+)$", re.IGNORECASE)

# The most devices a cluster may have: the planner enumerates the divisors of the world size, and today's largest
# training clusters hold about 10^5 accelerators; a figure past this one is a typo.
MAX_DEVICES = 2**20
# Host RAM per node: the DGX systems these GPUs ship in (DGX A100 320GB: 1 TB; DGX A100 640GB, DGX A800, DGX H100
# and DGX H200: 2 TB); Grand Teton up to 2 TB of DDR5 (OCP Grand Teton specification). The "cpu" preset's memory is
# the measured RAM of the machine.
_HOST_MEMORY_BYTES = {
    "A100-40GB": 1e12,
    "A100-80GB": 2e12,
    "A800-80GB": 2e12,
    "H100-80GB": 2e12,
    "H100-96GB-500W": 2e12,
    "H200-141GB": 2e12,
}

_FILE_KEYS = ("cluster", "device", "intra_node_link", "inter_node_link", "host_link", "host_memory_bytes")
_LINK_KEYS = ("intra_node_link", "inter_node_link", "host_link")

_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]*)\s*$")
_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_quantity(value, field: str) -> float:
    """A number, or a string with the unit `field` implies: "80GB", "25 GB/s", "312TFLOP/s", "2us"."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return _finite(float(value), value, field)
    m = _QUANTITY.match(str(value))
    if not m:
        raise ConfigError(f"{field}: {value!r} is not a number or a quantity such as '80GB', '25GB/s' or '2us'")
    number, unit = _finite(float(m.group(1)), value, field), m.group(2)
    if field.endswith("_s") and not field.endswith("_per_s"):
        if unit and unit not in _TIME:
            raise ConfigError(f"{field}: unit {unit!r} is not a time unit (s, ms, us, ns)")
        return number * _TIME.get(unit, 1.0)
    base = "FLOP/s" if "flops" in field else "B/s" if field.endswith("_per_s") else "B"
    if unit and not unit.endswith(base):
        raise ConfigError(f"{field}: unit {unit!r} does not end in {base!r} (e.g. '80GB', '25GB/s', '312TFLOP/s')")
    prefix = unit[: -len(base)] if unit else ""
    if prefix not in _PREFIX:
        raise ConfigError(f"{field}: unknown prefix {prefix!r} in {value!r}; use k, M, G, T or Ki, Mi, Gi, Ti")
    return number * _PREFIX[prefix]


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_BYTES = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> float:
    """`20e9`, "20GB" (10^9) or "20GiB" (2^30) -> bytes."""
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    m = _SIZE.match(str(value))
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"memory size {value!r} not understood: give bytes or a string like '20GB' or '16GiB'")
    return float(m.group(1)) * _BYTES[(m.group(2) or "B").upper()]


def _finite(number: float, value, field: str) -> float:
    if not math.isfinite(number):
        raise ConfigError(f"{field}: {value!r} is not a finite number; give a figure such as '80GB' or '25GB/s'")
    return number


def _known_devices() -> str:
    return ", ".join(DEVICE_PRESETS)


def _count(text: str, value: str, what: str) -> int:
    n = int(value)
    if n < 1:
        raise ConfigError(f"cluster {text!r}: the number of {what} must be at least 1, got {n}; expected {_EXPECTED}")
    return n


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """`num_nodes` nodes of `devices_per_node` devices each, and the links priced between them."""

    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec
    host_link: LinkSpec
    host_memory_bytes: int

    def __post_init__(self):
        for name in ("num_nodes", "devices_per_node", "host_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"cluster: {name} must be a positive integer, got {value!r}")
        if self.num_nodes * self.devices_per_node > MAX_DEVICES:
            raise ConfigError(
                f"cluster: {self.num_nodes} x {self.devices_per_node} devices is more than the "
                f"{MAX_DEVICES:,} autopar plans for; check the node and device counts"
            )
        for name in ("device", *_LINK_KEYS):
            expected = DeviceSpec if name == "device" else LinkSpec
            if not isinstance(getattr(self, name), expected):
                raise ConfigError(f"cluster: {name} must be a {expected.__name__}, got {getattr(self, name)!r}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def host_memory_bytes_per_device(self) -> float:
        """The host memory one device may fill (its share of its node's): what offloaded states and activations
        are held against."""
        return self.host_memory_bytes / self.devices_per_node

    def sub_cluster(self, devices: int) -> ClusterSpec:
        """The cluster of a block of `devices` consecutive devices (one pipeline stage's block)."""
        if devices <= self.devices_per_node:
            return dataclasses.replace(self, num_nodes=1, devices_per_node=devices)
        if devices % self.devices_per_node:
            raise ConfigError(f"a block of {devices} devices does not fill whole nodes of {self.devices_per_node}")
        return dataclasses.replace(self, num_nodes=devices // self.devices_per_node)

    # ------------------------------------------------------------------------------ building

    @classmethod
    def build(cls, num_nodes: int, devices_per_node: int, device: DeviceSpec | str) -> ClusterSpec:
        """A cluster of preset defaults: the device's own links and its node's host memory."""
        spec = get_device(device) if isinstance(device, str) else device
        host = _HOST_MEMORY_BYTES.get(spec.name, spec.memory_bytes)
        if spec.kind == "cpu":  # the ranks of a node share its RAM
            host = spec.memory_bytes
            spec = replace(spec, memory_bytes=max(spec.memory_bytes // devices_per_node, 1))
        return cls(
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            device=spec,
            intra_node_link=spec.intra_node_link,
            inter_node_link=spec.inter_node_link,
            host_link=spec.host_link,
            host_memory_bytes=int(host),
        )

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """Read "4x8xA100-80GB", "8xH100-80GB" or "cpu:4"; ConfigError says what was expected otherwise."""
        if not isinstance(text, str):
            raise ConfigError(f"cluster must be a string such as '8xA100-80GB', got {type(text).__name__}")
        s = text.strip()
        if m := _CPU.match(s):
            return cls.build(1, _count(text, m.group(1), "CPU ranks"), "cpu")
        if m := _NODES_DEVICES_KIND.match(s):
            nodes, per_node, kind = m.groups()
        elif m := _DEVICES_KIND.match(s):
            nodes, (per_node, kind) = "1", m.groups()
        else:
            raise ConfigError(
                f"cluster {text!r} not understood: expected {_EXPECTED}; known devices: {_known_devices()}"
            )
        num_nodes, num_devices = _count(text, nodes, "nodes"), _count(text, per_node, "devices per node")
        try:
            device = get_device(kind)
        except ConfigError:
            raise ConfigError(f"cluster {text!r}: unknown device {kind!r}; known devices: {_known_devices()}") from None
        return cls.build(num_nodes, num_devices, device)

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterSpec:
        """A YAML or JSON cluster file (see the module docstring); ConfigError for unknown keys or bad values, and
        for a file past CLUSTER_FILE_LIMIT_BYTES, nested too deeply, or whose aliases expand past
        CLUSTER_FILE_LIMIT_VALUES values (checked before anything renders it)."""
        p = Path(path)
        try:
            with open(p, "rb") as f:
                raw = f.read(CLUSTER_FILE_LIMIT_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read cluster file {str(p)!r}: {e.strerror}") from e
        if len(raw) > CLUSTER_FILE_LIMIT_BYTES:
            raise ConfigError(
                f"cluster file {str(p)!r} is larger than {CLUSTER_FILE_LIMIT_BYTES} bytes; a cluster file is a few lines"
            )
        try:  # YAML is a superset of JSON, so one loader reads both
            data = yaml.load(raw, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader: no object tags
        except yaml.YAMLError as e:
            raise ConfigError(f"cluster file {str(p)!r} is neither valid YAML nor JSON: {e}") from e
        except RecursionError as e:
            raise ConfigError(f"cluster file {str(p)!r} is nested too deeply to be a cluster file") from e
        if _expanded_size(data, CLUSTER_FILE_LIMIT_VALUES) > CLUSTER_FILE_LIMIT_VALUES:
            raise ConfigError(
                f"cluster file {str(p)!r} expands to more than {CLUSTER_FILE_LIMIT_VALUES} values (YAML aliases "
                f"repeating anchors): write the cluster out plainly"
            )
        return cls.from_overrides(data, source=str(p))

    @classmethod
    def from_overrides(cls, data: Mapping, *, source: str = "cluster file") -> ClusterSpec:
        """{"cluster": "<string>", "device": {...}, "<link>": {...}, "host_memory_bytes": ...} as a ClusterSpec."""
        if not isinstance(data, Mapping) or "cluster" not in data:
            raise ConfigError(f"{source}: expected a mapping with a 'cluster' key such as 'cluster: 4x8xA100-80GB'")
        unknown = set(data) - set(_FILE_KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown keys {sorted(unknown)}; allowed keys are {list(_FILE_KEYS)}")
        base = cls.parse(data["cluster"])
        changes = {}
        if "device" in data:
            changes["device"] = _override_device(base, data["device"], source)
        for key in _LINK_KEYS:
            if key in data:
                changes[key] = _override_link(getattr(base, key), data[key], f"{source}: {key}")
        if "host_memory_bytes" in data:
            host = int(parse_quantity(data["host_memory_bytes"], "host_memory_bytes"))
            changes["host_memory_bytes"] = host
            device_fields = data.get("device") or {}
            if base.device.kind == "cpu" and "memory_bytes" not in device_fields:
                # CPU ranks share the host's RAM: a new RAM figure gives each rank its share of it
                device = changes.get("device", base.device)
                changes["device"] = replace(device, memory_bytes=max(host // base.devices_per_node, 1))
        return replace(base, **changes)

    # ------------------------------------------------------------------------- serialisation

    def to_dict(self) -> dict:
        """Every field, JSON-ready; `from_dict` reads it back exactly."""
        return {
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            **{key: getattr(self, key).to_dict() for key in _LINK_KEYS},
            "host_memory_bytes": self.host_memory_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> ClusterSpec:
        allowed = {f.name for f in fields(cls)}
        if not isinstance(d, Mapping) or set(d) != allowed:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ConfigError(f"cluster dict: expected the fields {sorted(allowed)}, got {got}")
        try:
            return cls(
                num_nodes=_whole(d["num_nodes"]),
                devices_per_node=_whole(d["devices_per_node"]),
                device=DeviceSpec.from_dict(d["device"]),
                **{key: LinkSpec.from_dict(d[key]) for key in _LINK_KEYS},
                host_memory_bytes=_whole(d["host_memory_bytes"]),
            )
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"cluster dict: a field holds a value of the wrong kind ({type(e).__name__}: {e}); "
                f"write it with ClusterSpec.to_dict"
            ) from e

    # ----------------------------------------------------------------------------- queries

    def link_for_axis(self, axis_size: int, inner_size: int) -> LinkSpec | GroupLink:
        """The link a mesh axis of `axis_size` with stride `inner_size` crosses.

        On a GPU cluster (a device with NCCL figures) this is the axis's `GroupLink`: its groups' ranks per
        node (`axis_shape`) with the node's NVLink, network adapter and adapter count, which
        `estimate_collective_time` prices as NCCL runs the collective on that topology. Otherwise (gloo on CPU
        ranks, priced per ring step on measured links) it is the slowest link a group crosses: the intra-node
        link when every group stays on one node, the inter-node one when any straddles a node boundary.
        """
        per_node, nodes = self.axis_shape(axis_size, inner_size)
        if self.device.nccl is not None:
            return GroupLink(
                ranks_per_node=per_node,
                num_nodes=nodes,
                nvlink=self.intra_node_link,
                nic=self.inter_node_link,
                nics_per_node=self.device.nics_per_node,
                node=self.device.nccl,
            )
        return self.intra_node_link if nodes == 1 else self.inter_node_link

    def axis_shape(self, axis_size: int, inner_size: int) -> tuple[int, int]:
        """(ranks per node, nodes) of each group of a mesh axis of `axis_size` with stride `inner_size`.

        The axis's groups are ranks r, r + inner, ..., r + (axis - 1)·inner inside aligned blocks of inner·axis
        consecutive ranks (ranks are numbered node-major). A group stays on one node exactly when that block
        size divides devices_per_node; otherwise, when the stride divides a node, devices_per_node / inner of a
        group's ranks share each node (tp = 8 inside the node leaves a data-parallel group one rank per node);
        an irregular layout is taken as one rank per node, the slowest case. Size-1 axes and one-node clusters
        never leave the node.
        """
        if axis_size < 1 or inner_size < 1:
            raise ConfigError(f"mesh axis size {axis_size} and stride {inner_size} must both be at least 1")
        per = self.devices_per_node
        if axis_size == 1 or self.num_nodes == 1 or per % (axis_size * inner_size) == 0:
            return axis_size, 1
        if inner_size < per and per % inner_size == 0 and axis_size % (per // inner_size) == 0:
            per_node = per // inner_size
            return per_node, axis_size // per_node
        return 1, axis_size

    def describe(self) -> str:
        """One line for reports: "4 nodes x 8 A100-80GB (32 devices)"."""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        devices = f"{self.world_size} device{'s' if self.world_size != 1 else ''}"
        return f"{nodes} x {self.devices_per_node} {self.device.name} ({devices})"


def _whole(value) -> int:
    """An integer field of a cluster dict: an int, or a float with no fraction (JSON writes 1e12 as a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"cluster dict: expected a whole number, got {value!r}")
    return int(value)


# the key of a device file that says what was measured, on what and when: kept out of the DeviceSpec
DEVICE_FILE_NOTES = "notes"
_TABLE_KEYS = ("matmul_efficiency_table", "attention_efficiency")


def _override_device(base: ClusterSpec, overrides, source: str) -> DeviceSpec:
    """The device with `overrides` (a mapping of DeviceSpec fields, or the path of a JSON/YAML device file holding
    one) applied; a `matmul_efficiency` that is a list of measured GEMMs sets the shape table and its plateau."""
    if isinstance(overrides, (str, Path)):
        overrides, source = _read_device_file(overrides, source), f"{source}: device file {str(overrides)!r}"
    allowed = {f.name for f in fields(DeviceSpec)} - set(_LINK_KEYS)
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{source}: 'device' must be a mapping of DeviceSpec fields, got {overrides!r}")
    overrides = {k: v for k, v in overrides.items() if k != DEVICE_FILE_NOTES}
    misplaced = set(overrides) & set(_LINK_KEYS)
    if misplaced:
        raise ConfigError(f"{source}: set links with the top-level keys {sorted(misplaced)}, not under 'device'")
    unknown = set(overrides) - allowed
    if unknown:
        raise ConfigError(f"{source}: unknown device fields {sorted(unknown)}; known fields are {sorted(allowed)}")
    if isinstance(overrides.get("matmul_efficiency"), (list, tuple)):  # a measured table, not a plateau
        overrides["matmul_efficiency_table"] = overrides.pop("matmul_efficiency")
    changes = {}
    for key, value in overrides.items():
        if key in _TABLE_KEYS:
            continue
        if key in ("name", "kind"):
            changes[key] = str(value)
        elif key in ("nics_per_node", "num_sms"):
            changes[key] = _positive_count(value, f"{source}: device.{key}")
        elif key == "nccl":
            changes[key] = None if value is None else NcclNode.from_dict(value)
        elif key == "matmul_flops_per_s":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: matmul_flops_per_s must map dtype names to FLOP/s, e.g. {{bf16: 312e12}}")
            merged = dict(base.device.matmul_flops_per_s)
            merged.update(dict(parse_matmul_table({k: parse_quantity(v, key) for k, v in value.items()})))
            changes[key] = parse_matmul_table(merged)
        elif key == "memory_bytes":
            changes[key] = int(parse_quantity(value, key))
        else:
            changes[key] = parse_quantity(value, key)
    device = replace(base.device, **changes)
    return _override_tables(device, overrides, source)


def _override_tables(device: DeviceSpec, overrides: Mapping, source: str) -> DeviceSpec:
    """The measured kernel tables of `overrides`, read against the device's (overridden) peaks."""
    changes = {}
    if "matmul_efficiency_table" in overrides:
        try:
            table = parse_matmul_points(overrides["matmul_efficiency_table"], device.peak_matmul_flops)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        changes["matmul_efficiency_table"] = table
        if table and "matmul_efficiency" not in overrides:
            changes["matmul_efficiency"] = min(1.0, max(p.efficiency for p in table))
    if "attention_efficiency" in overrides:
        try:
            changes["attention_efficiency"] = parse_attention_kernels(overrides["attention_efficiency"])
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return replace(device, **changes)


def _read_device_file(path, source: str) -> Mapping:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, ValueError) as e:  # a path the system cannot open, or one holding a NUL byte
        raise ConfigError(f"{source}: cannot read device file {str(p)!r}: {getattr(e, 'strerror', e)}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: device file {str(p)!r} is neither valid YAML nor JSON: {e}") from e
    return data


def _positive_count(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ConfigError(f"{where}: expected a positive whole number, got {value!r}")
    return int(value)


def _override_link(base: LinkSpec, overrides, where: str) -> LinkSpec:
    allowed = {f.name for f in fields(LinkSpec)}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {sorted(allowed)}, got {overrides!r}")
    unknown = set(overrides) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown link fields {sorted(unknown)}; known fields are {sorted(allowed)}")
    changes = {
        k: (str(v) if k == "name" else parse_quantity(v, k)) for k, v in overrides.items() if k != "per_collective"
    }
    if "per_collective" in overrides:
        changes["per_collective"] = parse_per_collective(overrides["per_collective"], where)
    return replace(base, **changes)


def load_cluster(value) -> ClusterSpec:
    """A ClusterSpec from a ClusterSpec, a cluster string, or a path to a cluster file."""
    if isinstance(value, ClusterSpec):
        return value
    if isinstance(value, Path) or (isinstance(value, str) and Path(value).suffix.lower() in (".yaml", ".yml", ".json")):
        return ClusterSpec.from_file(value)
    return ClusterSpec.parse(value)


__all__ = ["MAX_DEVICES", "ClusterSpec", "load_cluster", "parse_bytes", "parse_quantity"]


CLUSTER_FILE_LIMIT_BYTES = 64 * 1024
# libyaml's safe loader where PyYAML has it: quick, and it refuses nesting past its depth limit at once
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
CLUSTER_FILE_LIMIT_VALUES = 10_000  # scalars, lists and mappings, counting each alias as the copy it stands for


def _expanded_size(value, limit: int) -> int:
    """How many values `value` holds with every shared object (a YAML alias) counted each time it appears; stops
    counting past `limit`. Iterative, memoised by object: an alias bomb is measured in the time of its text."""
    sizes: dict[int, int] = {}
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        v, done = stack.pop()
        if id(v) in sizes:
            continue
        children = list(v.keys()) + list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else []
        if not children:
            sizes[id(v)] = 1
        elif done:
            sizes[id(v)] = min(limit + 1, 1 + sum(sizes.get(id(c), 1) for c in children))
        else:
            stack.append((v, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(value)]

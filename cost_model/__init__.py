"""Cost model: device and link figures, compute, communication and memory estimates, profiler.

Everything here is a pure function of explicit inputs (shapes, DeviceSpec, LinkSpec, a mesh axis's
GroupLink), never of the machine it runs on; the profiler is the one part that measures, and it caches what it saw.
`python -m autopar.cost_model.calibrate` measures the local CPU for the "cpu" device preset.
"""

from autopar.cost_model import fused_costs  # noqa: F401  (registers the fused Triton ops' costs)
from autopar.cost_model.comm import Collective, collective_moved_bytes, collective_steps, estimate_collective_time
from autopar.cost_model.compute import (
    UNKNOWN_OPS,
    AnalyticEstimator,
    ComputeEstimator,
    OpCost,
    estimate_compute_time,
    estimate_node_cost,
    register_op_cost,
)
from autopar.cost_model.devices import DEVICE_PRESETS, DeviceSpec, DType, LinkSpec, get_device
from autopar.cost_model.memory import (
    ModelStateBytes,
    estimate_model_state_bytes,
    estimate_transformer_activation_bytes,
    zero_communication_bytes,
)
from autopar.cost_model.nccl import GroupLink, NcclNode
from autopar.cost_model.profiler import ProfiledEstimator

__all__ = [
    "DEVICE_PRESETS",
    "UNKNOWN_OPS",
    "AnalyticEstimator",
    "Collective",
    "ComputeEstimator",
    "DType",
    "DeviceSpec",
    "GroupLink",
    "LinkSpec",
    "ModelStateBytes",
    "NcclNode",
    "OpCost",
    "ProfiledEstimator",
    "collective_moved_bytes",
    "collective_steps",
    "estimate_collective_time",
    "estimate_compute_time",
    "estimate_model_state_bytes",
    "estimate_node_cost",
    "estimate_transformer_activation_bytes",
    "get_device",
    "register_op_cost",
    "zero_communication_bytes",
]

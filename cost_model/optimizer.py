"""The optimizer step's time: eager AdamW on a device, priced apart from the graph's ops.

`optimizer_step_time_s(estimator, device, ...)` asks the estimator (a profiled one measured it) and otherwise
uses the analytic `estimate_adamw_step_time`, a memory-bound estimate of eager AdamW on the device.
"""

from __future__ import annotations

from autopar.cost_model.devices import DeviceSpec


def estimate_optimizer_step_time(
    num_tensors: int, num_param_bytes: float, *, tensor_s: float, s_per_param_byte: float
) -> float:
    """Seconds of one optimizer step over `num_tensors` parameter tensors of `num_param_bytes` in all.

    An eager optimizer (PyTorch's AdamW without `foreach`/`fused`, the default on CPU) runs a
    handful of elementwise kernels per parameter tensor: a fixed cost per tensor (`tensor_s`,
    dispatch of those kernels) plus a cost per byte of parameter (`s_per_param_byte`, the
    reads and writes of the parameter, its gradient and its states). Both figures are
    measured by `autopar.cost_model.calibrate.measure_optimizer_step`.

    Args:
        num_tensors: parameter tensors (local shards) this rank updates.
        num_param_bytes: their bytes in the parameters' own format.
        tensor_s: seconds per tensor.
        s_per_param_byte: seconds per parameter byte.
    """
    if num_tensors < 0 or num_param_bytes < 0:
        raise ValueError(f"an optimizer step over {num_tensors} tensors of {num_param_bytes} bytes")
    return num_tensors * tensor_s + num_param_bytes * s_per_param_byte


# PyTorch's eager AdamW (torch.optim.adam's single-tensor path, the default on CPU; the foreach path
# runs the same ops over lists) updates one fp32 parameter with these kernels: the step count
# (`step += 1`), weight decay (`param.mul_`), `exp_avg.lerp_`, `exp_avg_sq.mul_` and `.addcmul_`,
# `exp_avg_sq.sqrt()`, its division by the bias correction, `.add_(eps)` and `param.addcdiv_`.
ADAMW_KERNELS_PER_TENSOR = 9
# Bytes those kernels read and write per byte of fp32 parameter: 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16 = 80
# bytes per 4-byte parameter (each kernel reads its inputs and writes its output once; the step
# count is one element).
ADAMW_BYTES_PER_PARAM_BYTE = 20.0
# torch's multi_tensor_apply takes at most 36 tensors per launch for four tensor lists (param, grad
# and the two moments): on a GPU (foreach, the default there) one launch serves that many tensors.
FOREACH_TENSORS_PER_LAUNCH = 36


def estimate_adamw_step_time(num_tensors: int, num_param_bytes: float, device: DeviceSpec) -> float:
    """Analytic seconds of one eager AdamW step over `num_tensors` fp32 parameter tensors of `num_param_bytes`.

    Memory bound: ADAMW_BYTES_PER_PARAM_BYTE bytes move per parameter byte (the parameter, its
    gradient and its two moments, through the kernels listed above) at the device's achievable
    bandwidth, plus ADAMW_KERNELS_PER_TENSOR launches per tensor (per FOREACH_TENSORS_PER_LAUNCH
    tensors on a GPU, where the foreach path batches them).

    Args:
        num_tensors: parameter tensors (local shards) this rank updates.
        num_param_bytes: the bytes of the fp32 weights it updates (master weights under mixed precision).
        device: the device the step runs on.
    """
    per_tensor = ADAMW_KERNELS_PER_TENSOR * device.kernel_overhead_s
    if device.kind == "gpu":
        per_tensor /= FOREACH_TENSORS_PER_LAUNCH
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    return estimate_optimizer_step_time(
        num_tensors, num_param_bytes, tensor_s=per_tensor, s_per_param_byte=ADAMW_BYTES_PER_PARAM_BYTE / bandwidth
    )


def optimizer_step_time_s(estimator, device: DeviceSpec, num_tensors: int, num_param_bytes: float) -> float:
    """Seconds of one optimizer step on `device`: the estimator's own figure when it has one
    (`optimizer_step_time_s`, e.g. measured by a ProfiledEstimator), else `estimate_adamw_step_time`.

    Args:
        estimator: the ComputeEstimator that prices the ops of the same plan.
        device: the device the step runs on (for the analytic fallback).
        num_tensors: parameter tensors (local shards) this rank updates.
        num_param_bytes: the bytes of the fp32 weights it updates.
    """
    own = getattr(estimator, "optimizer_step_time_s", None)
    if own is not None:
        return float(own(num_tensors, num_param_bytes))
    return estimate_adamw_step_time(num_tensors, num_param_bytes, device)

"""What the step guard adds to a training step (`autopar.runtime.step_guard`), priced in every plan.

Every step, on every device: one pass reading its gradients (their norm, which also tells a non-finite one), and
one all-reduce of three fp64 numbers (the sum of squares, the non-finite flag, the tokens) over every device of
the job. With clipping (`max_grad_norm`), a second pass reads and writes the gradients to scale them. The passes
run at the device's memory bandwidth:

    t = (1 + 2·clip) · G / bandwidth + all_reduce(24 bytes, world)

with G the bytes of gradients the device holds. The all-reduce is latency-bound: one call's latency on the group
spanning the world (`comm.estimate_collective_time`; on GPUs NCCL's cheapest algorithm for its size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_model.comm import Collective, estimate_collective_time

if TYPE_CHECKING:  # the cluster module reads the cost model's device figures: only its type is named here
    from autopar.cluster import ClusterSpec

GUARD_REDUCE_BYTES = 24  # three fp64 numbers


def estimate_step_guard_time_s(cluster: ClusterSpec, local_grad_bytes: float, *, clip: bool) -> float:
    """Seconds the step guard adds to one step on a device holding `local_grad_bytes` of gradients.

    Args:
        cluster: the whole job's devices (the all-reduce spans all of them).
        local_grad_bytes: the gradients this device holds when the optimizer steps.
        clip: whether the gradients are clipped (a second pass that scales them).
    """
    passes = 3.0 if clip else 1.0  # read; read and write
    memory_s = passes * max(local_grad_bytes, 0.0) / cluster.device.memory_bandwidth_bytes_per_s
    world = cluster.world_size
    link = cluster.link_for_axis(world, 1)
    return memory_s + estimate_collective_time(Collective.ALL_REDUCE, GUARD_REDUCE_BYTES, world, link)

"""Bytes a device holds: model states (`StateMemory`), and what the program's communication holds besides them.

    M_state   parameter, gradient and optimizer bytes of a parameter's local shard under ZeRO stage s: weights
              split over the data axis from stage 3, gradients from stage 2, optimizer states from stage 1
    overlap   ZeRO-1 that reduces once a step keeps each split parameter's whole fp32 gradient
              (`overlap_grad_bytes`); ZeRO-2/3 with overlap hold the gradient buckets of one backward in flight
              (`in_flight_grad_bytes`); weights gathered ahead of their use (`prefetch_bytes`)

`StateMemory` takes explicit facts (precision, the data axis's size, the bucket size, a parameter's elements) and no
program, so each figure can be checked by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.sharding.precision import Precision
from autopar.program_comm import ProgramComm
from autopar.units import BUCKETS_IN_FLIGHT, FP32_BYTES


@dataclass(frozen=True, slots=True)
class StateMemory:
    """Bytes of one parameter's states on a device, and of the gradient buckets and gathered weights a program holds.

    A parameter is given by `numel`, the elements of its local shard on the tensor axis (whole on the data axis).

    Args:
        precision: the bytes of each state.
        data_ranks: ranks on the data axis (dp·cp), over which ZeRO shards the states.
        bucket_bytes: a gradient bucket (`autopar.units.PRICED_BUCKET_BYTES`).
    """

    precision: Precision
    data_ranks: int
    bucket_bytes: float

    def state_bytes(self, numel: float, zero_stage: int, requires_grad: bool = True) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes of one parameter's local shard under `zero_stage`; a frozen
        parameter has weights only."""
        pr, dp = self.precision, self.data_ranks
        params = numel * pr.param_bytes / (dp if zero_stage >= 3 else 1)
        if not requires_grad:
            return params, 0.0, 0.0
        grads = numel * pr.grad_bytes_at(zero_stage) / (dp if zero_stage >= 2 else 1)
        opt = numel * pr.optimizer_bytes / (dp if zero_stage >= 1 else 1)
        return params, grads, opt

    def overlap_grad_bytes(self, comm: ProgramComm, numel: float, requires_grad: bool = True) -> float:
        """Gradient bytes a ZeRO-1 program that reduces once a step (`ProgramComm.accumulates_whole_grads`) holds
        beyond `state_bytes`': it accumulates each split parameter's whole gradient in its master's format (fp32) on
        every rank until the last micro-batch's buckets reduce-scatter it (`runtime.sharded`), where `state_bytes`
        counts the gradient as reduce-scattered in the compute format. ZeRO-2/3 reduce-scatter every micro-batch's
        gradients and hold whole ones only while their bucket fills (`in_flight_grad_bytes`, per step, not per
        parameter). Device memory only: the offload program (ZeRO-3 chunks) keeps `state_bytes`' gradients."""
        if not comm.accumulates_whole_grads or not requires_grad:
            return 0.0
        return max(numel * FP32_BYTES - self.state_bytes(numel, comm.zero_stage)[1], 0.0)

    def bucket_sizes(self, numels: list[float], zero_stage: int) -> list[float]:
        """The gradient buckets in launch order, as bytes in the format they are reduced in at `zero_stage`, of
        parameters of `numels` elements given in the order backward completes their gradients
        (`autopar.program_comm.gradient_order`): a bucket is closed once it holds `bucket_bytes` (so it may exceed
        them by its last member)."""
        sizes: list[float] = []
        for numel in numels:
            if not sizes or sizes[-1] >= self.bucket_bytes:
                sizes.append(0.0)
            sizes[-1] += numel * self.precision.grad_bytes_at(zero_stage)
        return sizes

    def in_flight_grad_bytes(self, comm: ProgramComm, sizes: list[float]) -> float:
        """Gradient bytes ZeRO-2/3 with overlap hold beyond `state_bytes`': the buckets (`sizes`, in launch order) of
        one micro-batch's backward (`runtime.sharded`). A bucket's send buffer (B_j bytes, the compute format) is made
        when its first gradient comes in, backward writing its members' gradients into it (no other whole copy); at
        its launch the oldest bucket in flight is waited for if W = `units.BUCKETS_IN_FLIGHT` are, and this rank's
        piece (B_j / dp) is made; both live until it is waited for. So:

            max_j max( B_j + (1 + 1/dp) (B_{j-1} + ... + B_{j-W}),          bucket j filling
                       (1 + 1/dp) (B_j + B_{j-1} + ... + B_{j-W+1}) )      bucket j launched
        """
        if not (comm.reduces_every_microbatch and comm.overlaps_data_axis):
            return 0.0
        w, both = BUCKETS_IN_FLIGHT, 1.0 + 1.0 / self.data_ranks

        def launched(first: int, last: int) -> float:  # buckets first..last (indices clipped at 0), in flight
            return both * sum(sizes[max(first, 0) : last + 1])

        return max((max(b + launched(j - w, j - 1), launched(j - w + 1, j)) for j, b in enumerate(sizes)), default=0.0)

    def prefetch_bytes(self, prefetch_depth: int, layer_numels: list[float]) -> float:
        """Weights gathered ahead of their use: `prefetch_depth` times the largest layer's (of `layer_numels`, its
        trainable elements), in the compute format."""
        return prefetch_depth * max(layer_numels, default=0.0) * self.precision.param_bytes

"""The coefficients of one mesh's integer program, by parameter group, strategy and ZeRO stage.

Each ZeRO stage the program considers runs as one program (`comm`: its `ProgramComm`); each price asks the pricing
objects (`sync.SyncPricing`, `memory.StateMemory`, `offload.ChunkPricing`) about a group's local elements under that
declaration. The families of `program.ShardingProgram` read these figures; the pipeline search and the per-layer
activation plan read them too.

Experts split over an ep group (`cost_model.experts.ExpertSplit`, the expert-parallel program): an expert weight's
local elements are 1 / ep of its own, so its states, its optimizer step and its gradient sync shrink with them; its
gradient is all-reduced over the dp / ep ranks holding the same experts (`expert_sync`, their link), in buckets of
its own (the program starts a bucket where the group changes), whose one latency a step pays besides the dense
weights' (`sync_floor`).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

from autopar import units
from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import optimizer_step_time_s
from autopar.cost_model.experts import ExpertSplit
from autopar.passes.sharding.groups import MeshGroups
from autopar.passes.sharding.memory import StateMemory
from autopar.passes.sharding.offload import ChunkPricing, model_param_specs
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.sync import SyncPricing
from autopar.plan import ProgramKind, program_kind
from autopar.program_comm import ProgramComm, gradient_order
from autopar.units import FP32_BYTES


class MeshPrices:
    """The prices of one (dp, tp) mesh's choices at m micro-batches (see the module docstring).

    Args:
        groups: the mesh's decision groups.
        cluster: the devices and links; `dp` the data axis (dp·cp ranks), `tp` the tensor axis.
        estimator: a ComputeEstimator (the optimizer step, the sharded runtime's per-op cost).
        precision: the bytes of each state.
        budget: the device memory budget (the offload program sizes its chunks under it).
        overlap: whether the program overlaps its data-axis collectives, as priced (off where the device hides
            nothing behind compute); `prefetch_depth` as resolved for it.
        offload: whether states may go to the host (False, None: the solver decides, True: all of them).
        pipeline_stage: priced as a pipeline's stage; `step_gathers`: its ZeRO-1 gathers weights once a step.
        cp: the cp degree (the data axis counts its ranks).
        experts: the expert weights split over an ep group of the data axis, and its size (None: none).
    """

    def __init__(
        self,
        groups: MeshGroups,
        cluster: ClusterSpec,
        *,
        dp: int,
        tp: int,
        estimator,
        precision: Precision,
        budget: float,
        overlap: bool,
        prefetch_depth: int,
        offload: bool | None,
        pipeline_stage: bool,
        step_gathers: bool,
        cp: int = 1,
        experts: ExpertSplit | None = None,
    ):
        self.mesh_groups, self.graph, self.cluster = groups, groups.graph, cluster
        self.dp, self.tp, self.mb, self.cp = dp, tp, groups.mb, cp
        self.estimator, self.precision = estimator, precision
        self.overlap, self.prefetch_depth = overlap, prefetch_depth
        self.offload, self.pipeline_stage, self.step_gathers = offload, pipeline_stage, step_gathers
        self.dp_link = cluster.link_for_axis(dp, tp)
        self._comms: dict[int, ProgramComm] = {}  # ZeRO stage -> the declaration of the program that runs it
        self.state_memory = StateMemory(precision, dp, units.PRICED_BUCKET_BYTES)
        chunks = None
        if offload is True and dp > 1:  # the offload program may run the layout: its chunks' prices
            chunk_budget = budget if math.isfinite(budget) else cluster.device.memory_bytes
            chunks = ChunkPricing(tuple(model_param_specs(self.graph)), dp, self.dp_link, precision, chunk_budget)
        device = cluster.device
        hbm = device.memory_bandwidth_bytes_per_s * device.memory_efficiency  # what unpacking a gather copies at
        self.sync = SyncPricing(dp, self.dp_link, precision, units.PRICED_BUCKET_BYTES, chunks, hbm)
        self.experts = experts if experts is not None and experts.degree > 1 else None
        self.expert_sync = None
        if self.experts is not None:  # the ranks holding the same experts: one of each ep group, stride ep·tp
            replicas = self.experts.replicas(dp)
            link = cluster.link_for_axis(replicas, self.experts.degree * tp)
            self.expert_sync = SyncPricing(replicas, link, precision, units.PRICED_BUCKET_BYTES, hbm_bytes_per_s=hbm)

    def comm(self, stage: int) -> ProgramComm:
        """The declaration of the program that runs this mesh's layout at ZeRO stage `stage`, as it is priced: the
        rule of `autopar.plan.program_kind` (a pipeline stage runs the pipeline program whatever its layout), the
        offload program for ZeRO-3 with offload pinned on a data axis, and overlap off where the device hides
        nothing behind compute (eta = 0: such a program is priced as its synchronous one). A pipeline stage's
        overlap is `step_gathers`, its plan's (its program reduces after the schedule, priced by the search)."""
        found = self._comms.get(stage)
        if found is None:
            if stage == 3 and self.offload is True and self.dp > 1:
                kind = ProgramKind.OFFLOAD
            else:
                kind = program_kind(pp=2 if self.pipeline_stage else 1, tp=self.tp, cp=self.cp, zero_stage=stage)
            overlap = self.step_gathers if self.pipeline_stage else self.overlap
            found = ProgramComm(kind, stage, self.dp, overlap, self.prefetch_depth, self.mb)
            self._comms[stage] = found
        return found

    def is_expert(self, name: str) -> bool:
        """Whether parameter group `name` is an expert weight split over the ep group."""
        return self.experts is not None and self.graph.params[name].name in self.experts.params

    def local_numel(self, name: str, k: int) -> float:
        """Elements of parameter group `name`'s local shard under strategy k: split on the tensor axis as k says, and
        over the ep group for an expert weight."""
        numel = self.mesh_groups.tp_numel(name, k)
        return numel / self.experts.degree if self.is_expert(name) else numel

    def _sync(self, name: str) -> SyncPricing:
        """The pricing of parameter group `name`'s gradient sync: over the expert replicas for an expert weight."""
        return self.expert_sync if self.is_expert(name) else self.sync

    def _trainable(self, name: str) -> bool:
        return self.graph.params[name].requires_grad

    @functools.cached_property
    def _layer_sizes(self) -> dict[tuple, int]:
        """Trainable weights per repeated layer (`ParamInfo.layer`): what one of the sharded program's layer
        gathers brings (`SyncPricing.gather_latency`)."""
        sizes: dict[tuple, int] = defaultdict(int)
        for info in self.graph.params.values():
            if info.requires_grad and info.layer[0] is not None:
                sizes[info.layer] += 1
        return dict(sizes)

    def _members(self, name: str) -> int:
        """The trainable weights gathered with parameter `name` in one all-gather: those of its layer (itself alone
        outside numbered layers)."""
        layer = self.graph.params[name].layer
        return self._layer_sizes.get(layer, 1) if layer[0] is not None else 1

    # ------------------------------------------------------------------ memory

    def state_bytes(self, name: str, k: int, stage: int) -> tuple[float, float, float]:
        """M_state[w,k,s]: (parameter, gradient, optimizer) bytes of one parameter's local shard under `stage`."""
        return self.state_memory.state_bytes(self.local_numel(name, k), stage, self._trainable(name))

    def overlap_grad_bytes(self, name: str, k: int, stage: int) -> float:
        """The whole fp32 gradient a ZeRO-1 layout that reduces once a step holds (`StateMemory.overlap_grad_bytes`)."""
        return self.state_memory.overlap_grad_bytes(self.comm(stage), self.local_numel(name, k), self._trainable(name))

    def in_flight_grad_bytes(self, stage: int) -> float:
        """The gradient buckets ZeRO-2/3 with overlap hold in flight (`StateMemory.in_flight_grad_bytes`): the
        buckets as the runtime makes them, their parameters whole on the tensor axis (an upper bound where the tensor
        axis splits some)."""
        sizes = self.state_memory.bucket_sizes(self._gradient_numels, stage)
        return self.state_memory.in_flight_grad_bytes(self.comm(stage), sizes)

    @functools.cached_property
    def _gradient_numels(self) -> list[float]:
        """Elements of every trainable parameter of the model, in the order backward completes their gradients."""
        trainable = {info.node_name: info for info in self.graph.params.values() if info.requires_grad}
        return [trainable[name].meta.numel for name in gradient_order(self.graph.graph, list(trainable))]

    def prefetch_bytes(self, stages) -> float:
        """Gathered weights in flight ahead of their use where one of `stages` overlaps from ZeRO-1 with prefetch:
        `prefetch_depth` times the largest layer's weights, whole (an upper bound where the tensor axis splits some);
        in the offload program, which prefetches one chunk ahead whatever the depth, the largest chunk's payload
        (none with one chunk)."""
        if not (self.prefetch_depth and any(s >= 1 and self.comm(s).overlaps_data_axis for s in stages)):
            return 0.0
        if all(self.comm(s).runs_chunks for s in stages):
            return self.sync.chunks.prefetch_bytes()
        layers: dict = defaultdict(float)
        for info in self.graph.params.values():
            if info.requires_grad:
                layers[info.layer if info.layer[1] is not None else info.name] += info.meta.numel
        return self.state_memory.prefetch_bytes(self.prefetch_depth, list(layers.values()))

    def host_capacity(self) -> float:
        """Host bytes one device may use: its share of its node's host memory."""
        return self.cluster.host_memory_bytes_per_device

    def states_lower_bound(self, stages, built_stages) -> float:
        """Device bytes of the states at their leanest over `stages`: without offload each parameter's least total;
        with it, the least weights, gradients and optimizer states less what the host can take (gradients and
        optimizer states up to its capacity) and the weights that leave with those optimizer states. Weights
        gathered ahead count as `prefetch_bytes` of `built_stages` (the stages whose variables exist: none before
        the program is built)."""
        states, weights, movable, opt = 0.0, 0.0, 0.0, 0.0
        for name in self.mesh_groups.param_groups():
            grp = self.mesh_groups.groups[name]
            per = [self.state_bytes(name, k, s) for k in range(len(grp.strategies)) for s in stages]
            states += grp.count * min(sum(b) for b in per)
            weights += grp.count * min(b[0] for b in per)
            movable += grp.count * min(b[1] + b[2] for b in per)
            opt += grp.count * min(b[2] for b in per)
        # every allowed stage gathers its weights, ahead of use with prefetch (`prefetch_bytes`)
        overlapping = stages and all(s >= 1 and self.comm(s).overlaps_data_axis for s in stages)
        ahead = self.prefetch_bytes(built_stages) if overlapping else 0.0
        if self.offload is False or self.dp > 1 and 3 not in stages:
            # the gradient buckets in flight of every allowed stage (`in_flight_grad_bytes`; none where offload may
            # run the stage-3 layouts as the offload program)
            return states + ahead + min((self.in_flight_grad_bytes(s) for s in stages), default=0.0)
        host = self.host_capacity()
        leaving = min(movable, host) + self.precision.param_bytes / self.precision.optimizer_bytes * min(opt, host)
        return min(states, max(0.0, weights + movable - leaving)) + ahead

    # ------------------------------------------------------------------ time

    def sync_time(self, name: str, k: int, stage: int) -> float:
        """Sync[w,k,s]: gradient synchronisation (and ZeRO weight gathers) of one parameter over the data axis
        (`SyncPricing.sync_time`)."""
        if not self._trainable(name):
            return 0.0
        return self._sync(name).sync_time(self.comm(stage), self.local_numel(name, k), self._members(name))

    def step_gather_time(self, name: str, k: int, stage: int) -> float:
        """The part of `sync_time` that gathers a pipeline's ZeRO-1 weight before its schedule starts."""
        if not self._trainable(name):
            return 0.0
        return self._sync(name).step_gather_time(self.comm(stage), self.local_numel(name, k))

    def sharded_sync_parts(self, name: str, k: int, stage: int) -> tuple[float, float, float, float]:
        """(G_bw, G_fix, A_bw, A_fix) of one parameter in the sharded program with overlap (`SyncPricing`)."""
        return self._sync(name).sharded_parts(self.comm(stage), self.local_numel(name, k), self._members(name))

    def bucket_latency_s(self, name: str, k: int, stage: int) -> float:
        """The latency part of `sync_time` where gradients go out in buckets once a step (`SyncPricing`)."""
        if not self._trainable(name):
            return 0.0
        return self._sync(name).bucket_latency_s(self.comm(stage), self.local_numel(name, k))

    def sync_floor(self, stage: int) -> float:
        """Latency of the one bucket a step with any gradient pays (`SyncPricing.floor`); with experts split, one
        of their own buckets besides."""
        floor = self.sync.floor(self.comm(stage))
        if self.expert_sync is not None:
            floor += self.expert_sync.floor(self.comm(stage))
        return floor

    def regather_s(self, name: str, k: int, stage: int) -> float:
        """Seconds a step spends gathering parameter group `name` (strategy k) again in its recomputed forwards at
        ZeRO stage `stage` (`SyncPricing.regather_s`)."""
        count = self.mesh_groups.groups[name].count
        return self._sync(name).regather_s(self.comm(stage), self.local_numel(name, k), count, self._members(name))

    def grad_bytes(self, stage: int) -> float:
        """The step's gradient bytes at `stage`, every trainable parameter whole."""
        groups, params = self.mesh_groups.groups, self.graph.params
        return sum(
            groups[n].count * params[n].meta.numel * self.precision.grad_bytes_at(stage)
            for n in self.mesh_groups.param_groups()
            if params[n].requires_grad
        )

    def last_bucket_s(self, stage: int = 0) -> float:
        """T_last of the data-parallel program's overlap (`SyncPricing.last_bucket_s`)."""
        return self.sync.last_bucket_s(stage, self.grad_bytes(stage))

    def last_bucket_bw_s(self, stage: int) -> float:
        """T_last,g of the sharded program's overlap (`SyncPricing.last_bucket_bw_s`)."""
        return self.sync.last_bucket_bw_s(self.comm(stage), self.grad_bytes(stage))

    def first_gather_bw_s(self, stage: int) -> float:
        """T_first,a of the sharded program's overlap (`SyncPricing.first_gather_bw_s`): of the first trainable
        parameter the graph reads."""
        names = [n for n in self.mesh_groups.param_groups() if self._trainable(n)]
        numel = self.graph.params[names[0]].meta.numel if names else 0
        return self.sync.first_gather_bw_s(self.comm(stage), numel)

    def optimizer_time(self, name: str, k: int, stage: int) -> float:
        """Opt[w,k,s]: the device's optimizer step over one parameter's local shard (its fp32 weights)."""
        if not self._trainable(name):
            return 0.0
        local = self.local_numel(name, k) / (self.dp if stage >= 1 else 1)
        return optimizer_step_time_s(self.estimator, self.cluster.device, 1, local * FP32_BYTES)

    @functools.cached_property
    def sharded_overhead_s(self) -> float:
        """D: seconds per step the sharded runtime adds over plain tensors (0 where the estimator does not say)."""
        per_op = getattr(self.estimator, "sharded_op_overhead_s", None)
        per_op = per_op() if per_op is not None else 0.0
        if not per_op:
            return 0.0
        ops = sum(self.graph.layer_count.get(n.name, 1) for n in self.graph.graph.nodes if n.op == "call_function")
        return per_op * ops * self.mb

    @functools.cached_property
    def leaving_plain_s(self) -> float:
        """Seconds per step a plain layout (no tensor axis, ZeRO-0) pays when recompute or a layer treatment moves it
        onto the sharded runtime: its per-op host cost (`sharded_overhead_s`), and one all-reduce per parameter's
        gradient where the data-parallel program sends buckets (a pipeline stage sends buckets on either runtime)."""
        if not self.comm(0).runs_plain:
            return 0.0
        extra = 0.0
        if self.dp > 1 and not self.pipeline_stage:
            for name in self.mesh_groups.param_groups():
                info = self.graph.params[name]
                if info.requires_grad:
                    nbytes = info.meta.numel * self.precision.grad_bytes_at(0)
                    extra += self.mesh_groups.groups[name].count * self.sync.unbucketed_extra_s(nbytes)
            extra = max(extra - self.sync_floor(0), 0.0)
        return self.sharded_overhead_s + extra

r"""Prices of the data axis's communication: each parameter's gradient synchronisation and ZeRO weight gathers, as the
program that runs the layout sends them (`autopar.program_comm.ProgramComm`).

    Sync   all-reduce of the local gradient in buckets (the data-parallel program; a pipeline at ZeRO-0);
           reduce-scatter + all-gather of the weights per parameter and micro-batch (the sharded program without
           overlap; ZeRO-3 gathers again for the backward); gradient buckets issued from backward and gathers issued
           ahead (the sharded program with overlap: `sharded_parts`); the bucketed reduce-scatter and one gather a
           step (a pipeline's ZeRO-1 with overlap); the chunks' collectives (the offload program:
           `passes.sharding.offload.ChunkPricing`).

Gradients travel in buckets of `bucket_bytes` (as DDP and FSDP send them), so a small tensor pays a share of one
collective's latency in proportion to its bytes, not a whole one; a step pays at least one bucket's latency
(`floor`). The sharded program gathers a layer's split weights in one all-gather (`ProgramComm.gathers_by_layer`:
one flat buffer a layer, as FSDP gathers them), so a weight that is one of the `members` trainable weights of its
layer pays 1/members of each gather's latency: a layer of P weights gathered r times a step pays r latencies, not
r·P,

    AG_one(w) = (T_AG(bytes_w) - L_AG) + L_AG / members(w),    L_AG = T_AG(1 byte),

its bandwidth part as before (the flat buffer's bytes are the sum of its members'), plus U(w), the copy that takes
the weight out of the gathered buffer (`unpack_time`: 2 · bytes_w read and written at the device's HBM bandwidth, on
the compute stream, so nothing hides it; FSDP2's copy-out is the same pass). A weight outside numbered layers
is a group of its own (members = 1). The reduce-scatters of the synchronous path (one per weight, in its gather's
backward) still pay a whole latency each. The prices split each collective into its bandwidth part, which compute may hide, and its fixed latency,
which nothing hides.

`SyncPricing` takes explicit facts (the data axis's size and link, the precision, the bucket size, a parameter's
elements) and no program, so each price can be checked by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec
from autopar.passes.sharding.offload import ChunkPricing
from autopar.passes.sharding.precision import Precision
from autopar.program_comm import ProgramComm

AR, RS, AG = Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER


@dataclass(frozen=True, slots=True)
class SyncPricing:
    """Seconds of one parameter's data-axis collectives per step, as the program declared by a `ProgramComm` runs them.

    A parameter is given by `numel`, the elements of its local shard on the tensor axis (whole on the data axis);
    only trainable parameters are synchronised (the caller leaves the others out).

    Args:
        data_ranks: ranks on the data axis (dp·cp).
        link: the data axis's link.
        precision: the bytes of each state.
        bucket_bytes: a gradient bucket (`autopar.units.PRICED_BUCKET_BYTES`).
        chunks: the offload program's chunks (where the offload program may run the layout).
    """

    data_ranks: int
    link: LinkSpec
    precision: Precision
    bucket_bytes: float
    chunks: ChunkPricing | None = None
    # the device's achievable HBM bandwidth (bytes read plus written per second) that unpacking a gather runs at;
    # unbounded: unpacking is free (`unpack_time`)
    hbm_bytes_per_s: float = math.inf

    def time(self, kind: Collective, nbytes: float) -> float:
        """One collective of `nbytes` over the data axis."""
        return estimate_collective_time(kind, nbytes, self.data_ranks, self.link)

    def latency(self, kind: Collective) -> float:
        """A collective's fixed cost: one of a single byte."""
        return self.time(kind, 1.0)

    def latency_share(self, kind: Collective, nbytes: float) -> float:
        """`nbytes`' pro-rata share of the latency of the bucket they travel in."""
        return self.latency(kind) * nbytes / self.bucket_bytes

    def bucketed(self, kind: Collective, nbytes: float) -> float:
        """A parameter's share of bucketed collectives: its bytes at full bandwidth, its latency pro rata (`floor`
        adds the latency of the one bucket every step pays at least)."""
        return self.time(kind, nbytes) - self.latency(kind) + self.latency_share(kind, nbytes)

    def gather_latency(self, comm: ProgramComm, members: int = 1) -> float:
        """A weight's share of one gather's fixed latency: 1/members of it where the program gathers a layer's
        `members` weights in one collective (`ProgramComm.gathers_by_layer`), a whole one elsewhere."""
        share = 1.0 / max(members, 1) if comm.gathers_by_layer else 1.0
        return self.latency(AG) * share

    def unpack_time(self, comm: ProgramComm, numel: float, members: int = 1) -> float:
        """U: unpacking one gather of a weight of `numel` elements, a copy on the compute stream that reads the
        gathered buffer and writes the whole weight (2 · numel · param bytes at the HBM bandwidth). A layer's
        gather holds its members rank by rank (`runtime.layer_gather.GroupGather.whole` copies each out); a
        weight gathered alone is concatenated from its pieces (`split_gather`); a layer gather of one member
        gives it as a view of the buffer, no copy."""
        if comm.gathers_by_layer and members <= 1:
            return 0.0
        return 2.0 * numel * self.precision.param_bytes / self.hbm_bytes_per_s

    def gather_time(self, comm: ProgramComm, numel: float, members: int = 1) -> float:
        """AG_one: one gather of a weight of `numel` elements: its bytes at full bandwidth, its share of the
        latency (`gather_latency`) and its unpacking (`unpack_time`)."""
        one, latency = self.time(AG, numel * self.precision.param_bytes), self.latency(AG)
        share = self.gather_latency(comm, members)
        wire = one if share == latency else one - latency + share
        return wire + self.unpack_time(comm, numel, members)

    def sync_time(self, comm: ProgramComm, numel: float, members: int = 1) -> float:
        """Sync: gradient synchronisation (and ZeRO weight gathers) of one parameter per step.

        Gradients accumulate over micro-batches and are reduced once, unless they are sharded (stages 2, 3): then
        every micro-batch's gradient is reduce-scattered; stage 3 also gathers the weights for every micro-batch's
        forward and backward. `members`: the trainable weights of its layer, gathered together (`gather_latency`).
        """
        if self.data_ranks == 1:
            return 0.0
        stage, m = comm.zero_stage, comm.num_microbatches
        grad_bytes = numel * self.precision.grad_bytes_at(stage)
        if comm.buckets_all_reduce:
            return self.bucketed(AR, grad_bytes)
        if comm.overlaps_data_axis:
            return sum(self.sharded_parts(comm, numel, members))
        if stage == 0:  # the sharded runtime reduces each gradient on its own (the backward of its from_local)
            return self.time(AR, grad_bytes)
        # From stage 1 the sharded runtime without overlap reduce-scatters each parameter's gradient on its own (no
        # buckets: a whole latency each) and gathers a layer's weights together (`gather_time`). Each micro-batch's
        # forward gathers it and that gather's backward reduce-scatters its gradient, at every stage; stage 3 gathers
        # it again for the backward (its weights are released after the forward).
        if comm.runs_chunks:  # the offload program: its share of the chunks' collectives
            rs_bw, rs_fix, ag_bw, ag_fix = self.chunks.collectives(numel)
            return (rs_bw + rs_fix + 2 * (ag_bw + ag_fix)) * m
        if comm.gathers_once_a_step:  # once a step: the bucketed reduce-scatter, then the weights' gather
            return self.bucketed(RS, grad_bytes) + self.step_gather_time(comm, numel)
        rs, ag = self.time(RS, grad_bytes), self.gather_time(comm, numel, members)
        return rs * m + ag * (2 * m if stage == 3 else m)

    def step_gather_time(self, comm: ProgramComm, numel: float) -> float:
        """The part of `sync_time` that gathers a ZeRO-1 weight before a pipeline's schedule starts
        (`gathers_once_a_step`): one all-gather of its own, waited on where the step's first forward reads it, so no
        backward hides it."""
        if not comm.gathers_once_a_step:
            return 0.0
        return self.time(AG, numel * self.precision.param_bytes) + self.unpack_time(comm, numel)

    def sharded_parts(self, comm: ProgramComm, numel: float, members: int = 1) -> tuple[float, float, float, float]:
        """(G_bw, G_fix, A_bw, A_fix): one parameter's collectives in the sharded program with overlap, split into
        what compute can hide (bandwidth) and what it cannot (a collective's fixed latency).

        G: its gradient in buckets: all-reduce at stage 0 and reduce-scatter at stage 1 once per step (the last
        micro-batch's backward issues them), reduce-scatter at stages 2 and 3 once per micro-batch (every backward
        issues them); its share of a bucket's latency is pro rata, as in `bucketed`; stage 3's gathers for the
        backward (one per micro-batch) share the link with them during backward, so their bandwidth part is in G_bw
        too. A: its forward gathers (stage 1, 2: once; stage 3: each micro-batch's), each its share of one layer's
        collective (`gather_latency`: 1/members of a latency); with prefetch depth 0 no gather hides (their bandwidth
        in A_fix). The offload program (`ProgramComm.runs_chunks`)
        makes them per chunk: the parameter's share of `ChunkPricing.collectives`, a reduce-scatter and two gathers
        each micro-batch, split the same way.
        """
        stage, m = comm.zero_stage, comm.num_microbatches
        if comm.runs_chunks:  # the offload program: its share of the chunks' collectives, each micro-batch's
            rs_bw, rs_fix, ag_bw, ag_fix = (t * m for t in self.chunks.collectives(numel))
            if not comm.prefetches_chunk:  # backward's gathers wait too
                return rs_bw, rs_fix + 2 * (ag_bw + ag_fix), 0.0, 0.0
            return rs_bw + ag_bw, rs_fix + ag_fix, ag_bw, ag_fix
        grad_bytes = numel * self.precision.grad_bytes_at(stage)
        kind = AR if stage == 0 else RS
        full, latency = self.time(kind, grad_bytes), self.latency(kind)
        per = comm.reductions_per_step
        g_bw, g_fix = (full - latency) * per, latency * grad_bytes / self.bucket_bytes * per
        if stage == 0:
            return g_bw, g_fix, 0.0, 0.0
        runs = m if stage == 3 else 1  # forward gathers; stage 3 gathers as many again for the backward
        one, ag_latency = self.gather_time(comm, numel, members), self.gather_latency(comm, members)
        # the unpacking runs on the compute stream after the gather's wait: nothing hides it, like the latency
        fixed = ag_latency + self.unpack_time(comm, numel, members)
        if stage == 3:
            if comm.prefetch_depth:
                g_bw, g_fix = g_bw + (one - fixed) * runs, g_fix + fixed * runs
            else:
                g_fix += one * runs
        if not comm.prefetch_depth:
            return g_bw, g_fix, 0.0, one * runs
        return g_bw, g_fix, (one - fixed) * runs, fixed * runs

    def reduction_latency(self, comm: ProgramComm) -> float:
        """One bucket's latency per reducing backward of the sharded program with overlap (an all-reduce at stage
        0, a reduce-scatter above), `reductions_per_step` times; none for the offload program, whose chunks' latencies
        are in `sharded_parts`."""
        if comm.runs_chunks:
            return 0.0
        kind = AR if comm.zero_stage == 0 else RS
        return self.latency(kind) * comm.reductions_per_step

    def bucket_latency_s(self, comm: ProgramComm, numel: float) -> float:
        """The latency part of `sync_time` where gradients go out in buckets once a step (`bucketed`: the
        parameter's share of its bucket's latency); 0 elsewhere (the sharded program's collectives price theirs in
        `sharded_parts`). Overlap never hides it: a collective's fixed cost is paid whatever runs beside it."""
        if self.data_ranks == 1:
            return 0.0
        if comm.buckets_all_reduce:
            kind = AR
        elif comm.gathers_once_a_step:
            kind = RS
        else:
            return 0.0
        return self.latency_share(kind, numel * self.precision.grad_bytes_at(comm.zero_stage))

    def floor(self, comm: ProgramComm) -> float:
        """Latency of the one bucket that a step with any gradient pays (the data-parallel program; a pipeline's
        all-reduce at stage 0 and its once-a-step reduce-scatter at stage 1; the sharded runtime pays per
        parameter)."""
        if self.data_ranks == 1:
            return 0.0
        if comm.buckets_all_reduce:
            return self.latency(AR)
        if comm.gathers_once_a_step:
            return self.latency(RS)
        return 0.0

    def last_bucket_s(self, zero_stage: int, grad_bytes: float) -> float:
        """T_last: the bandwidth part of the reduction of the bucket launched when backward ends (its latency is in
        the step with every bucket's): one bucket of min(bucket_bytes, `grad_bytes`, all the step's gradient bytes),
        an all-reduce at ZeRO stage 0 and a reduce-scatter above."""
        kind = AR if zero_stage == 0 else RS
        one = self.time(kind, min(self.bucket_bytes, grad_bytes))
        return max(one - self.latency(kind), 0.0)

    def last_bucket_bw_s(self, comm: ProgramComm, grad_bytes: float) -> float:
        """T_last,g of the sharded program with overlap: `last_bucket_s`, or in the offload program the first
        trainable chunk's reduce-scatter and the gather that starts its backward (`ChunkPricing.last_bucket_bw_s`)."""
        if comm.runs_chunks:
            return self.chunks.last_bucket_bw_s(comm.prefetches_chunk)
        return self.last_bucket_s(comm.zero_stage, grad_bytes)

    def first_gather_bw_s(self, comm: ProgramComm, numel: float) -> float:
        """T_first,a of the sharded program with overlap: the bandwidth part of each micro-batch's first gather, of
        the first trainable parameter the graph reads (`numel` elements, whole on the tensor axis; none: 0); in the
        offload program, of the first chunk."""
        if comm.runs_chunks:
            return self.chunks.first_gather_bw_s() * comm.num_microbatches
        if not numel:
            return 0.0
        one = self.time(AG, numel * self.precision.param_bytes)
        return max(one - self.latency(AG), 0.0) * comm.num_microbatches

    def regather_s(self, comm: ProgramComm, numel: float, count: int = 1, members: int = 1) -> float:
        """Seconds a step spends gathering a weight again in its recomputed forwards, for `count` layers: one
        gather per layer and micro-batch (`gather_time`: its share of its layer's all-gather) where the program
        gathers a weight at each use (`ProgramComm.gathers_at_each_use`), 0 elsewhere."""
        if not comm.gathers_at_each_use:
            return 0.0
        return count * self.gather_time(comm, numel, members) * comm.num_microbatches

    def unbucketed_extra_s(self, grad_bytes: float) -> float:
        """What one gradient's all-reduce costs more on its own than in a bucket (the sharded runtime reduces each
        gradient alone where the data-parallel program buckets them)."""
        return self.time(AR, grad_bytes) - self.bucketed(AR, grad_bytes)

r"""The step of a pipeline at one cut: the transfers between stages, what overlap hides, and the step time T.

Expects each stage's price (`stage_cost.PricedStage`: t_s, S_s, G_s, L_s) and the cluster's links. Gives the
transfers of each stage (`stage_transfers`), the parts of them and of the gradient sync the step waits for under
the overlap the pipeline program runs (`Overlap`), and T (`step_price`). Every hidden figure goes through one rule,
H (`hidden_part`). Nothing here solves a program.

Terms:
    W  world size;  p  stages, each on n = W / p consecutive devices as a dp x tp sub-mesh;  v  chunks per device
    b  samples of a micro-batch per data-parallel rank;  m  micro-batches per step
    t_s, S_s = G_s + A_s + F_s + O_s, L_s  a stage's price (`stage_cost`): compute of a micro-batch, sync of a step
    slots  micro-batch slots a step lasts: m + p - 1, or m + (p - 1) / v interleaved (`schedules.schedule_slots`)

Transfers (-> Implemented in: stage_transfers(), transfer_time(), block_link()):
    c_s  point-to-point transfers of one micro-batch: the boundary activation forward to the next stage and its
         gradient back to the previous one (v of each with interleaving), each device sending b x (bytes per
         sample) / tp over the link between the two device blocks (the inter-node link when the blocks sit on
         different nodes), then an all-gather over tp
    f_s  the fixed part of c_s: each transfer's latency and the all-gather over tp after it
  With a cp axis c_s sends this rank's rows, b sequences of seq/cp tokens: the boundary bytes per sequence
  divided by cp.

Step time, with the overlap the pipeline program runs (`plan.overlap`, on by default)
(-> Implemented in: step_price()):
    GPipe, 1F1B:   T = (m + p - 1)     max_s (t_s + e_s) + max_s (E_s + O_s)     bubble (p - 1) / m
    interleaved:   T = (m + (p - 1)/v) max_s (t_s + e_s) + max_s (E_s + O_s)     bubble (p - 1) / (v m)
  e_s  the exposed part of c_s (-> Implemented in: Overlap.transfer_exposed()). The program posts the receive of
       micro-batch i+1 before micro-batch i's compute and sends asynchronously, so a transfer's bandwidth time runs
       behind the stage's compute of one micro-batch; its per-transfer latency (and the all-gather over tp after
       it) does not hide:
           e_s = c_s - H(c_s - f_s, t_s)
  E_s  the exposed part of the gradient sync G_s (-> Implemented in: Overlap.sync_hidden(), sync_windows(),
       backward_time()). S_s = G_s + A_s + F_s + O_s, O_s the optimizer step, F_s the buckets' latencies, which
       never hide (`MeshPrices.bucket_latency_s` and `sync_floor`). The program sends stage s's gradients in
       buckets, each launched during the stage's last backward of the step as soon as the last of its gradients is
       in (earlier micro-batches only accumulate); only the bucket that backward fills last (L_s, the bandwidth
       part of the first layers') waits for its end. The stages before s still run their last backward after that
       (1F1B and GPipe end with the backwards of stages p-1, ..., 0 in turn), so what is left of the sync hides
       behind that window too, and stage 0's (the last to finish) behind its own backward alone:
           E_s = G_s - H(G_s, w_s + min(b_s, G_s - L_s))
           b_s = BACKWARD_SHARE x t_s / v   its own last backward     w_s = BACKWARD_SHARE x sum_{j<s} t_j / v
       (the data-parallel program's rule, `ShardingProgram.add_overlap_constraint`, with the later window added).
       A_s, a ZeRO-1 stage's weight gathers: with overlap it gathers each split weight once a step, before the
       schedule starts (waited on where the first forward reads it), and reduce-scatters the step's sums of its
       gradients once, in buckets launched as the dp all-reduce's are (`ShardingProgram.step_gathers`); the
       reduce-scatter hides as G_s does, the gathers not.
  H(x, w) = eta min(x, w): the part of x hidden behind w of compute (-> Implemented in: hidden_part()), eta the
       device's overlap efficiency (`DeviceSpec.overlap_efficiency`, 1 where the device has none;
       -> overlap_efficiency()).
  With overlap off (constraints {"overlap": False}) nothing hides: e_s = c_s, E_s = G_s, and
       T = slots max_s (t_s + c_s) + max_s S_s, the program's behaviour without overlap.
  The cut search (`layout_search`) prices stage s alone, so there w_s takes the earlier stages as long as s:
  w_s = BACKWARD_SHARE s t_s / v; the step of a cut is priced with the stages' own t_j. The estimate, before any
  stage program is solved, takes L_s = 0 (it may err low, as an estimate should).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec
from autopar.passes.pipeline.layers import LayerStructure
from autopar.passes.pipeline.schedules import Schedule
from autopar.passes.pipeline.stage_cost import PricedStage

# of a micro-batch's forward and backward, the backward's share: it runs two matmuls for each of the forward's
BACKWARD_SHARE = 2 / 3


# ------------------------------------------------------------------------------ transfers between stages


def block_link(cluster: ClusterSpec, n: int, a: int, b: int) -> LinkSpec:
    """The link device block a (devices a*n .. a*n + n - 1) uses to reach the matching devices of block b."""
    if cluster.num_nodes == 1:
        return cluster.intra_node_link
    per = cluster.devices_per_node
    shift = (b - a) * n
    if any(i // per != (i + shift) // per for i in range(a * n, (a + 1) * n)):
        return cluster.inter_node_link
    return cluster.intra_node_link


@dataclass(frozen=True, slots=True)
class Transfer:
    """c_s, the transfers of one micro-batch of a stage, and f_s, its part that overlap cannot hide (each
    transfer's latency and the all-gather over tp that follows it)."""

    total_s: float = 0.0
    fixed_s: float = 0.0

    def __add__(self, other: Transfer) -> Transfer:
        return Transfer(self.total_s + other.total_s, self.fixed_s + other.fixed_s)

    def __mul__(self, k: int) -> Transfer:
        return Transfer(self.total_s * k, self.fixed_s * k)


def transfer_time(cluster: ClusterSpec, bytes_per_sample: float, link: LinkSpec, b: int, tp: int) -> Transfer:
    """One boundary activation of a micro-batch: 1/tp of it from each device, then an all-gather over tp."""
    full = bytes_per_sample * b
    t = estimate_collective_time(Collective.SEND_RECV, full / tp, 2, link)
    fixed = estimate_collective_time(Collective.SEND_RECV, 0.0, 2, link)  # the latency: no bytes, all steps
    if tp > 1:
        gather = estimate_collective_time(Collective.ALL_GATHER, full, tp, cluster.link_for_axis(tp, 1))
        t += gather
        fixed += gather
    return Transfer(t, fixed)


def stage_transfers(
    cluster: ClusterSpec, structure: LayerStructure, pp: int, tp: int, b: int, schedule: Schedule, v: int
) -> list[Transfer]:
    """c_s of every stage: forward sends to the next stage, backward sends to the previous one."""
    n = cluster.world_size // pp
    chunks = v if schedule == Schedule.INTERLEAVED_1F1B else 1
    out = []
    for s in range(pp):
        fwd = chunks - (1 if s == pp - 1 else 0)  # the last chunk of the model sends nothing forward
        bwd = chunks - (1 if s == 0 else 0)
        t = Transfer()
        if fwd:
            t += (
                transfer_time(
                    cluster, structure.boundary_bytes_per_sample, block_link(cluster, n, s, (s + 1) % pp), b, tp
                )
                * fwd
            )
        if bwd:
            t += (
                transfer_time(
                    cluster, structure.boundary_bytes_per_sample, block_link(cluster, n, s, (s - 1) % pp), b, tp
                )
                * bwd
            )
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------ overlap


def overlap_efficiency(cluster: ClusterSpec) -> float:
    """eta: the share of the communication that can hide behind compute which the device does hide."""
    return float(getattr(cluster.device, "overlap_efficiency", 1.0))


def hidden_part(comm_s: float, window_s: float, eta: float) -> float:
    """H(x, w) = eta min(x, w): the part of `comm_s` of communication that overlap hides behind `window_s` of
    compute (the one rule every hidden figure of this module goes through)."""
    return eta * min(comm_s, max(0.0, window_s))


@dataclass(frozen=True, slots=True)
class Overlap:
    """Whether a pipeline's communication overlaps its compute (`plan.overlap`), and the device's eta."""

    on: bool = True
    eta: float = 1.0

    def transfer_exposed(self, c: Transfer, t_mb: float) -> float:
        """e_s = c_s - H(c_s - f_s, t_s): what the stage waits for of its transfers of one micro-batch."""
        if not self.on:
            return c.total_s
        return c.total_s - hidden_part(c.total_s - c.fixed_s, t_mb, self.eta)

    def sync_hidden(self, grad_sync_s: float, window_s: float, own_s: float, last_s: float = 0.0) -> float:
        """H(G_s, w_s + min(b_s, G_s - L_s)): the part of a stage's gradient sync hidden behind its own last
        backward (`own_s`, b_s: every bucket but the last, `last_s`, goes out while it runs) and the later
        backwards of the step (`window_s`, w_s)."""
        if not self.on:
            return 0.0
        return hidden_part(grad_sync_s, window_s + min(own_s, max(0.0, grad_sync_s - last_s)), self.eta)


def backward_time(t_mb: float, v: int) -> float:
    """BACKWARD_SHARE t / v: the backward in `t_mb` of forward and backward compute, on one of v chunks (b_s, a
    stage's last backward of the step, for t = t_s)."""
    return BACKWARD_SHARE * t_mb / v


def sync_windows(t_mbs: list[float], v: int) -> list[float]:
    """w_s = BACKWARD_SHARE sum_{j<s} t_j / v: the backward the stages before s run after s's last one."""
    out, acc = [], 0.0
    for t in t_mbs:
        out.append(backward_time(acc, v))
        acc += t
    return out


@dataclass(frozen=True, slots=True)
class StepPrice:
    """The step of a pipeline at one cut: T and, per stage, e_s, E_s and what overlap hid of G_s."""

    step_s: float
    transfer_exposed: tuple[float, ...]
    sync_hidden: tuple[float, ...]


def step_price(
    slots: float, stages: list[PricedStage], transfers: list[Transfer], overlap: Overlap, v: int
) -> StepPrice:
    """T = slots max_s (t_s + e_s) + max_s (E_s + O_s) (the module docstring)."""
    exposed = [overlap.transfer_exposed(c, p.t_mb) for p, c in zip(stages, transfers, strict=True)]
    windows = sync_windows([p.t_mb for p in stages], v)
    hidden = [
        overlap.sync_hidden(p.grad_sync(), w, backward_time(p.t_mb, v), p.last_bucket_s)
        for p, w in zip(stages, windows, strict=True)
    ]
    step = slots * max(p.t_mb + e for p, e in zip(stages, exposed, strict=True)) + max(
        p.sync - h for p, h in zip(stages, hidden, strict=True)
    )
    return StepPrice(step, tuple(exposed), tuple(hidden))

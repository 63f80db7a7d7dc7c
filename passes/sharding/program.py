r"""Intra-op sharding as one integer program per 2-D device mesh (dp x tp).

The mesh has a data axis `dp` (outer) and a tensor axis `tp` (inner, so it stays inside a node
while it fits). Activations are split on their batch dimension over `dp`; on `tp` every op picks
one strategy from `sharding_rules`. Parameters pick a placement on `tp`, and one ZeRO stage for
the whole model decides what is sharded over `dp`. One activation recompute mode r for the whole
model (`passes.recompute`: none, selective = attention internals, full = whole layers) decides
which activations are kept and which forwards run twice. Every factorisation dp * tp = world size
is solved, and the cheapest feasible one wins.

Sets:
    G          decision groups: a parameter, an input, or an op with the followers merged into it
               (views and unary ops whose placement follows from their producer's);
               identical layers share the groups of the first layer
    K_g        strategies of group g;  n_g  how many nodes of the model group g stands for
    E          edges (producer group a, consumer group c, argument i), with multiplicity n_e
    W          parameter groups;  Z = {0, 1, 2, 3}  ZeRO stages
    r          the recompute mode (a parameter of the program, like m below);  R_r  the nodes it
               recomputes;  S_r  its segments (a layer, or a layer's attention internals)

Variables:
    x[g,k] in {0,1}      group g runs strategy k
    y[e,k,l] in [0,1]    edge e joins producer strategy k with consumer strategy l
    z[s] in {0,1}        ZeRO stage s is used
    u[w,k,s] in [0,1]    parameter w has placement k under stage s (u = x[w,k] * z[s])
    h_o, h_g >= 0        bytes of optimizer states (fp32 master weights and moments) and of gradients
                         this device keeps on the host (ZeRO-Offload; a fraction of each, as
                         DeepSpeed's Twin-Flow splits them); both 0 when offload is forbidden
    h_p >= 0             bytes of 16-bit (or fp32) weights on the host: those of the chunks whose
                         optimizer states are there (the offload program keeps no device copy of
                         them between uses), so h_p = B_param h_o / B_opt

Objective (predicted step time, seconds; the plain layout's gradient sync overlaps backward, E below; other
communication is not overlapped with compute):
    min  sum_g n_g sum_k x[g,k] (T_fwd[g,k] + T_bwd[g,k])                       compute
       + sum_e n_e sum_{k,l} y[e,k,l] (Rf[e,k,l] + Rb[e,k,l])                   resharding
       + sum_w n_w sum_{k,s} u[w,k,s] Sync[w,k,s]                               gradient sync over dp
                                                                                 (but the plain layout's)
       + E                                                                      exposed sync of the plain
                                                                                 layout (stage 0, no tp)
       + C_o h_o + C_g h_g + C_p h_p                                            host offload
       + D sum_{s: tp > 1 or s >= 1} z[s]                                       sharded-runtime overhead
       + sum_w n_w sum_{k,s} u[w,k,s] Opt[w,k,s] - D_o h_o                      optimizer step
       + sum_g n_g sum_{m in g, m in R_r} sum_k x[g,k] T_fwd[m,k]               recomputed forwards
       + sum_{e into R_r} n_e sum_{k,l} y[e,k,l] Rf[e,k,l]                      and their resharding

    T_*   roofline (or profiled) time of the op's share of work: work / (dp * divisor_k)
    Rf    time to bring the producer's output placement to the placement argument i needs
    Rb    time to bring the gradient the consumer returns to the producer's layout
    E     what the step waits for of the plain layout's bucketed all-reduces, launched from the last
          micro-batch's backward (B its backward seconds, eta the device's overlap_efficiency, 1 on GPUs,
          measured for gloo on CPU, where communication competes with compute for the cores):
          E >= sum Sync_bw - eta B / m,  E >= (1 - eta) sum Sync_bw,  E >= T_last (the bandwidth part of the last
          bucket, launched when backward ends);  hidden = sum Sync_bw - E = eta min(sum Sync_bw, B / m) while the
          last bucket fits behind; Sync_bw is Sync less the buckets' latencies (`bucket_latency_s`, `sync_floor`),
          which are in the step whole: no compute hides a collective's fixed cost. With equal buckets the serial
          link's per-bucket price, max_k (sum_{j >= k} T_j - eta H_k) (H_k the backward left when bucket k goes
          out), is these rows; it is approximated in one respect: the backward before the first bucket fills
          counts as hiding (less than one bucket's share of B, small but for models of a few buckets).
          With overlap off (constraints={"overlap": False}) E is not used and the sync is paid whole
    Sync  all-reduce of the local gradient over dp in buckets (stage 0), reduce-scatter + all-gather
          of the parameters (stages 1, 2), and one more all-gather for the backward (stage 3), one
          collective per parameter and micro-batch (the sharded runtime without overlap redistributes
          each on its own in every micro-batch's forward). With overlap
          (eta > 0), the sharded runtime's part is priced by `add_sharded_overlap_constraint` instead:
          gradients in buckets issued from backward (r = 1 reduction per step at stages 0, 1, from the
          last micro-batch's backward; r = m at stages 2, 3, from every micro-batch's), gathers issued
          `prefetch_depth` layers ahead; only what the backward (gradients) or the forward (gathers)
          cannot hide, and every collective's fixed latency, is in the step:
              E_g >= sum G_bw - eta B r/m, E_g >= (1 - eta) sum G_bw, E_g >= r T_last;
              E_a >= sum A_bw - eta F, E_a >= (1 - eta) sum A_bw, E_a >= T_first;  + sum G_fix + A_fix
    C_o   per byte of optimizer state on the host, its parameter's share of: the gradient down and the
          updated 16-bit (or fp32) weight up the host link, and the CPU AdamW update:
          ((B_grad + B_param) / host_bw + 1 / cpu_adamw_rate) / B_opt
    C_g   per byte of gradient on the host: with m micro-batches every micro-batch's gradient goes down
          (accumulated on the host) instead of the last one only: (m - 1) / host_bw
    D     host seconds the sharded runtime adds to every op of the step by running it on DTensors
          (the estimator's `sharded_op_overhead_s` x ops x m; profiled CPU ranks only), paid by every
          layout but the plain data-parallel one (no tensor axis, stage 0)
    C_p   per byte of weights on the host: they come up for every gather, forward and backward of each
          micro-batch, instead of once after the step: (2m - 1) / host_bw
    Opt   the optimizer step over w's local shard on the device: the estimator's optimizer_step_time_s
          (or the analytic AdamW estimate) of one tensor of its fp32 weights, local on tp, and 1/dp of
          them from stage 1 (each rank updates its shard of every parameter)
    D_o   per byte of optimizer state on the host, the device step it no longer runs (capped at C_o:
          offloading stays a memory measure, never a way to a faster step)

Constraints:
    one strategy:   sum_k x[g,k] = 1                                     for all g
    edge marginals: sum_l y[e,k,l] = x[a,k],  sum_k y[e,k,l] = x[c,l]    for all e
    one stage:      sum_s z[s] = 1   (z[s] = 1 for a pinned stage)
    product:        u[w,k,s] >= x[w,k] + z[s] - 1,  u <= x[w,k],  u <= z[s]
    memory (peak, at the turn from forward to backward, where every saved activation is live):
        sum_w n_w sum_{k,s} u[w,k,s] M_state[w,k,s]  - h_o - h_g - h_p
      + sum_g n_g sum_k x[g,k] M_saved[g,k,r]  + M_recompute  + M_transient   <=  budget
    offload (unless forbidden; "=" instead of "<=" in the first two when everything is pinned to the host):
        h_o <= sum_w n_w sum_{k,s} u[w,k,s] M_opt[w,k,s],   h_g <= sum_w n_w sum_{k,s} u[w,k,s] M_grad[w,k,s]
        B_opt h_g = B_grad h_o           (a gradient lives on the host with its optimizer states)
        h_o + h_g <= host memory / devices per node
        h_o <= (host memory / devices per node) z[3] when dp > 1 (the offload program runs ZeRO-3 chunks)
    recomputed segment (r != none):
        M_recompute >= sum_{m in S, m kept at none, dropped at r} x[g(m),k] M_value[m,k]   for all S in S_r
    tensor split (tp > 1; M the layer matmul weights with a dim divisible by tp, N_w their elements):
        sum_{w in M} n_w N_w sum_{k: split} x[w,k] >= f sum_{w in M} n_w N_w     f = tp_min_split, 1 unless the
                                                                                  user says less

    M_state   parameter, gradient and optimizer bytes of w's local shard under stage s; with the sharded
              program's overlap, plus its whole fp32 gradient at stage 1 (`overlap_grad_bytes`), and the
              memory rows gain sum_{s >= 2} z[s] M_buckets: the gradient buckets in flight at stages 2
              and 3 (`in_flight_grad_bytes`), and the weights gathered ahead of use (`prefetch_bytes`)
    M_saved   bytes of the group's outputs kept for backward under r, split over dp and, where
              the output is sharded, over tp. A value is kept when a consumer outside R_r saves
              it, or when it enters a segment from outside (the checkpoint keeps its inputs);
              values made and used inside one segment are dropped. Under full recompute a layer
              keeps its input only (Korthikanti et al.'s 2sbh per layer, plus shared masks)
    M_recompute  the values the first segment recomputed in backward holds again: the largest
              segment's (identical layers share one expression, so it is usually one row)

Micro-batches (gradient accumulation): with m micro-batches per data-parallel rank every op and
every resharding runs m times on 1/(dp*m) of the batch, activations and working memory shrink by
m, gradients are all-reduced once (stages 0, 1) or reduce-scattered per micro-batch (2, 3) and
ZeRO-3 gathers parameters for each micro-batch's forward and backward. m is a parameter of the
program, not a variable: each mesh is solved at the fewest micro-batches whose memory lower bound
(every choice at its leanest) fits, and at more while that makes the step faster.

The recompute mode is a parameter too: its terms (the objective's recompute part, M_saved(r) and
the M_recompute rows) are built the first time a program is solved with r, and swapped in.

How the programs are solved: the step time never falls as m or recompute grows, nor as the ZeRO
stage grows past 1 (for the same placements); stage 1 can beat stage 0, its optimizer step being 1/dp
of it. So the program at the fewest micro-batches that fit under the leanest allowed mode and no
recompute, solved without the memory row at the lowest stage and at the lowest stage from 1 (the
faster of the two), is a lower bound
L(dp, tp) of everything its mesh can reach. Meshes are visited in order of L; a mesh whose L is not
below the best plan found is not solved further; a mesh whose memory-free optimum fits is done
(recompute is never considered where memory does not bind). Otherwise each recompute mode, none
first, searches its own micro-batch counts (the fewest that fit under it first, more while that
helps), skipped when the best plan found reaches its bound L + sum_g n_g min_k sum_{m in R_r}
T_fwd[m,k] (or its own memory-free optimum at its fewest micro-batches); within a mode each stage
is solved with z fixed (presolve then removes the product rows, which HiGHS solves much faster than
the joint program), stopping at a stage that reaches the mode's bound.

A tensor axis that splits no weight is data parallelism run on DTensors, which the dp mesh of the same size
runs better. So a tensor axis, pinned or searched, splits every layer matmul weight (attention, MLP, experts)
unless `tp_min_split` lowers the fraction, and a mesh with no such weight it can split is dropped; pinned and
searched axes follow one rule, so `compile`, which plans again with the plan's tp pinned, builds what was
priced. What stays replicated, and why, is in the solution.

Offload only adds time (the host link and the CPU step are not overlapped with compute), so a program
keeps states on the host only where memory requires it; it enters the lower bounds above as the
states it can move (capped by host memory), which lets fewer micro-batches and lower stages fit.
Only meshes without a tensor axis (tp = 1) offload, as the offload program runs them.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import pulp
from torch.distributed.tensor import Shard

from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import optimizer_step_time_s
from autopar.errors import ConfigError
from autopar.ir import OpGraph
from autopar.passes.context_parallel import CPPricing
from autopar.passes.sharding.graph import (
    ANY_SPLIT,
    TensorSplit,
    recompute_choices,
)
from autopar.passes.sharding.groups import MeshGroups
from autopar.passes.sharding.memory import ActivationMemory, RecomputeTerms
from autopar.passes.sharding.offload import offload_prices, offload_result
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.prices import MeshPrices
from autopar.passes.sharding.solution import MeshResult
from autopar.program_comm import ProgramComm, resolved_prefetch_depth
from autopar.units import FP32_BYTES


class ShardingProgram:
    """The integer program of one (dp, tp) mesh; see the module docstring for the math."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: ClusterSpec,
        dp: int,
        tp: int,
        *,
        estimator,
        precision: Precision,
        zero_stage: int | None,
        memory_budget_bytes: float,
        batch_dim_size: int,
        num_microbatches: int = 1,
        activation_copies: float = 1.0,
        recompute: str | None = None,
        offload: bool | None = False,
        tensor_split: TensorSplit = ANY_SPLIT,
        pinned_placements: dict | None = None,
        overlap: bool = True,
        cp: CPPricing | None = None,
        prefetch_depth: int | None = None,
        pipeline_stage: bool = False,
        step_gathers: bool = False,
        tp_overlap: bool | None = None,
    ):
        self.graph, self.cluster, self.dp, self.tp = graph, cluster, dp, tp
        # priced as the pipeline program runs a stage (`runtime.pipeline`): its dp-replicated gradients summed over
        # the data axis once a step, in buckets, whatever its tensor and cp axes
        self.pipeline_stage = pipeline_stage
        # and ZeRO-1 as such a stage runs it with overlap: each split weight gathered once a step before the
        # schedule, its fp32 gradient summed over the micro-batches and reduce-scattered once, in buckets
        self.step_gathers = pipeline_stage and step_gathers
        self._step_gather_terms: list = []  # n_g u[g,k,1] A: the step's gathers (`step_gather_time`)
        # the latencies of the bucketed reductions (`bucket_latency_s`, `sync_floor`): in the step, never hidden
        self._sync_fixed_terms: list = []
        # the data-parallel program launches each gradient bucket's all-reduce from backward (asynchronously):
        # price what the last micro-batch's backward hides, at the device's overlap efficiency eta (on CPU ranks
        # gloo's all-reduce runs on the cores the compute needs, so less hides there); pipeline stages reduce
        # after their schedule. Where eta = 0 nothing hides: the program is priced as its synchronous one (`comm`)
        self.eta = cluster.device.overlap_efficiency
        self.overlap = overlap and self.eta > 0
        # the sharded program's data-axis collectives with overlap (`add_sharded_overlap_constraint`): gradient
        # buckets issued from backward, and (depth > 0) split parameters gathered that many layers ahead
        self.prefetch_depth = resolved_prefetch_depth(prefetch_depth, self.overlap)
        # the interpreter launches a tensor-axis collective early where its value's consumer is not the next op
        # (`parallelize.launches_early`, with the plan's overlap; a pipeline stage's program says so apart, as its
        # `overlap` speaks of the data axis): the forward collective runs behind the ops in between
        self.tp_overlap = (overlap if tp_overlap is None else tp_overlap) and self.eta > 0 and tp > 1
        self._tp_hidden_terms: list = []  # what those collectives hide (`_early_window`), per edge choice
        self._bwd_terms: list = []  # n_g x[g,k] T_bwd: backward seconds per step
        self._fwd_terms: list = []  # n_g x[g,k] T_fwd: forward seconds per step
        # the sharded program's hideable communication and the exposed part the objective pays, per family
        self.sharded_hidden: list[tuple[list, pulp.LpVariable]] = []
        self._cp_hidden_terms: list = []  # cp attention's communication its compute hides (`_cp_comm_s`)
        self._offloading = False  # offload pinned: the ZeRO-3 layouts run as the offload program
        self._offload_runs: pulp.LpVariable | None = None  # offload allowed: whether the offload program runs
        self.sync_report: dict[str, list] = {}  # "total": the plain layout's whole sync (what overlap hides from)
        self._exposed: pulp.LpVariable | None = None  # E of `add_overlap_constraint`
        self.cp = cp  # a cp plan: dp counts the data axis's dp·cp ranks, and attention is priced by `cp`
        self.tensor_split = tensor_split
        self.pinned_placements = dict(pinned_placements or {})  # parameter name -> placement string on tp
        # False: states stay on the device; None: the program places them; True: all optimizer states
        # and gradients on the host
        self.offload = offload
        self.h: dict[str, pulp.LpVariable] = {}
        self.mb = num_microbatches
        # micro-batches whose saved activations are alive at once (1 here; a pipeline schedule keeps more)
        self.activation_copies = activation_copies
        if batch_dim_size % (dp * num_microbatches):
            raise ConfigError(
                f"the global batch of {batch_dim_size} does not split into dp={dp} x {num_microbatches} micro-batches"
            )
        self.estimator, self.precision = estimator, precision
        self.zero_choices = [zero_stage] if zero_stage is not None else [0, 1, 2, 3]
        if dp == 1 and zero_stage is None:
            # one rank shards nothing, so stages 2 and 3 are stage 1; stage 1 still differs from 0 where the
            # precision holds its gradients leaner (mixed precision: the compute format, not fp32), as the pipeline
            # search's stages and a pinned stage price it
            self.zero_choices = [0, 1] if precision.grad_bytes_at(1) < precision.grad_bytes_at(0) else [0]
        self.budget = memory_budget_bytes
        self.batch = batch_dim_size
        # recompute modes to consider, the cheapest first; a pinned mode is the only one
        self.recompute_choices = recompute_choices(graph, recompute)
        self.tp_link = cluster.link_for_axis(tp, 1)
        self.prob = pulp.LpProblem(f"sharding_dp{dp}_tp{tp}_mb{num_microbatches}", pulp.LpMinimize)
        self.x: dict[str, list[pulp.LpVariable]] = {}
        self.z: dict[int, pulp.LpVariable] = {}
        self.u: dict[tuple[str, int, int], pulp.LpVariable] = {}
        self.cost_terms: dict[str, list] = defaultdict(list)
        self.memory_terms: dict[str, list] = defaultdict(list)
        self.last_choice: dict[str, int] = {}  # strategy index per group of the last solution
        # the parts that depend on the recompute mode, built when a mode is first solved
        self._modes: dict[str, _ModeTerms] = {}
        self._mode: str | None = None
        self.transient: float | None = None
        self.mesh_groups = MeshGroups(
            graph,
            tp=tp,
            tp_link=self.tp_link,
            data_ranks=dp,
            batch=batch_dim_size,
            num_microbatches=num_microbatches,
            estimator=estimator,
            cp=cp,
        )
        self.groups, self.group_of = self.mesh_groups.groups, self.mesh_groups.group_of
        self.activations = ActivationMemory(self.mesh_groups, activation_copies)
        self.recompute_terms = RecomputeTerms(self.mesh_groups)
        self.prices = MeshPrices(
            self.mesh_groups,
            cluster,
            dp=dp,
            tp=tp,
            estimator=estimator,
            precision=precision,
            budget=memory_budget_bytes,
            overlap=self.overlap,
            prefetch_depth=self.prefetch_depth,
            offload=offload,
            pipeline_stage=pipeline_stage,
            step_gathers=self.step_gathers,
            cp=cp.degree if cp is not None else 1,
        )

    # ------------------------------------------------------------ the mesh's prices, for the searches that read them

    def comm(self, stage: int) -> ProgramComm:
        """The declaration of the program that runs the layout at ZeRO stage `stage` (`MeshPrices.comm`)."""
        return self.prices.comm(stage)

    def sync_time(self, name: str, k: int, stage: int) -> float:
        """Sync[w,k,s] (`MeshPrices.sync_time`)."""
        return self.prices.sync_time(name, k, stage)

    def state_bytes(self, name: str, k: int, stage: int) -> tuple[float, float, float]:
        """M_state[w,k,s] (`MeshPrices.state_bytes`)."""
        return self.prices.state_bytes(name, k, stage)

    def optimizer_time(self, name: str, k: int, stage: int) -> float:
        """Opt[w,k,s] (`MeshPrices.optimizer_time`)."""
        return self.prices.optimizer_time(name, k, stage)

    def last_bucket_s(self, stage: int = 0) -> float:
        """T_last (`MeshPrices.last_bucket_s`)."""
        return self.prices.last_bucket_s(stage)

    def host_capacity(self) -> float:
        """Host bytes one device may use (`MeshPrices.host_capacity`)."""
        return self.prices.host_capacity()

    @property
    def leaving_plain_s(self) -> float:
        """What a plain layout pays when it leaves plain tensors (`MeshPrices.leaving_plain_s`)."""
        return self.prices.leaving_plain_s

    # --------------------------------------------------------------------------------- the program

    def build(self) -> None:
        """Create the variables and every constraint family."""
        for name, grp in self.groups.items():
            self.x[name] = [self.prob.add_variable(f"x_{name}_{k}", cat="Binary") for k in range(len(grp.strategies))]
        for s in self.zero_choices:
            self.z[s] = self.prob.add_variable(f"z_{s}", cat="Binary")
        self.add_one_strategy_constraint()
        self.add_one_stage_constraint()
        self.add_compute_cost()
        self.add_edge_constraint()
        self.add_stage_product_constraint()
        self.add_sharded_runtime_cost()
        self.add_offload_constraint()
        self.add_tensor_split_constraint()
        self.add_pinned_placement_constraint()
        self.add_memory_constraint()

    def cannot_split(self) -> bool:
        """Whether the tensor-split rule asks for a split this mesh has no weight to make."""
        return self.tp > 1 and self.tensor_split.min_fraction > 0 and not self.mesh_groups.splittable_weights()

    def add_tensor_split_constraint(self) -> None:
        """sum_{w in M} n_w N_w sum_{k: split} x[w,k] >= f sum_{w in M} n_w N_w  (f = tp_min_split)."""
        f, weights = self.tensor_split.min_fraction, self.mesh_groups.splittable_weights()
        if not weights or f <= 0:
            return
        size = {w: self.groups[w].count * self.graph.params[w].meta.numel for w in weights}
        total = sum(size.values())
        split = [
            size[w] / total * self.x[w][k]
            for w in weights
            for k, s in enumerate(self.groups[w].strategies)
            if isinstance(s.output, Shard)
        ]
        # fractions of the total keep the coefficients near 1; the slack absorbs their rounding at f = 1
        self.prob += pulp.lpSum(split) >= f - 1e-9, "tp_min_split"

    def add_pinned_placement_constraint(self) -> None:
        """x[w,k] = 1 for the placement k pinned for parameter w."""
        for name, k in self.mesh_groups.pinned_strategies(self.pinned_placements).items():
            self.prob += self.x[name][k] == 1, f"pinned_placement_{name}"

    def add_one_strategy_constraint(self) -> None:
        """sum_k x[g,k] = 1 for every group g."""
        for name, xs in self.x.items():
            self.prob += pulp.lpSum(xs) == 1, f"one_strategy_{name}"

    def add_one_stage_constraint(self) -> None:
        """sum_s z[s] = 1: one ZeRO stage for the whole model."""
        self.prob += pulp.lpSum(self.z.values()) == 1, "one_zero_stage"

    def add_compute_cost(self) -> None:
        """Objective term sum_g n_g sum_k x[g,k] (T_fwd + T_bwd), plus resharding inside merged groups."""
        for name, grp in self.groups.items():
            for k in range(len(grp.strategies)):
                t = back = comm = hid = 0.0
                for m in grp.members:
                    fwd, bwd = self.mesh_groups.op_times(self.graph.node(m), grp.divisor[m][k])
                    t += fwd + bwd
                    back += bwd
                    exposed, hidden = self.mesh_groups.cp_comm_s(m, grp.divisor[m][k])
                    comm, hid = comm + exposed, hid + hidden
                    self.recompute_terms.forward_s[name].setdefault(m, [0.0] * len(grp.strategies))[k] = grp.count * fwd
                # cp attention's exposed communication is a term of its own (the cp axis's), not compute
                self.cost_terms["compute"].append(grp.count * (t - comm) * self.x[name][k])
                if comm:
                    self.cost_terms["cp_comm"].append(grp.count * comm * self.x[name][k])
                if hid:
                    self._cp_hidden_terms.append(grp.count * hid * self.x[name][k])
                if back:
                    self._bwd_terms.append(grp.count * back * self.x[name][k])
                if t - back:
                    self._fwd_terms.append(grp.count * (t - back) * self.x[name][k])
                if grp.extra_s[k]:
                    self.cost_terms["reshard"].append(grp.extra_s[k] * self.x[name][k])

    def add_edge_constraint(self) -> None:
        """y marginals sum_l y[e,k,m] = x[a,k], sum_k y[e,k,m] = x[c,m]; objective n_e * (Rf + Rb - H) * y, H the
        part of Rf a collective launched early hides behind the ops before its consumer (`_early_window`):
        H = eta min(Rf - Rf_fix, W), the collective's latency (Rf_fix) never hidden."""
        for idx, (edge, mult) in enumerate(self.mesh_groups.edges().items()):
            gp, _, gc, c, _ = edge
            gpr, gcr = self.groups[gp], self.groups[gc]
            cost, fwd_cost, hidden = self.mesh_groups.edge_prices(edge, mult, self.eta if self.tp_overlap else 0.0)
            if not any(v for row in cost + hidden for v in row):
                continue
            if gp == gc:  # both ends in one group: the strategy index is shared
                self.cost_terms["reshard"] += [cost[k][k] * self.x[gp][k] for k in range(len(cost)) if cost[k][k]]
                self._tp_hidden_terms += [hidden[k][k] * self.x[gp][k] for k in range(len(cost)) if hidden[k][k]]
                self.recompute_terms.edge_forward += [
                    (c, fwd_cost[k][k], self.x[gp][k], ((gp, k),)) for k in range(len(cost)) if fwd_cost[k][k]
                ]
                continue
            if len(gpr.strategies) == 1 or len(gcr.strategies) == 1:
                for k, row in enumerate(cost):
                    for m, v in enumerate(row):
                        var = self.x[gc][m] if len(gpr.strategies) == 1 else self.x[gp][k]
                        if v:
                            self.cost_terms["reshard"].append(v * var)
                        if hidden[k][m]:
                            self._tp_hidden_terms.append(hidden[k][m] * var)
                        if fwd_cost[k][m]:
                            self.recompute_terms.edge_forward.append((c, fwd_cost[k][m], var, ((gp, k), (gc, m))))
                continue
            y = [
                [self.prob.add_variable(f"y_{idx}_{k}_{m}", 0, 1) for m in range(len(gcr.strategies))]
                for k in range(len(gpr.strategies))
            ]
            for k in range(len(gpr.strategies)):
                self.prob += pulp.lpSum(y[k]) == self.x[gp][k], f"edge_src_{idx}_{k}"
            for m in range(len(gcr.strategies)):
                self.prob += (
                    pulp.lpSum(y[k][m] for k in range(len(gpr.strategies))) == self.x[gc][m],
                    f"edge_dst_{idx}_{m}",
                )
            self.cost_terms["reshard"] += [
                cost[k][m] * y[k][m] for k in range(len(cost)) for m in range(len(cost[0])) if cost[k][m]
            ]
            self._tp_hidden_terms += [
                hidden[k][m] * y[k][m] for k in range(len(cost)) for m in range(len(cost[0])) if hidden[k][m]
            ]
            self.recompute_terms.edge_forward += [
                (c, fwd_cost[k][m], y[k][m], ((gp, k), (gc, m)))
                for k in range(len(cost))
                for m in range(len(cost[0]))
                if fwd_cost[k][m]
            ]

    def add_sharded_runtime_cost(self) -> None:
        """D (sum_s z[s], or sum_{s >= 1} z[s] on a mesh without a tensor axis): the host time the sharded
        runtime adds to every op by running it on DTensors, where the estimator knows it
        (`sharded_op_overhead_s`: profiled on CPU ranks, whose steps are dominated by such costs). A plan
        with no tensor axis and no ZeRO sharding runs as plain tensors (the data-parallel program)."""
        total = self.prices.sharded_overhead_s
        stages = [z for s, z in self.z.items() if not self.prices.comm(s).runs_plain]
        if total and stages:
            self.cost_terms["compute"].append(total * pulp.lpSum(stages))

    def _add_overlap_grads(self) -> None:
        """Memory rows gain what the overlapping sharded program holds beyond `state_bytes`: `overlap_grad_bytes`
        of the layout (ZeRO-1) and `in_flight_grad_bytes` of the stage (ZeRO-2/3), unless the offload program runs
        the layout (offload pinned, or o of `add_offload_constraint` where the solver may offload: it runs at ZeRO-3,
        and its gradient staging buffers, a chunk each, stand in for the buckets; the runtime sizes its chunks so
        that the ones in flight take a small share of the budget, and they are not counted here)."""
        for (name, k, s), u in self.u.items():
            extra = self.groups[name].count * self.prices.overlap_grad_bytes(name, k, s)
            if extra and not (self._offloading and s == 3):
                self.memory_terms["grads"].append(extra * u)
        for s, z in self.z.items():
            buffers = self.prices.in_flight_grad_bytes(s)
            if buffers and not (self._offloading and s == 3):
                self.memory_terms["grads"].append(buffers * z)
                if s == 3 and self._offload_runs is not None:  # z[3] - o: the sharded program runs the layout
                    self.memory_terms["grads"].append(-buffers * self._offload_runs)

    def add_stage_product_constraint(self) -> None:
        """u[w,k,s] >= x[w,k] + z[s] - 1, u <= x[w,k], u <= z[s]; objective n_w * Sync * u (the plain layout's
        part through `add_overlap_constraint`)."""
        plain = []  # the sync terms of the plain layout, when its all-reduces overlap backward
        # the sharded program's hideable parts (`sharded_sync_parts`); gradients by how often a step reduces them (one
        # list where m = 1)
        grads: dict[int, list] = {1: [], self.mb: []}
        gathers = []
        for name in self.mesh_groups.param_groups():
            grp = self.groups[name]
            for k in range(len(grp.strategies)):
                for s, zs in self.z.items():
                    u = self.prob.add_variable(f"u_{name}_{k}_{s}", 0, 1)
                    self.u[(name, k, s)] = u
                    if len(self.z) > 1:
                        self.prob += u >= self.x[name][k] + zs - 1, f"zero_product_lo_{name}_{k}_{s}"
                        self.prob += u <= zs, f"zero_product_hi_{name}_{k}_{s}"
                    else:
                        self.prob += u >= self.x[name][k], f"zero_product_lo_{name}_{k}_{s}"
                    self.prob += u <= self.x[name][k], f"zero_product_x_{name}_{k}_{s}"
                    t = self.prices.sync_time(name, k, s)
                    if t and self.prices.comm(s).overlaps_data_axis:
                        g_bw, g_fix, a_bw, a_fix = self.prices.sharded_sync_parts(name, k, s)
                        grads[self.prices.comm(s).reductions_per_step].append(grp.count * g_bw * u)
                        gathers += [grp.count * a_bw * u] if a_bw else []
                        self.cost_terms["grad_sync"].append(grp.count * (g_fix + a_fix) * u)
                    elif t:
                        fixed = self.prices.bucket_latency_s(name, k, s)  # a bucketed reduction's latency never hides
                        if self.prices.comm(s).overlaps_all_reduce:
                            plain.append(grp.count * (t - fixed) * u)
                            self.cost_terms["grad_sync"].append(grp.count * fixed * u)
                        else:
                            self.cost_terms["grad_sync"].append(grp.count * t * u)
                        if fixed:
                            self._sync_fixed_terms.append(grp.count * fixed * u)
                        gather = self.prices.step_gather_time(name, k, s)
                        if gather:
                            self._step_gather_terms.append(grp.count * gather * u)
                    t = self.prices.optimizer_time(name, k, s)
                    if t:
                        self.cost_terms["optimizer"].append(grp.count * t * u)
        for s, zs in self.z.items():
            if self.prices.sync_floor(s):
                self.cost_terms["grad_sync"].append(self.prices.sync_floor(s) * zs)
                self._sync_fixed_terms.append(self.prices.sync_floor(s) * zs)
        if plain:
            self.add_overlap_constraint(plain)
        if any(self.prices.comm(s).overlaps_data_axis for s in self.z):
            self.add_sharded_overlap_constraint(grads, gathers)

    def hiding(self, compute: list):
        """The compute time communication can hide behind: the compute terms' sum (one helper, so that a device's
        overlap efficiency can scale every hidden part in one place)."""
        return pulp.lpSum(compute) * getattr(self.cluster.device, "overlap_efficiency", 1.0)

    def add_sharded_overlap_constraint(self, grads: dict[int, list], gathers: list) -> None:
        """The sharded program with overlap; objective E_g + E_a + fixed costs instead of sum(Sync):

            E_g >= sum G_bw - eta B r / m,  E_g >= (1 - eta) sum G_bw,  E_g >= r T_last,g z[s]   (gradient buckets
                                                                            behind the backwards that issue them)
            E_a >= sum A_bw - eta F,      E_a >= (1 - eta) sum A_bw,  E_a >= T_first,a z[s]  (gathers ahead of use
                                                                            behind the forward, depth > 0)

        summed over the sharded stages s (one z[s] is 1), eta the device's overlap efficiency (`hiding`; hidden =
        eta min(communication, compute), as in `add_overlap_constraint`). A step reduces each gradient r times
        (`ProgramComm.reductions_per_step`): once at stages 0 and 1, from the last micro-batch's backward (B / m
        hides them), once per micro-batch at stages 2 and 3, each micro-batch's backward hiding its own buckets (r B
        / m = B);
        one E_g per r, over the stages that reduce r times (the other's terms are 0 where its stages are not
        chosen). Exposed = what the communication needs beyond the compute it hides behind (the backward of the
        layers after each bucket; F: the forward of the layers before each gather, every micro-batch's), never less
        than the collectives nothing hides: the last bucket of each reducing backward, issued when it ends (T_last,g:
        the bandwidth part of one bucket of min(BUCKET_BYTES, all gradient bytes); the offload program's chunks in
        `last_bucket_bw_s`), and each micro-batch's first
        gather, which no layer precedes (T_first,a: the first parameter's, m times; stage 3's backward gathers are in
        G_bw: they share the backward's link with the buckets). The fixed latency of every collective (G_fix, A_fix
        of `sharded_sync_parts`) and one bucket's latency per reducing backward are in the objective as they are:
        they never hide.
        """
        sharded = [s for s in self.z if self.prices.comm(s).overlaps_data_axis]
        for r, terms in sorted(grads.items()):
            stages = [s for s in sharded if self.prices.comm(s).reductions_per_step == r]
            if not stages:
                continue
            suffix = "" if r == 1 else "_per_microbatch"
            e_g = self.prob.add_variable(f"exposed_sharded_grads{suffix}", 0)
            hides = self.hiding(self._bwd_terms) * (r / self.mb)
            self.prob += e_g >= pulp.lpSum(terms) - hides, f"sharded_exposed_grads{suffix}"
            last = pulp.lpSum(r * self.prices.last_bucket_bw_s(s) * self.z[s] for s in stages)
            self.prob += e_g >= last, f"sharded_last_bucket{suffix}"
            if self.eta < 1:  # at most the share eta of the communication hides, however long the compute
                self.prob += e_g >= pulp.lpSum(terms) * (1.0 - self.eta), f"sharded_grads_efficiency{suffix}"
            self.cost_terms["grad_sync"].append(e_g)
            self.sharded_hidden.append((terms, e_g))
        for s in sharded:
            if self.prices.comm(s).runs_chunks:  # one latency per chunk, in G_fix already
                continue
            self.cost_terms["grad_sync"].append(self.prices.sync.reduction_latency(self.prices.comm(s)) * self.z[s])
        if gathers:
            e_a = self.prob.add_variable("exposed_sharded_gathers", 0)
            self.prob += e_a >= pulp.lpSum(gathers) - self.hiding(self._fwd_terms), "sharded_exposed_gathers"
            first = pulp.lpSum(self.prices.first_gather_bw_s(s) * self.z[s] for s in sharded if s >= 1)
            self.prob += e_a >= first, "sharded_first_gather"
            if self.eta < 1:
                self.prob += e_a >= pulp.lpSum(gathers) * (1.0 - self.eta), "sharded_gathers_efficiency"
            self.cost_terms["grad_sync"].append(e_a)
            self.sharded_hidden.append((gathers, e_a))

    def add_overlap_constraint(self, plain: list) -> None:
        """E >= sum(plain) - eta B / m, E >= (1 - eta) sum(plain), E >= T_last z[s], E >= 0; objective E instead
        of sum(plain).

        The data-parallel program's all-reduces (sum(plain): every bucket's bandwidth time) run while the last
        micro-batch's backward (B / m, B the step's backward) goes on. Of that, the share eta
        (`DeviceSpec.overlap_efficiency`) hides: hidden = eta min(sum(plain), B / m), and the first two rows are
        exposed = sum(plain) - hidden. The last bucket (the first parameters, whose gradients come last) is
        launched when backward ends and is exposed whole (T_last: the bandwidth part of one all-reduce of
        min(BUCKET_BYTES, all gradient bytes)). The buckets' latencies (`bucket_latency_s`, `sync_floor`) are in
        the objective as they are: they never hide."""
        s = next(s for s in self.z if self.prices.comm(s).runs_plain)
        e = self.prob.add_variable("exposed_sync", 0)
        backward = pulp.lpSum(self._bwd_terms) * (self.eta / self.mb)
        self.prob += e >= pulp.lpSum(plain) - backward, "overlap_exposed_sync"
        if self.eta < 1:
            self.prob += e >= pulp.lpSum(plain) * (1.0 - self.eta), "overlap_efficiency"
        self.prob += e >= self.prices.last_bucket_s() * self.z[s], "overlap_last_bucket"
        self.cost_terms["grad_sync"].append(e)
        self.sync_report["total"] = plain
        self._exposed = e

    def add_offload_constraint(self) -> None:
        """h_o <= sum n u M_opt, h_g <= sum n u M_grad (= when pinned), B_opt h_g = B_grad h_o,
        B_opt h_p = B_param h_o, h_o + h_g <= host memory per device; objective C_o h_o + C_g h_g + C_p h_p;
        memory rows lose h_o + h_g + h_p.

        h_p: the weights of the chunks whose optimizer states are on the host. The offload program keeps
        no device copy of them between uses (each gather brings the shard up from the host's master
        weights), so they leave the device with their states, and pay the host link at every gather."""
        if self.offload is False:
            return
        opt, grad = [], []
        for (name, k, s), u in self.u.items():
            _, g, o = self.prices.state_bytes(name, k, s)
            count = self.groups[name].count
            opt += [count * o * u] if o else []
            grad += [count * g * u] if g else []
        h_o = self.h["optimizer"] = self.prob.add_variable("offload_optimizer_bytes", 0)
        h_g = self.h["grads"] = self.prob.add_variable("offload_grad_bytes", 0)
        h_p = self.h["params"] = self.prob.add_variable("offload_param_bytes", 0)
        if self.offload is True:
            self.prob += h_o == pulp.lpSum(opt), "offload_optimizer_all"
            self.prob += h_g == pulp.lpSum(grad), "offload_grads_all"
        else:
            self.prob += h_o <= pulp.lpSum(opt), "offload_optimizer_at_most_all"
            self.prob += h_g <= pulp.lpSum(grad), "offload_grads_at_most_all"
        pr = self.precision
        # the offload program adds each micro-batch's gradient of a host chunk into its host buffer
        self.prob += pr.optimizer_bytes * h_g == pr.grad_bytes_at(3) * h_o, "offload_grads_with_their_optimizer_states"
        self.prob += pr.optimizer_bytes * h_p == pr.param_bytes * h_o, "offload_weights_with_their_optimizer_states"
        self.prob += h_o + h_g <= self.prices.host_capacity(), "host_memory"
        self._offloading = self.offload is True  # the offload program runs, holding no gradient buckets
        if self.dp > 1:  # the offload program runs its chunks as ZeRO-3: only a stage-3 layout offloads
            if 3 in self.z:
                self.prob += h_o <= self.prices.host_capacity() * self.z[3], "offload_runs_zero3"
                if not self._offloading and self.prices.in_flight_grad_bytes(3):
                    # o = 1 where anything is on the host: the offload program runs, holding no gradient buckets in
                    # flight (`_add_overlap_grads`)
                    o = self._offload_runs = self.prob.add_variable("offload_program_runs", cat="Binary")
                    self.prob += h_o <= self.prices.host_capacity() * o, "offload_program_runs_if_offloading"
                    self.prob += o <= self.z[3], "offload_program_runs_zero3"
            else:
                h_o.upBound = 0
        host_rate = self.cluster.device.host_adamw_params_per_s
        c_o, c_g, c_p = offload_prices(self.precision, self.cluster.host_link, host_rate, self.mb)
        self.cost_terms["offload"] += [c_o * h_o] + ([c_g * h_g] if c_g else []) + ([c_p * h_p] if c_p else [])
        # the device no longer steps the states on the host (their per-tensor cost is kept: an upper bound)
        d_o = min(c_o, optimizer_step_time_s(self.estimator, self.cluster.device, 0, FP32_BYTES / pr.optimizer_bytes))
        if d_o:
            self.cost_terms["optimizer"].append(-d_o * h_o)
        self.memory_terms["optimizer"].append(-1.0 * h_o)
        self.memory_terms["grads"].append(-1.0 * h_g)
        self.memory_terms["params"].append(-1.0 * h_p)

    def _offload_result(self, mem: dict[str, float], offload_s: float) -> dict:
        """What the last solution keeps on the host (`offload_result`)."""
        if not self.h:
            return {}
        host = tuple(pulp.value(self.h[k]) or 0.0 for k in ("optimizer", "grads", "params"))
        return offload_result(
            host,
            mem,
            offload_s,
            host_capacity=self.prices.host_capacity(),
            devices_per_node=self.cluster.devices_per_node,
            budget=self.budget,
        )

    def memory_lower_bound(self, recompute: str | None = None) -> dict[str, float]:
        """Per-device bytes below which no layout of this program can go, without solving it.

        Every parameter at its leanest placement and ZeRO stage, every group at its leanest
        strategy, each chosen on its own, under the leanest allowed recompute mode (or `recompute`):
        a true lower bound of the program's memory term. The recomputed segment's values
        (M_recompute) count as working memory ("transient").
        """
        states = self.prices.states_lower_bound(self.zero_choices, self.z)
        modes = self.recompute_choices if recompute is None else [recompute]
        acts, extra = min((self.activations.lower_bound(m) for m in modes), key=sum)
        return {"states": states, "activations": acts, "transient": self.activations.transient_bytes() + extra}

    def leanest_recompute(self) -> str:
        """The allowed recompute mode with the smallest activation lower bound."""
        return min(self.recompute_choices, key=lambda m: sum(self.activations.lower_bound(m)))

    def add_memory_constraint(self, recompute: str | None = None) -> None:
        """sum n_w u M_state + sum n_g x M_saved(r) + M_recompute(r) + M_transient <= budget.

        The peak is at the turn from forward to backward. Under recompute mode r, M_saved(r) keeps only
        what enters each recomputed segment, and the first segment the backward recomputes holds its
        values again: M_recompute(r) >= sum_{(g,m) in S} x[g,k] M_value[m,k] for every segment S.
        """
        if self.transient is None:
            for (name, k, s), u in self.u.items():
                count = self.groups[name].count
                p, g, o = self.prices.state_bytes(name, k, s)
                self.memory_terms["params"].append(count * p * u)
                self.memory_terms["grads"].append(count * g * u)
                self.memory_terms["optimizer"].append(count * o * u)
            self._add_overlap_grads()
            self.transient = self.activations.transient_bytes()
            ahead = self.prices.prefetch_bytes(self.z)
            if ahead:
                self.memory_terms["prefetch"] = [
                    ahead * z for s, z in self.z.items() if s >= 1 and self.prices.comm(s).overlaps_data_axis
                ]
        self._use_mode(recompute or self.recompute_choices[0])

    def add_recompute_cost(self, recompute: str) -> list:
        """Objective terms of recompute mode r: the forward of every recomputed node and the resharding its
        arguments need, once more (`RecomputeTerms.forward_terms`): sum_{g, m in R} n_g sum_k x[g,k] F[m,k] +
        sum_{e into R} n_e y Rf, and the weights it gathers again (`RecomputeTerms.regathered`): sum_{w read in R}
        sum_{k, s} regather_s(w, k, s) u[w,k,s]."""
        terms = [
            self.prices.regather_s(w, k, st) * u
            for w in self.recompute_terms.regathered(recompute)
            for (name, k, st), u in self.u.items()
            if name == w and self.prices.regather_s(w, k, st)
        ]
        return terms + self.recompute_terms.forward_terms(recompute, self.x)

    # ------------------------------------------------------- activations of one chosen layout, per mode

    def fixed_activations(
        self, choice: dict[str, int], recompute: str, stage: int | None = None
    ) -> tuple[float, float, float]:
        """(saved activation bytes, recomputed-segment peak bytes, recompute seconds) of the layout `choice`
        (strategy per group) at ZeRO stage `stage` (None: the weights' gathers left out) under recompute mode r:
        the program's M_saved(r), M_recompute(r) and recompute objective terms evaluated at that layout, without
        solving."""
        acts, peak = self.activations.fixed(choice, recompute)
        if recompute == "none":
            return acts, peak, 0.0
        seconds = self.recompute_terms.fixed_forward_s(choice, recompute)
        if stage is not None:
            seconds += sum(
                self.prices.regather_s(w, choice[w], stage) for w in self.recompute_terms.regathered(recompute)
            )
        return acts, peak, seconds

    def fixed_layer_activations(self, choice: dict[str, int]) -> tuple[float, float]:
        """(bytes the repeated layers keep for backward, seconds of their forward), all layers together, for
        the layout `choice` with nothing recomputed: what offloading their activations moves and overlaps."""
        return self.activations.layer_saved_bytes(choice), self.recompute_terms.layer_forward_s(choice)

    def recompute_time_lower_bound(self, recompute: str) -> float:
        """Seconds recompute mode r adds at least (`RecomputeTerms.lower_bound`)."""
        return self.recompute_terms.lower_bound(recompute)

    def _mode_terms(self, recompute: str) -> _ModeTerms:
        if recompute in self._modes:
            return self._modes[recompute]
        acts = []
        for name, grp in self.groups.items():
            for k in range(len(grp.strategies)):
                b = self.activations.saved_bytes(name, k, recompute) * self.activation_copies
                if b:
                    acts.append(grp.count * b * self.x[name][k])
        rows, peak = {}, []
        segs = [
            pulp.lpSum(
                self.mesh_groups.member_bytes(self.groups[g], m, k) * self.x[g][k]
                for g, m in seg
                for k in range(len(self.groups[g].strategies))
            )
            for seg in self.activations.recomputed_saves(recompute)
        ]
        if len(segs) == 1:
            peak = [segs[0]]
        elif segs:  # the largest segment: one variable above each
            w = self.prob.add_variable(f"recompute_peak_{recompute}", 0)
            rows = {f"recompute_peak_{recompute}_{i}": w >= e for i, e in enumerate(segs)}
            peak = [w]
        states = [t for key in ("params", "grads", "optimizer", "prefetch") for t in self.memory_terms.get(key, ())]
        total = pulp.lpSum(states + acts + peak) + self.transient
        if math.isfinite(self.budget):
            rows["memory_peak"] = total <= self.budget
        base = [t for key, terms in self.cost_terms.items() if key != "recompute" for t in terms]
        extra = self.add_recompute_cost(recompute) if recompute != "none" else []
        if extra and 0 in self.z and self.prices.comm(0).runs_plain and self.prices.leaving_plain_s:
            extra.append(self.prices.leaving_plain_s * self.z[0])  # recompute runs on the sharded runtime
        if extra and self._exposed is not None:  # which does not overlap its gradient reductions with backward
            extra.append(pulp.lpSum(self.sync_report["total"]) - self._exposed)
        self._modes[recompute] = _ModeTerms(pulp.lpSum(base + extra), extra, acts, peak, rows)
        return self._modes[recompute]

    def _use_mode(self, recompute: str) -> None:
        """Make the objective and the memory rows those of recompute mode `recompute`."""
        if recompute == self._mode:
            return
        if self._mode is not None:
            for name in self._modes[self._mode].rows:
                self.prob.constraints.pop(name, None)
        terms = self._mode_terms(recompute)
        self.prob.setObjective(terms.objective)
        for name, row in terms.rows.items():
            self.prob.addConstraint(row, name)
        self.memory_terms["activations"] = terms.activations
        self.memory_terms["recompute"] = terms.peak
        self.cost_terms["recompute"] = terms.extra
        self._mode = recompute

    # ---------------------------------------------------------------------------------- solving

    def solve(
        self, time_limit_s: float = 60.0, *, stage: int | None = None, memory: bool = True, recompute: str | None = None
    ) -> MeshResult:
        """Solve the program, optionally with the ZeRO stage fixed and without the memory constraint.

        Fixing the stage turns the stage product into constants that presolve removes; HiGHS solves
        the four fixed programs faster than the joint one. Without the memory constraint the optimum
        is a lower bound of the step time for this mesh and any more micro-batches or higher stage.
        `recompute` picks the mode (default: the first allowed, "none" unless pinned).
        """
        mode = recompute or self.recompute_choices[0]
        self._use_mode(mode)
        for s, z in self.z.items():
            z.lowBound, z.upBound = (0, 1) if stage is None else ((1, 1) if s == stage else (0, 0))
        mem_con = None if memory else self.prob.constraints.pop("memory_peak", None)
        t0 = time.perf_counter()
        try:
            _quiet_solve(self.prob, time_limit_s)
        finally:
            if mem_con is not None:
                self.prob.constraints["memory_peak"] = mem_con
        dt = time.perf_counter() - t0
        status = pulp.LpStatus[self.prob.status]
        if status != "Optimal":
            return MeshResult(
                self.dp, self.tp, False, math.inf, 0, 0, 0, -1, {}, dt, f"solver status {status}", self.mb, mode
            )
        self.last_choice = self.chosen()
        return _read_result(self, mode, dt)

    def solve_free(self, recompute: str | None = None) -> MeshResult:
        """The memory-free optimum over the allowed ZeRO stages: the lowest stage, or the lowest from 1 when
        faster (its optimizer step is 1/dp; higher stages only add communication)."""
        low = self.zero_choices[0]
        if self.offload is True and self.dp > 1 and 3 in self.zero_choices:
            low = 3  # every state on the host: only the ZeRO-3 layout the offload program runs can hold that
        best, choice = self.solve(stage=low, memory=False, recompute=recompute), self.last_choice
        sharded = next((s for s in self.zero_choices if s >= 1), None)
        if self.dp > 1 and low == 0 and sharded is not None:
            res = self.solve(stage=sharded, memory=False, recompute=recompute)
            if res.feasible and (not best.feasible or res.step_time_s < best.step_time_s):
                best, choice = res, self.last_choice
        self.last_choice = choice
        return best

    def chosen(self) -> dict[str, int]:
        return {g: max(range(len(xs)), key=lambda k: pulp.value(xs[k]) or 0.0) for g, xs in self.x.items()}

    def solve_best(self, lower_bound_s: float = 0.0, *, recompute: str | None = None) -> MeshResult:
        """The optimum over the allowed recompute modes and ZeRO stages, each solved with both fixed.

        `lower_bound_s` is a step time nothing on this mesh can beat (the memory-free optimum at the
        lowest stage, no recompute). A mode adds at least `recompute_time_lower_bound` to it: a mode
        whose bound the best plan found already reaches is not solved, nor a (mode, stage) whose
        memory lower bound exceeds the budget; a stage that reaches its mode's bound ends that mode.
        """
        best, best_choice = None, None
        modes = self.recompute_choices if recompute is None else [recompute]
        for mode in modes:
            bound = lower_bound_s + (self.recompute_time_lower_bound(mode) if mode != "none" else 0.0)
            if best is not None and best.step_time_s <= bound * (1 + 1e-9):
                continue
            acts = sum(self.activations.lower_bound(mode)) + self.activations.transient_bytes()
            for s in self.zero_choices:
                if self.prices.states_lower_bound([s], self.z) + acts > self.budget:
                    continue
                res = self.solve(stage=s, recompute=mode)
                if res.feasible and (best is None or res.step_time_s < best.step_time_s):
                    best, best_choice = res, self.last_choice
                    if res.step_time_s <= bound * (1 + 1e-9):
                        break
        if best is None:
            return MeshResult(self.dp, self.tp, False, math.inf, 0, 0, 0, -1, {}, 0.0, "no stage fits", self.mb)
        self.last_choice = best_choice
        return best


@dataclass
class _ModeTerms:
    """What one recompute mode puts into a program: its objective, terms and rows."""

    objective: pulp.LpAffineExpression
    extra: list
    activations: list
    peak: list
    rows: dict[str, pulp.LpConstraint]


def _read_result(prog: ShardingProgram, mode: str, dt: float) -> MeshResult:
    """The optimum `prog` holds after a solve under recompute mode `mode` that took `dt` seconds: its step time by
    term, its memory by state, and the parts the plan reports apart (what overlap hides, the latencies)."""
    val = {k: sum(pulp.value(t) or 0.0 for t in v) for k, v in prog.cost_terms.items()}
    mem = {k: sum(pulp.value(t) or 0.0 for t in v) for k, v in prog.memory_terms.items()}
    mem["transient"] = prog.transient
    if not mem.get("recompute"):
        mem.pop("recompute", None)
    if not mem.get("prefetch"):
        mem.pop("prefetch", None)
    chosen_stage = next(s for s, z in prog.z.items() if (pulp.value(z) or 0) > 0.5)
    step = sum(val.values())
    hidden = 0.0
    if prog._exposed is not None and mode == "none":
        whole = sum(pulp.value(t) or 0.0 for t in prog.sync_report["total"])
        hidden = max(whole - (pulp.value(prog._exposed) or 0.0), 0.0)
    for terms, exposed in prog.sharded_hidden:  # the sharded program overlaps under every recompute mode
        hidden += max(sum(pulp.value(t) or 0.0 for t in terms) - (pulp.value(exposed) or 0.0), 0.0)
    # recomputed forwards are compute; resharding they repeat is counted with them
    return MeshResult(
        prog.dp,
        prog.tp,
        True,
        step,
        val.get("compute", 0.0) + val.get("recompute", 0.0),
        val.get("reshard", 0.0),
        val.get("grad_sync", 0.0),
        chosen_stage,
        mem,
        dt,
        num_microbatches=prog.mb,
        recompute=mode,
        offload=prog._offload_result(mem, val.get("offload", 0.0)),
        optimizer_s=val.get("optimizer", 0.0),
        recompute_s=val.get("recompute", 0.0),
        grad_sync_hidden_s=hidden,
        cp_comm_s=val.get("cp_comm", 0.0),
        cp_comm_hidden_s=sum(pulp.value(t) or 0.0 for t in prog._cp_hidden_terms),
        step_gather_s=sum(pulp.value(t) or 0.0 for t in prog._step_gather_terms),
        sync_fixed_s=sum(pulp.value(t) or 0.0 for t in prog._sync_fixed_terms),
        reshard_hidden_s=sum(pulp.value(t) or 0.0 for t in prog._tp_hidden_terms),
    )


def _quiet_solve(prob: pulp.LpProblem, time_limit_s: float) -> None:
    """Solve without the banner HiGHS writes straight to the process's stdout when it starts."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            prob.solve(_solver(time_limit_s))
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solver(time_limit_s: float):
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def solver_name() -> str:
    return "HiGHS" if pulp.HiGHS(msg=False).available() else "CBC"

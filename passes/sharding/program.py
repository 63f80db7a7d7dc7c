r"""Intra-op sharding as one integer program per 2-D device mesh (dp x tp).

The mesh has a data axis `dp` (outer) and a tensor axis `tp` (inner, so it stays inside a node while it fits).
Activations are split on their batch dimension over `dp`; on `tp` every op picks one strategy from `sharding_rules`.
Parameters pick a placement on `tp`, and one ZeRO stage for the whole model decides what is sharded over `dp`. One
activation recompute mode r for the whole model (`passes.recompute`: none, selective = attention internals, full =
whole layers) decides which activations are kept and which forwards run twice. `search.solve_sharding` solves every
factorisation dp * tp = world size and keeps the cheapest feasible one.

Sets:
    G          decision groups: a parameter, an input, or an op with the followers merged into it (views and unary
               ops whose placement follows from their producer's); identical layers share the groups of the first
               layer (`groups.MeshGroups`)
    K_g        strategies of group g;  n_g  how many nodes of the model group g stands for
    E          edges (producer group a, consumer group c, argument i), with multiplicity n_e
    W          parameter groups;  Z = {0, 1, 2, 3}  ZeRO stages, each run by one program (`ProgramComm`)
    r          the recompute mode (a parameter of the program, like m below);  R_r  the nodes it recomputes;
               S_r  its segments (a layer, or a layer's attention internals)

Variables:
    x[g,k] in {0,1}      group g runs strategy k
    y[e,k,l] in [0,1]    edge e joins producer strategy k with consumer strategy l
    z[s] in {0,1}        ZeRO stage s is used
    u[w,k,s] in [0,1]    parameter w has placement k under stage s (u = x[w,k] * z[s])
    h_o, h_g >= 0        bytes of optimizer states (fp32 master weights and moments) and of gradients this device
                         keeps on the host (ZeRO-Offload; a fraction of each, as DeepSpeed's Twin-Flow splits
                         them); both 0 when offload is forbidden
    h_p >= 0             bytes of 16-bit (or fp32) weights on the host: those of the chunks whose optimizer states
                         are there (the offload program keeps no device copy of them between uses)
    E, E_g, E_a >= 0     the communication the step waits for where a program overlaps it (rows below)

Objective (predicted step time, seconds):
    min  sum_g n_g sum_k x[g,k] (T_fwd[g,k] + T_bwd[g,k])               compute
         -> Implemented in: add_compute_cost()
       + sum_e n_e sum_{k,l} y[e,k,l] (Rf[e,k,l] + Rb[e,k,l] - H[e,k,l])  resharding, less what launching a
         -> Implemented in: add_edge_constraint()                          collective early hides
       + sum_w n_w sum_{k,s} u[w,k,s] Sync[w,k,s]                       data-axis sync, where nothing overlaps it
         -> Implemented in: add_stage_product_constraint()
       + E + E_g + E_a + latencies                                      where the program overlaps it
         -> Implemented in: add_overlap_constraint(), add_sharded_overlap_constraint()
       + C_o h_o + C_g h_g + C_p h_p                                    host offload
         -> Implemented in: add_offload_constraint()
       + D sum_{s: the sharded runtime runs stage s} z[s]               the sharded runtime's per-op cost
         -> Implemented in: add_sharded_runtime_cost()
       + sum_w n_w sum_{k,s} u[w,k,s] Opt[w,k,s] - D_o h_o              optimizer step
         -> Implemented in: add_stage_product_constraint(), add_offload_constraint()
       + sum_g n_g sum_{m in g, m in R_r} sum_k x[g,k] T_fwd[m,k]       recomputed forwards, their resharding and
       + sum_{e into R_r} n_e sum_{k,l} y[e,k,l] Rf[e,k,l]              the weights they gather again
         -> Implemented in: add_recompute_cost()

    T_*   roofline (or profiled) time of the op's share of work: work / (dp * divisor_k)  (`MeshGroups.op_times`)
    Rf    time to bring the producer's output placement to the placement argument i needs; Rb the gradient back
          to the producer's layout; H = eta min(Rf - Rf_fix, W) where the collective is launched early, W the
          forward of the ops before its consumer  (`reshard`, `MeshGroups.edge_prices`)
    Sync  one parameter's gradient sync and ZeRO gathers over dp, as the stage's program sends them
          (`sync.SyncPricing`); Opt its optimizer step, D the sharded runtime's per-op host time (`prices`)
    C_o, C_g, C_p   seconds per byte of optimizer state, gradient and weights on the host (`offload`); D_o the
          device step the host's states no longer run, capped at C_o (offloading stays a memory measure)

Constraints:
    one strategy:   sum_k x[g,k] = 1                                     for all g
        -> Implemented in: add_one_strategy_constraint()
    edge marginals: sum_l y[e,k,l] = x[a,k],  sum_k y[e,k,l] = x[c,l]    for all e
        -> Implemented in: add_edge_constraint()
    one stage:      sum_s z[s] = 1   (z[s] = 1 for a pinned stage)
        -> Implemented in: add_one_stage_constraint()
    product:        u[w,k,s] >= x[w,k] + z[s] - 1,  u <= x[w,k],  u <= z[s]
        -> Implemented in: add_stage_product_constraint()
    plain overlap (the data-parallel program's bucketed all-reduces, launched from the last micro-batch's backward,
    B the step's backward, eta the device's overlap efficiency, Sync_bw Sync less the buckets' latencies):
        E >= sum Sync_bw - eta B / m,   E >= (1 - eta) sum Sync_bw,   E >= T_last
        -> Implemented in: add_overlap_constraint()
    sharded overlap (gradient buckets from backward, r reductions a step; gathers `prefetch_depth` layers ahead, F
    the step's forward; G_fix, A_fix the collectives' latencies, never hidden):
        E_g >= sum G_bw - eta B r / m,  E_g >= (1 - eta) sum G_bw,  E_g >= r T_last,g
        E_a >= sum A_bw - eta F,        E_a >= (1 - eta) sum A_bw,  E_a >= T_first,a
        -> Implemented in: add_sharded_overlap_constraint()
    memory (peak, at the turn from forward to backward, where every saved activation is live):
        sum_w n_w sum_{k,s} u[w,k,s] M_state[w,k,s] + sum_s z[s] M_comm[s] - h_o - h_g - h_p
      + sum_g n_g sum_k x[g,k] M_saved[g,k,r] + M_recompute + M_transient  <=  budget
        -> Implemented in: add_memory_constraint()
    recomputed segment (r != none):
        M_recompute >= sum_{m in S, m kept at none, dropped at r} x[g(m),k] M_value[m,k]   for all S in S_r
        -> Implemented in: add_memory_constraint() (the mode's rows, `_mode_terms`)
    offload (unless forbidden; "=" instead of "<=" in the first two when everything is pinned to the host):
        h_o <= sum_w n_w sum_{k,s} u[w,k,s] M_opt[w,k,s],   h_g <= sum_w n_w sum_{k,s} u[w,k,s] M_grad[w,k,s]
        B_opt h_g = B_grad h_o,  B_opt h_p = B_param h_o   (a gradient and a weight live with their states)
        h_o + h_g <= host memory / devices per node
        h_o <= (host memory / devices per node) z[3] when dp > 1 (the offload program runs ZeRO-3 chunks)
        -> Implemented in: add_offload_constraint()
    tensor split (tp > 1; M the layer matmul weights with a dim divisible by tp, N_w their elements):
        sum_{w in M} n_w N_w sum_{k: split} x[w,k] >= f sum_{w in M} n_w N_w     f = tp_min_split, 1 by default
        -> Implemented in: add_tensor_split_constraint()
    pinned placement: x[w,k] = 1 for the placement k the user pins for parameter w
        -> Implemented in: add_pinned_placement_constraint()

    M_state, M_comm   state bytes of w's local shard under stage s, and what the stage's program holds besides:
              ZeRO-1's whole fp32 gradients, ZeRO-2/3's buckets in flight, weights gathered ahead (`memory.StateMemory`)
    M_saved, M_recompute, M_transient   activations kept for backward under r, the recomputed segment's values, the
              largest op's working memory (`memory.ActivationMemory`)

Micro-batches (gradient accumulation): with m micro-batches per data-parallel rank every op and every resharding
runs m times on 1/(dp*m) of the batch, activations and working memory shrink by m, gradients are reduced once
(stages 0, 1) or reduce-scattered per micro-batch (2, 3) and ZeRO-3 gathers parameters for each micro-batch's
forward and backward. m is a parameter of the program, not a variable: `search` solves each mesh at the fewest
micro-batches whose memory lower bound fits, and at more while that makes the step faster. The recompute mode is a
parameter too: its terms (the objective's recompute part, M_saved(r) and the M_recompute rows) are built the first
time a program is solved with r, and swapped in.

A tensor axis that splits no weight is data parallelism run on DTensors, which the dp mesh of the same size runs
better. So a tensor axis, pinned or searched, splits every layer matmul weight (attention, MLP, experts) unless
`tp_min_split` lowers the fraction, and a mesh with no such weight it can split is dropped; pinned and searched axes
follow one rule, so `compile`, which plans again with the plan's tp pinned, builds what was priced.

Offload only adds time (the host link and the CPU step are not overlapped with compute), so a program keeps states
on the host only where memory requires it; it enters the lower bounds as the states it can move (capped by host
memory), which lets fewer micro-batches and lower stages fit. Only meshes without a tensor axis (tp = 1) offload, as
the offload program runs them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

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
from autopar.passes.sharding.offload import offload_prices
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.prices import MeshPrices
from autopar.passes.sharding.solution import MeshResult
from autopar.passes.sharding.solver import solve, solve_best, solve_free
from autopar.program_comm import ProgramComm, resolved_prefetch_depth
from autopar.units import FP32_BYTES


@dataclass
class ProgramTerms:
    """The terms a built program collects, by what reads them."""

    cost: dict[str, list] = field(default_factory=lambda: defaultdict(list))  # objective terms by family
    memory: dict[str, list] = field(default_factory=lambda: defaultdict(list))  # memory-row terms by state
    backward: list = field(default_factory=list)  # n_g x[g,k] T_bwd: backward seconds per step
    forward: list = field(default_factory=list)  # n_g x[g,k] T_fwd: forward seconds per step
    # the latencies of the bucketed reductions (`bucket_latency_s`, `sync_floor`): in the step, never hidden
    sync_fixed: list = field(default_factory=list)
    step_gathers: list = field(default_factory=list)  # n_g u[g,k,1] A: a pipeline's ZeRO-1 gathers, once a step
    tp_hidden: list = field(default_factory=list)  # what tensor-axis collectives launched early hide, per edge
    cp_hidden: list = field(default_factory=list)  # cp attention's communication its compute hides
    # the sharded program's hideable communication and the exposed part the objective pays, per family
    sharded_hidden: list[tuple[list, pulp.LpVariable]] = field(default_factory=list)
    plain_sync: list = field(default_factory=list)  # the plain layout's whole sync, what overlap hides from
    exposed: pulp.LpVariable | None = None  # E of `add_overlap_constraint`


class ShardingProgram:
    """The integer program of one (dp, tp) mesh at m micro-batches; see the module docstring for the math.

    Its own are the variables, the constraint families and the objective of each recompute mode; what they price it
    composes: `mesh_groups` (groups, edges, compute), `prices` (coefficients by group, strategy and ZeRO stage, each
    stage's `ProgramComm`), `activations` and `recompute_terms` (memory and time under each recompute mode).
    """

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
        if batch_dim_size % (dp * num_microbatches):
            raise ConfigError(
                f"the global batch of {batch_dim_size} does not split into dp={dp} x {num_microbatches} micro-batches"
            )
        self.graph, self.cluster, self.dp, self.tp, self.mb = graph, cluster, dp, tp, num_microbatches
        self.estimator, self.precision, self.budget, self.batch = (
            estimator,
            precision,
            memory_budget_bytes,
            batch_dim_size,
        )
        self.cp = cp  # a cp plan: dp counts the data axis's dp·cp ranks, and attention is priced by `cp`
        # priced as a pipeline's stage (`runtime.pipeline`), whose ZeRO-1 with overlap gathers weights once a step
        self.pipeline_stage, self.step_gathers = pipeline_stage, pipeline_stage and step_gathers
        # the device's overlap efficiency: where it is 0 nothing hides, and a program is priced as its synchronous one
        self.eta = cluster.device.overlap_efficiency
        self.overlap = overlap and self.eta > 0  # the data axis's collectives overlap compute (`comm`)
        self.prefetch_depth = resolved_prefetch_depth(prefetch_depth, self.overlap)
        # the interpreter launches a tensor-axis collective early where its value's consumer is not the next op
        # (`parallelize.launches_early`, with the plan's overlap; a pipeline stage's program says so apart, as its
        # `overlap` speaks of the data axis): the forward collective runs behind the ops in between
        self.tp_overlap = (overlap if tp_overlap is None else tp_overlap) and self.eta > 0 and tp > 1
        self.tensor_split = tensor_split
        self.pinned_placements = dict(pinned_placements or {})  # parameter name -> placement string on tp
        # False: states stay on the device; None: the program places them; True: all optimizer states and gradients
        # on the host
        self.offload = offload
        self._offloading = False  # offload pinned: the ZeRO-3 layouts run as the offload program
        self._offload_runs: pulp.LpVariable | None = None  # offload allowed: whether the offload program runs
        # micro-batches whose saved activations are alive at once (1 here; a pipeline schedule keeps more)
        self.activation_copies = activation_copies
        self.zero_choices = [zero_stage] if zero_stage is not None else [0, 1, 2, 3]
        if dp == 1 and zero_stage is None:
            # one rank shards nothing, so stages 2 and 3 are stage 1; stage 1 still differs from 0 where the
            # precision holds its gradients leaner (mixed precision: the compute format, not fp32), as the pipeline
            # search's stages and a pinned stage price it
            self.zero_choices = [0, 1] if precision.grad_bytes_at(1) < precision.grad_bytes_at(0) else [0]
        # recompute modes to consider, the cheapest first; a pinned mode is the only one
        self.recompute_choices = recompute_choices(graph, recompute)
        self.tp_link = cluster.link_for_axis(tp, 1)
        self.prob = pulp.LpProblem(f"sharding_dp{dp}_tp{tp}_mb{num_microbatches}", pulp.LpMinimize)
        self.x: dict[str, list[pulp.LpVariable]] = {}
        self.z: dict[int, pulp.LpVariable] = {}
        self.u: dict[tuple[str, int, int], pulp.LpVariable] = {}
        self.h: dict[str, pulp.LpVariable] = {}
        self.terms = ProgramTerms()
        self.last_choice: dict[str, int] = {}  # strategy index per group of the last solution
        # the parts that depend on the recompute mode, built when a mode is first solved
        self._modes: dict[str, _ModeTerms] = {}
        self._mode: str | None = None
        self.transient: float | None = None
        self._compose(activation_copies)

    def _compose(self, activation_copies: float) -> None:
        """Make the parts the program prices with: its groups, its prices, its activations and recompute terms."""
        cp = self.cp.degree if self.cp is not None else 1
        self.mesh_groups = MeshGroups(
            self.graph,
            tp=self.tp,
            tp_link=self.tp_link,
            data_ranks=self.dp,
            batch=self.batch,
            num_microbatches=self.mb,
            estimator=self.estimator,
            cp=self.cp,
        )
        self.groups, self.group_of = self.mesh_groups.groups, self.mesh_groups.group_of
        self.activations = ActivationMemory(self.mesh_groups, activation_copies)
        self.recompute_terms = RecomputeTerms(self.mesh_groups)
        self.prices = MeshPrices(
            self.mesh_groups,
            self.cluster,
            dp=self.dp,
            tp=self.tp,
            estimator=self.estimator,
            precision=self.precision,
            budget=self.budget,
            overlap=self.overlap,
            prefetch_depth=self.prefetch_depth,
            offload=self.offload,
            pipeline_stage=self.pipeline_stage,
            step_gathers=self.step_gathers,
            cp=cp,
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
                self.terms.cost["compute"].append(grp.count * (t - comm) * self.x[name][k])
                if comm:
                    self.terms.cost["cp_comm"].append(grp.count * comm * self.x[name][k])
                if hid:
                    self.terms.cp_hidden.append(grp.count * hid * self.x[name][k])
                if back:
                    self.terms.backward.append(grp.count * back * self.x[name][k])
                if t - back:
                    self.terms.forward.append(grp.count * (t - back) * self.x[name][k])
                if grp.extra_s[k]:
                    self.terms.cost["reshard"].append(grp.extra_s[k] * self.x[name][k])

    def add_edge_constraint(self) -> None:
        """y marginals sum_l y[e,k,m] = x[a,k], sum_k y[e,k,m] = x[c,m]; objective n_e * (Rf + Rb - H) * y, H the
        part of Rf a collective launched early hides behind the ops before its consumer (`MeshGroups.early_window`):
        H = eta min(Rf - Rf_fix, W), the collective's latency (Rf_fix) never hidden."""
        for idx, (edge, mult) in enumerate(self.mesh_groups.edges().items()):
            gp, _, gc, c, _ = edge
            gpr, gcr = self.groups[gp], self.groups[gc]
            cost, fwd_cost, hidden = self.mesh_groups.edge_prices(edge, mult, self.eta if self.tp_overlap else 0.0)
            if not any(v for row in cost + hidden for v in row):
                continue
            if gp == gc:  # both ends in one group: the strategy index is shared
                self.terms.cost["reshard"] += [cost[k][k] * self.x[gp][k] for k in range(len(cost)) if cost[k][k]]
                self.terms.tp_hidden += [hidden[k][k] * self.x[gp][k] for k in range(len(cost)) if hidden[k][k]]
                self.recompute_terms.edge_forward += [
                    (c, fwd_cost[k][k], self.x[gp][k], ((gp, k),)) for k in range(len(cost)) if fwd_cost[k][k]
                ]
                continue
            if len(gpr.strategies) == 1 or len(gcr.strategies) == 1:
                for k, row in enumerate(cost):
                    for m, v in enumerate(row):
                        var = self.x[gc][m] if len(gpr.strategies) == 1 else self.x[gp][k]
                        if v:
                            self.terms.cost["reshard"].append(v * var)
                        if hidden[k][m]:
                            self.terms.tp_hidden.append(hidden[k][m] * var)
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
            self.terms.cost["reshard"] += [
                cost[k][m] * y[k][m] for k in range(len(cost)) for m in range(len(cost[0])) if cost[k][m]
            ]
            self.terms.tp_hidden += [
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
            self.terms.cost["compute"].append(total * pulp.lpSum(stages))

    def _add_overlap_grads(self) -> None:
        """Memory rows gain what the overlapping sharded program holds beyond `state_bytes`: `overlap_grad_bytes`
        of the layout (ZeRO-1) and `in_flight_grad_bytes` of the stage (ZeRO-2/3), unless the offload program runs
        the layout (offload pinned, or o of `add_offload_constraint` where the solver may offload: it runs at ZeRO-3,
        and its gradient staging buffers, a chunk each, stand in for the buckets; the runtime sizes its chunks so
        that the ones in flight take a small share of the budget, and they are not counted here)."""
        for (name, k, s), u in self.u.items():
            extra = self.groups[name].count * self.prices.overlap_grad_bytes(name, k, s)
            if extra and not (self._offloading and s == 3):
                self.terms.memory["grads"].append(extra * u)
        for s, z in self.z.items():
            buffers = self.prices.in_flight_grad_bytes(s)
            if buffers and not (self._offloading and s == 3):
                self.terms.memory["grads"].append(buffers * z)
                if s == 3 and self._offload_runs is not None:  # z[3] - o: the sharded program runs the layout
                    self.terms.memory["grads"].append(-buffers * self._offload_runs)

    def add_stage_product_constraint(self) -> None:
        """u[w,k,s] >= x[w,k] + z[s] - 1, u <= x[w,k], u <= z[s]; objective n_w * Sync * u (the plain layout's
        part through `add_overlap_constraint`)."""
        plain = []  # the sync terms of the plain layout, when its all-reduces overlap backward
        # the sharded program's hideable parts (`SyncPricing.sharded_parts`); gradients by how often a step reduces
        # them (one list where m = 1)
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
                        self.terms.cost["grad_sync"].append(grp.count * (g_fix + a_fix) * u)
                    elif t:
                        fixed = self.prices.bucket_latency_s(name, k, s)  # a bucketed reduction's latency never hides
                        if self.prices.comm(s).overlaps_all_reduce:
                            plain.append(grp.count * (t - fixed) * u)
                            self.terms.cost["grad_sync"].append(grp.count * fixed * u)
                        else:
                            self.terms.cost["grad_sync"].append(grp.count * t * u)
                        if fixed:
                            self.terms.sync_fixed.append(grp.count * fixed * u)
                        gather = self.prices.step_gather_time(name, k, s)
                        if gather:
                            self.terms.step_gathers.append(grp.count * gather * u)
                    t = self.prices.optimizer_time(name, k, s)
                    if t:
                        self.terms.cost["optimizer"].append(grp.count * t * u)
        for s, zs in self.z.items():
            if self.prices.sync_floor(s):
                self.terms.cost["grad_sync"].append(self.prices.sync_floor(s) * zs)
                self.terms.sync_fixed.append(self.prices.sync_floor(s) * zs)
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
        hides them), once per micro-batch at stages 2 and 3, each micro-batch's backward hiding its own buckets
        (r B / m = B); one E_g per r, over the stages that reduce r times (the other's terms are 0 where its stages
        are not chosen). Exposed = what the communication needs beyond the compute it hides behind (the backward of
        the layers after each bucket; F: the forward of the layers before each gather, every micro-batch's), never
        less than the collectives nothing hides: the last bucket of each reducing backward, issued when it ends
        (T_last,g, `SyncPricing.last_bucket_bw_s`; the offload program's chunks in `ChunkPricing`), and each
        micro-batch's first gather, which no layer precedes (T_first,a, `SyncPricing.first_gather_bw_s`; stage 3's
        backward gathers are in G_bw: they share the backward's link with the buckets). The fixed latency of every
        collective (G_fix, A_fix of `SyncPricing.sharded_parts`) and one bucket's latency per reducing backward are
        in the objective as they are: they never hide.
        """
        sharded = [s for s in self.z if self.prices.comm(s).overlaps_data_axis]
        for r, terms in sorted(grads.items()):
            stages = [s for s in sharded if self.prices.comm(s).reductions_per_step == r]
            if not stages:
                continue
            suffix = "" if r == 1 else "_per_microbatch"
            e_g = self.prob.add_variable(f"exposed_sharded_grads{suffix}", 0)
            hides = self.hiding(self.terms.backward) * (r / self.mb)
            self.prob += e_g >= pulp.lpSum(terms) - hides, f"sharded_exposed_grads{suffix}"
            last = pulp.lpSum(r * self.prices.last_bucket_bw_s(s) * self.z[s] for s in stages)
            self.prob += e_g >= last, f"sharded_last_bucket{suffix}"
            if self.eta < 1:  # at most the share eta of the communication hides, however long the compute
                self.prob += e_g >= pulp.lpSum(terms) * (1.0 - self.eta), f"sharded_grads_efficiency{suffix}"
            self.terms.cost["grad_sync"].append(e_g)
            self.terms.sharded_hidden.append((terms, e_g))
        for s in sharded:
            if self.prices.comm(s).runs_chunks:  # one latency per chunk, in G_fix already
                continue
            self.terms.cost["grad_sync"].append(self.prices.sync.reduction_latency(self.prices.comm(s)) * self.z[s])
        if gathers:
            e_a = self.prob.add_variable("exposed_sharded_gathers", 0)
            self.prob += e_a >= pulp.lpSum(gathers) - self.hiding(self.terms.forward), "sharded_exposed_gathers"
            first = pulp.lpSum(self.prices.first_gather_bw_s(s) * self.z[s] for s in sharded if s >= 1)
            self.prob += e_a >= first, "sharded_first_gather"
            if self.eta < 1:
                self.prob += e_a >= pulp.lpSum(gathers) * (1.0 - self.eta), "sharded_gathers_efficiency"
            self.terms.cost["grad_sync"].append(e_a)
            self.terms.sharded_hidden.append((gathers, e_a))

    def add_overlap_constraint(self, plain: list) -> None:
        """E >= sum(plain) - eta B / m, E >= (1 - eta) sum(plain), E >= T_last z[s], E >= 0; objective E instead
        of sum(plain).

        The data-parallel program's all-reduces (sum(plain): every bucket's bandwidth time) run while the last
        micro-batch's backward (B / m, B the step's backward) goes on. Of that, the share eta
        (`DeviceSpec.overlap_efficiency`) hides: hidden = eta min(sum(plain), B / m), and the first two rows are
        exposed = sum(plain) - hidden. The last bucket (the first parameters, whose gradients come last) is
        launched when backward ends and is exposed whole (T_last: the bandwidth part of one all-reduce of
        min(bucket, all gradient bytes)). The buckets' latencies (`bucket_latency_s`, `sync_floor`) are in the
        objective as they are: they never hide. eta is 1 on GPUs and measured for gloo on CPU, where communication
        competes with compute for the cores. With equal buckets the serial link's per-bucket price, max_k (sum_{j >=
        k} T_j - eta H_k) (H_k the backward left when bucket k goes out), is these rows; it is approximated in one
        respect: the backward before the first bucket fills counts as hiding (less than one bucket's share of B,
        small but for models of a few buckets). With overlap off (constraints={"overlap": False}) E is not used and
        the sync is paid whole."""
        s = next(s for s in self.z if self.prices.comm(s).runs_plain)
        e = self.prob.add_variable("exposed_sync", 0)
        backward = pulp.lpSum(self.terms.backward) * (self.eta / self.mb)
        self.prob += e >= pulp.lpSum(plain) - backward, "overlap_exposed_sync"
        if self.eta < 1:
            self.prob += e >= pulp.lpSum(plain) * (1.0 - self.eta), "overlap_efficiency"
        self.prob += e >= self.prices.last_bucket_s() * self.z[s], "overlap_last_bucket"
        self.terms.cost["grad_sync"].append(e)
        self.terms.plain_sync = plain
        self.terms.exposed = e

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
        self.terms.cost["offload"] += [c_o * h_o] + ([c_g * h_g] if c_g else []) + ([c_p * h_p] if c_p else [])
        # the device no longer steps the states on the host (their per-tensor cost is kept: an upper bound)
        d_o = min(c_o, optimizer_step_time_s(self.estimator, self.cluster.device, 0, FP32_BYTES / pr.optimizer_bytes))
        if d_o:
            self.terms.cost["optimizer"].append(-d_o * h_o)
        self.terms.memory["optimizer"].append(-1.0 * h_o)
        self.terms.memory["grads"].append(-1.0 * h_g)
        self.terms.memory["params"].append(-1.0 * h_p)

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
        """sum n_w u M_state + sum_s z[s] M_comm[s] + sum n_g x M_saved(r) + M_recompute(r) + M_transient <= budget.

        The peak is at the turn from forward to backward. Under recompute mode r, M_saved(r) keeps only
        what enters each recomputed segment, and the first segment the backward recomputes holds its
        values again: M_recompute(r) >= sum_{(g,m) in S} x[g,k] M_value[m,k] for every segment S.
        """
        if self.transient is None:
            for (name, k, s), u in self.u.items():
                count = self.groups[name].count
                p, g, o = self.prices.state_bytes(name, k, s)
                self.terms.memory["params"].append(count * p * u)
                self.terms.memory["grads"].append(count * g * u)
                self.terms.memory["optimizer"].append(count * o * u)
            self._add_overlap_grads()
            self.transient = self.activations.transient_bytes()
            ahead = self.prices.prefetch_bytes(self.z)
            if ahead:
                self.terms.memory["prefetch"] = [
                    ahead * z for s, z in self.z.items() if s >= 1 and self.prices.comm(s).overlaps_data_axis
                ]
        self.use_mode(recompute or self.recompute_choices[0])

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
        states = [t for key in ("params", "grads", "optimizer", "prefetch") for t in self.terms.memory.get(key, ())]
        total = pulp.lpSum(states + acts + peak) + self.transient
        if math.isfinite(self.budget):
            rows["memory_peak"] = total <= self.budget
        base = [t for key, terms in self.terms.cost.items() if key != "recompute" for t in terms]
        extra = self.add_recompute_cost(recompute) if recompute != "none" else []
        if extra and 0 in self.z and self.prices.comm(0).runs_plain and self.prices.leaving_plain_s:
            extra.append(self.prices.leaving_plain_s * self.z[0])  # recompute runs on the sharded runtime
        if extra and self.terms.exposed is not None:  # which does not overlap its gradient reductions with backward
            extra.append(pulp.lpSum(self.terms.plain_sync) - self.terms.exposed)
        self._modes[recompute] = _ModeTerms(pulp.lpSum(base + extra), extra, acts, peak, rows)
        return self._modes[recompute]

    def use_mode(self, recompute: str) -> None:
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
        self.terms.memory["activations"] = terms.activations
        self.terms.memory["recompute"] = terms.peak
        self.terms.cost["recompute"] = terms.extra
        self._mode = recompute

    # ---------------------------------------------------------------------------------- solving

    def solve(
        self, time_limit_s: float = 60.0, *, stage: int | None = None, memory: bool = True, recompute: str | None = None
    ) -> MeshResult:
        """Solve the program, optionally with the ZeRO stage fixed and without the memory row (`solver.solve`)."""
        return solve(self, time_limit_s, stage=stage, memory=memory, recompute=recompute)

    def solve_free(self, recompute: str | None = None) -> MeshResult:
        """The memory-free optimum over the allowed ZeRO stages (`solver.solve_free`)."""
        return solve_free(self, recompute)

    def chosen(self) -> dict[str, int]:
        return {g: max(range(len(xs)), key=lambda k: pulp.value(xs[k]) or 0.0) for g, xs in self.x.items()}

    def solve_best(self, lower_bound_s: float = 0.0, *, recompute: str | None = None) -> MeshResult:
        """The optimum over the allowed recompute modes and ZeRO stages (`solver.solve_best`)."""
        return solve_best(self, lower_bound_s, recompute=recompute)


@dataclass
class _ModeTerms:
    """What one recompute mode puts into a program: its objective, terms and rows."""

    objective: pulp.LpAffineExpression
    extra: list
    activations: list
    peak: list
    rows: dict[str, pulp.LpConstraint]

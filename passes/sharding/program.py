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

A tensor axis that splits no weight is data parallelism run by the sharded program, which the dp mesh of the same
size runs better. So a tensor axis, pinned or searched, splits every layer matmul weight (attention, MLP, experts) unless
`tp_min_split` lowers the fraction, and a mesh with no such weight it can split is dropped; pinned and searched axes
follow one rule, so `compile`, which plans again with the plan's tp pinned, builds what was priced.

Offload only adds time (the host link and the CPU step are not overlapped with compute), so a program keeps states
on the host only where memory requires it; it enters the lower bounds as the states it can move (capped by host
memory), which lets fewer micro-batches and lower stages fit. Only meshes without a tensor axis (tp = 1) offload, as
the offload program runs them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pulp
from torch.distributed.tensor import Shard

from autopar.cluster import ClusterSpec
from autopar.cost_model.experts import ExpertSplit
from autopar.errors import ConfigError
from autopar.ir import OpGraph
from autopar.passes.context_parallel import CPPricing
from autopar.passes.sharding import cost_rows, memory_rows, overlap_rows
from autopar.passes.sharding.graph import (
    ANY_SPLIT,
    TensorSplit,
    recompute_choices,
)
from autopar.passes.sharding.groups import MeshGroups
from autopar.passes.sharding.memory import ActivationMemory, RecomputeTerms
from autopar.passes.sharding.memory_rows import ModeTerms
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.prices import MeshPrices
from autopar.passes.sharding.solution import MeshResult
from autopar.passes.sharding.solver import solve, solve_best, solve_free
from autopar.program_comm import ProgramComm, resolved_prefetch_depth


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
        experts: ExpertSplit | None = None,
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
        self.experts = experts  # expert weights split over an ep group of the data axis (`MeshPrices`)
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
        self._modes: dict[str, ModeTerms] = {}
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
            experts=self.experts,
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
        """`cost_rows.add_compute_cost`."""
        cost_rows.add_compute_cost(self)

    def add_edge_constraint(self) -> None:
        """`cost_rows.add_edge_constraint`."""
        cost_rows.add_edge_constraint(self)

    def add_sharded_runtime_cost(self) -> None:
        """D (sum_s z[s], or sum_{s >= 1} z[s] on a mesh without a tensor axis): the host time the sharded
        runtime adds to every op by running it in its lowered graph (`passes.lower`: the graph's call path and
        parameter hooks, beyond the op's own dispatch), where the estimator knows it (`sharded_op_overhead_s`:
        measured on CPU ranks, whose steps are dominated by such costs; no figure for a GPU yet). A plan
        with no tensor axis and no ZeRO sharding runs as plain tensors (the data-parallel program)."""
        total = self.prices.sharded_overhead_s
        stages = [z for s, z in self.z.items() if not self.prices.comm(s).runs_plain]
        if total and stages:
            self.terms.cost["compute"].append(total * pulp.lpSum(stages))

    def _add_overlap_grads(self) -> None:
        """`overlap_rows.add_overlap_grads`."""
        overlap_rows.add_overlap_grads(self)

    def add_stage_product_constraint(self) -> None:
        """`cost_rows.add_stage_product_constraint`."""
        cost_rows.add_stage_product_constraint(self)

    def hiding(self, compute: list):
        """The compute time communication can hide behind: the compute terms' sum (one helper, so that a device's
        overlap efficiency can scale every hidden part in one place)."""
        return pulp.lpSum(compute) * getattr(self.cluster.device, "overlap_efficiency", 1.0)

    def add_sharded_overlap_constraint(self, grads: dict[int, list], gathers: list) -> None:
        """`overlap_rows.add_sharded_overlap_constraint`."""
        overlap_rows.add_sharded_overlap_constraint(self, grads, gathers)

    def add_overlap_constraint(self, plain: list) -> None:
        """`overlap_rows.add_overlap_constraint`."""
        overlap_rows.add_overlap_constraint(self, plain)

    def add_offload_constraint(self) -> None:
        """`cost_rows.add_offload_constraint`."""
        cost_rows.add_offload_constraint(self)

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
        """`memory_rows.add_memory_constraint`."""
        memory_rows.add_memory_constraint(self, recompute)

    def add_recompute_cost(self, recompute: str) -> list:
        """`memory_rows.add_recompute_cost`."""
        return memory_rows.add_recompute_cost(self, recompute)

    # ------------------------------------------------------- activations of one chosen layout, per mode

    def fixed_activations(
        self, choice: dict[str, int], recompute: str, stage: int | None = None
    ) -> tuple[float, float, float]:
        """`memory_rows.fixed_activations`."""
        return memory_rows.fixed_activations(self, choice, recompute, stage)

    def fixed_layer_activations(self, choice: dict[str, int]) -> tuple[float, float]:
        """(bytes the repeated layers keep for backward, seconds of their forward), all layers together, for
        the layout `choice` with nothing recomputed: what offloading their activations moves and overlaps."""
        return self.activations.layer_saved_bytes(choice), self.recompute_terms.layer_forward_s(choice)

    def recompute_time_lower_bound(self, recompute: str) -> float:
        """Seconds recompute mode r adds at least (`RecomputeTerms.lower_bound`)."""
        return self.recompute_terms.lower_bound(recompute)

    def _mode_terms(self, recompute: str) -> ModeTerms:
        """`memory_rows.mode_terms`."""
        return memory_rows.mode_terms(self, recompute)

    def use_mode(self, recompute: str) -> None:
        """`memory_rows.use_mode`."""
        memory_rows.use_mode(self, recompute)

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

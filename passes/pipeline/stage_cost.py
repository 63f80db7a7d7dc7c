r"""The price of one pipeline stage: its program, solved on its sub-mesh for some layers and micro-batches.

Expects the graph, its `LayerStructure` and the cluster; a stage is a view of the graph (`layers.stage_view`, or
`layers.range_view` over several stacks). Gives the figures of a stage that the step price composes (`step_cost`):
the time of one micro-batch, the gradient sync of a step, the memory at a number of activation copies. Each stage
program is built and solved once per key and kept (`StagePricer`; `autopar.plan` hands the same pricer to later
searches of the same graph). A stage is priced alone: the other stages reach it only through a_s and the step.

Terms:
    dp, tp  the stage's sub-mesh;  m  micro-batches per step;  b  samples of a micro-batch per data-parallel rank
    k_s  layers of stage s;  first, last  whether it runs the nodes before the layers / after them
    a_s  micro-batches whose activations the stage keeps alive at once (`schedules.activation_copies`)

The intra-op program (`ShardingProgram`, `pipeline_stage=True`) prices a stage on its sub-mesh at m micro-batches
(-> Implemented in: StagePricer.program(), PricedStage):
    t_s     compute, resharding and exposed cp attention communication of one micro-batch (forward and backward),
            on one device
    S_s     once per step: gradient synchronisation over the stage's dp axis (and ZeRO gathers) and the optimizer
            step, S_s = G_s + A_s + F_s + O_s (`step_cost`); G_s, the part overlap may hide, is
            `PricedStage.grad_sync()`
    L_s     the bandwidth part of the reduction of the bucket the stage's last backward fills last
    memory  states + a_s x activations of one micro-batch + working memory <= budget

Two prices per key (-> Implemented in: StagePricer.free(), StagePricer.price()): the memory-free optimum at the
lowest allowed ZeRO stage (the fastest the stage can be) and, where that does not fit at a_s copies, the optimum
within the budget (`bound`), or none where the program's memory lower bound alone exceeds the budget.

ZeRO. Pipelines use ZeRO stages 0 and 1 (`plan.PIPELINE_ZERO_STAGES`), or the pinned one of them: at 2 or 3 a
stage would gather every split weight and reduce-scatter its gradient once per micro-batch. With overlap (the
plan's default) a ZeRO-1 stage gathers its weights and reduce-scatters their gradients once a step
(`runtime.pipeline`).

Floors for the estimate (-> Implemented in: StagePricer.floors(), StageFloors): one-layer stage views give, per
(tp, b), the memory-free time of one micro-batch on tp devices alone (compute and resharding do not depend on dp at
a fixed b) and each recompute mode's leanest activations and working memory, and per (dp, tp) the leanest states
and least gradient sync of each ZeRO stage.

A cp axis (constraints "cp" > 1, the graph traced for cp: each sequence is cp rows of seq/cp tokens). A stage's
sub-mesh is then dp·cp x tp, its data axis the dp·cp ranks: per-token compute and activations of a stage are those
of its rows; each attention node is priced across the cp group by `passes.context_parallel` with the pinned
algorithm, else `StagePricer.cp_algorithm` where a search forces one, else the fastest that applies on that
sub-mesh (-> Implemented in: StagePricer.cp_pricing()).

Several stacks (-> Implemented in: StackPricer): a stage is keyed by its layer range (a, b) instead of a count,
and the bytes crossing each boundary are read from the graph (`layers.crossing_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.context_parallel import CPAlgorithm
from autopar.ir import NodeKind, OpGraph
from autopar.passes.context_parallel import CPPricing, CPSpec, check_cp_graph, price_cp_attention
from autopar.passes.pipeline.layers import LayerStructure, crossing_bytes, range_view, stage_view
from autopar.passes.pipeline_split import stack_layers
from autopar.passes.sharding.graph import TensorSplit
from autopar.passes.sharding.groups import MeshGroups
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.program import ShardingProgram
from autopar.passes.sharding.solution import MeshResult
from autopar.plan import PIPELINE_ZERO_STAGES

FLOOR_MARGIN = 1e-6  # see StagePricer.compute_floor


@dataclass(frozen=True, slots=True)
class PricedStage:
    """A stage program's optimum at one (layers, first, last, sub-mesh, micro-batches, activation copies)."""

    feasible: bool
    t_mb: float = math.inf  # compute, resharding and exposed cp attention communication of one micro-batch
    sync: float = 0.0  # once per step: gradient synchronisation and the optimizer step
    zero: int = -1
    memory: tuple[tuple[str, float], ...] = ()  # as solved, activations at `copies`
    copies: float = 1.0
    result: MeshResult | None = None
    program: ShardingProgram | None = None
    bound: bool = False  # solved within the memory budget: the memory-free optimum did not fit
    last_bucket_s: float = 0.0  # L_s: the bandwidth part of the reduction of the bucket its last backward fills last

    def grad_sync(self) -> float:
        """G_s: the gradient synchronisation the later backwards may hide (sync less the optimizer step, less
        a ZeRO-1 stage's gathers before the schedule, and less the buckets' latencies: nothing hides those)."""
        if self.result is None:
            return self.sync
        return self.sync - self.result.optimizer_s - self.result.step_gather_s - self.result.sync_fixed_s

    def memory_at(self, copies: float) -> dict[str, float]:
        mem = dict(self.memory)
        if "activations" in mem:
            mem["activations"] *= copies / self.copies
        return mem


@dataclass(frozen=True, slots=True)
class StageFloors:
    """Bounds of a one-layer stage view that the estimates scale by the layer count.

    Per (kind, tp, b): for each allowed recompute mode, activations of one micro-batch at their leanest and
    working memory (a mode that saves less keeps more working memory: its recomputed segment, which the layer
    count does not scale, so no one mode is the leanest at every size and copy count); the time of one
    micro-batch on tp devices without a data axis; per (kind, dp, tp): for each ZeRO stage the leanest states
    and the least gradient sync (at one micro-batch).
    """

    acts: dict[str, float]
    transient: dict[str, float]
    recompute_s: dict[str, float]
    t_mb: float
    states: dict[int, float]
    sync: dict[int, float]


class StagePricer:
    """Builds and solves stage programs, each (view, sub-mesh, micro-batches, copies) once."""

    def __init__(
        self,
        graph: OpGraph,
        structure: LayerStructure,
        cluster: ClusterSpec,
        *,
        estimator,
        precision: Precision,
        zero: int | None,
        budget: float,
        batch: int,
        recompute: str | None = None,
        constraints: dict | None = None,
    ):
        self.graph, self.structure, self.cluster = graph, structure, cluster
        # a cp axis (pinned): the data axis of a sub-mesh is dp·cp ranks and attention is priced across the group
        self.cp = CPSpec.from_constraints(dict(constraints or {}), cluster.world_size)
        self._attention = check_cp_graph(graph.graph, self.cp) if self.cp.on else []
        self._cp_pricing: dict[tuple, CPPricing] = {}
        # an algorithm every stage runs instead of each sub-mesh's fastest (`_cp_fallback`, where memory binds);
        # the solved stages below are keyed by the algorithm they run (`cp_run`)
        self.cp_algorithm: CPAlgorithm | None = None
        self.constraints = dict(constraints or {})  # the pins the tensor-split rule reads (tp, tp_min_split)
        self.recompute = recompute  # a pinned activation recompute mode, or None to choose per stage
        self.estimator, self.precision, self.budget, self.batch = estimator, precision, budget, batch
        # ZeRO-2/3 reduce-scatter gradients and gather parameters once per micro-batch, which a pipeline
        # repeats m times; as in Megatron-LM and DeepSpeed, pipelines shard optimizer states at most (ZeRO-1)
        self.zero_choices = [zero] if zero is not None else list(PIPELINE_ZERO_STAGES)
        # with overlap (the plan's default) a ZeRO-1 stage gathers its weights and reduce-scatters their gradients
        # once a step (`runtime.pipeline`); without, wherever a micro-batch reads them
        # (and the interpreter launches tensor-axis collectives early, `ShardingProgram.tp_overlap`)
        self.overlap_on = bool(self.constraints.get("overlap", True))
        self._views: dict[tuple, OpGraph] = {}
        self._free: dict[tuple, PricedStage] = {}
        self._bound: dict[tuple, PricedStage] = {}
        self._act_floor: dict[tuple, tuple[dict[str, float], dict[str, float], dict[str, float], float]] = {}
        self._state_floor: dict[tuple, tuple[dict[int, float], dict[int, float]]] = {}
        self._compute_floor: dict[tuple, float] = {}
        self.num_programs = 0

    def view(self, k: int, first: bool, last: bool) -> OpGraph:
        key = (k, first, last)
        if key not in self._views:
            self._views[key] = stage_view(self.graph, self.structure, k, first=first, last=last)
        return self._views[key]

    def cp_pricing(self, dp: int, tp: int, m: int) -> CPPricing | None:
        """How a stage on a (dp·cp, tp) sub-mesh at m micro-batches runs cp attention (None without cp): the
        pinned algorithm, else `cp_algorithm` where set, else the fastest that applies."""
        if not self.cp.on:
            return None
        key = (dp, tp, m)
        if key not in self._cp_pricing:
            self._cp_pricing[key] = price_cp_attention(
                self._attention,
                self.cluster,
                self.cp,
                data=dp,
                tp=tp,
                num_microbatches=m,
                precision=self.precision.name,
            )
        pricing, alg = self._cp_pricing[key], self.cp_algorithm
        if alg is None or alg == pricing.algorithm or alg not in pricing.ranked:
            return pricing
        faster = ", ".join(str(a) for a in pricing.ranked[: pricing.ranked.index(alg)])
        return pricing.with_algorithm(
            alg, f"{faster}: faster per layer, but under the memory budget the fastest pipeline layout runs {alg}"
        )

    def leaner_cp_algorithms(self) -> list[CPAlgorithm]:
        """The algorithms worth a search of their own when memory binds: those no other algorithm beats in both
        kept K/V and working memory, on a (cp, 1) sub-mesh. Their memory order holds on every sub-mesh (each
        figure scales with the tokens and heads a rank holds), their time order does not (latencies, and a ring
        step's max of compute and transfer), so which one is fastest is left to each search. In practice ring
        (nothing kept, the smallest blocks in flight) is the one."""
        ref = self.cp_pricing(self.cp.degree, 1, 1)
        node = self._attention[0]
        figures = {
            a: (c.saved_bytes, c.peak_extra_bytes) for a in ref.ranked for c in (ref.cost(node, 1, algorithm=a),)
        }

        def dominated(mine: tuple[float, float]) -> bool:
            return any(f != mine and all(x <= y for x, y in zip(f, mine, strict=True)) for f in figures.values())

        return [a for a, f in figures.items() if not dominated(f)]

    def cp_run(self, dp: int, tp: int, m: int) -> CPAlgorithm | None:
        """The algorithm a stage on this sub-mesh runs (None without cp): what its solved programs are keyed by, so
        that a search that forces an algorithm reuses the stages where it is the fastest anyway."""
        pricing = self.cp_pricing(dp, tp, m)
        return pricing.algorithm if pricing is not None else None

    def runs_cp_algorithm(self, tp: int) -> bool:
        """Whether a sub-mesh of tensor degree tp can run `cp_algorithm` (all-to-all needs the heads a tensor rank
        holds to divide by cp; nothing else limits an algorithm)."""
        return self.cp_algorithm is None or self.cp_algorithm in self.cp_pricing(self.cp.degree, tp, 1).ranked

    def program(self, k, first, last, dp, tp, m, copies=1.0) -> ShardingProgram:
        prog = ShardingProgram(
            self.view(k, first, last),
            self.cluster,
            dp,
            tp,
            estimator=self.estimator,
            precision=self.precision,
            zero_stage=None,
            memory_budget_bytes=self.budget,
            batch_dim_size=self.batch,
            num_microbatches=m,
            activation_copies=copies,
            recompute=self.recompute,
            tensor_split=TensorSplit.from_constraints(self.constraints, tp),
            overlap=False,  # a stage reduces its gradients after the schedule
            pipeline_stage=True,
            step_gathers=self.overlap_on,
            tp_overlap=self.overlap_on,
            cp=self.cp_pricing(dp, tp, m),
        )
        if dp > 1:
            prog.zero_choices = list(self.zero_choices)
        return prog

    def free(self, k: int, first: bool, last: bool, dp: int, tp: int, m: int) -> PricedStage:
        """The memory-free optimum at the lowest allowed ZeRO stage: the fastest this stage can be."""
        key = (k, first, last, dp, tp, m, self.cp_run(dp, tp, m))
        if key not in self._free:
            prog = self.program(k, first, last, dp, tp, m)
            if prog.cannot_split():  # a tensor axis with no weight to split is data parallelism
                self._free[key] = PricedStage(False)
                return self._free[key]
            prog.build()
            self.num_programs += 1
            self._free[key] = self._record(prog, prog.solve(stage=prog.zero_choices[0], memory=False), 1.0)
        return self._free[key]

    def price(self, k: int, first: bool, last: bool, dp: int, tp: int, m: int, copies: float) -> PricedStage:
        """The stage's optimum within the memory budget with `copies` micro-batches of activations alive."""
        free = self.free(k, first, last, dp, tp, m)
        if not free.feasible or sum(free.memory_at(copies).values()) <= self.budget:
            return free
        key = (k, first, last, dp, tp, m, round(copies, 6), self.cp_run(dp, tp, m))
        if key not in self._bound:
            prog = self.program(k, first, last, dp, tp, m, copies)
            if sum(prog.memory_lower_bound().values()) > self.budget:
                self._bound[key] = PricedStage(False)
            else:
                prog.build()
                self.num_programs += 1
                self._bound[key] = dataclasses.replace(
                    self._record(prog, prog.solve_best(free.result.step_time_s), copies), bound=True
                )
        return self._bound[key]

    def floors(self, first: bool, last: bool, dp: int, tp: int, b: int) -> StageFloors:
        """The one-layer bounds of a stage kind (see `StageFloors`)."""
        akey, skey = (first, last, tp, b, self.cp_run(1, tp, self.batch // b)), (first, last, dp, tp)
        if akey not in self._act_floor:
            prog = self.program(1, first, last, 1, tp, self.batch // b)
            bounds = {mode: prog.memory_lower_bound(mode) for mode in prog.recompute_choices}
            free = self.free(1, first, last, 1, tp, self.batch // b)
            # solved, so it knows each group's forward time (per step: divided by its micro-batches)
            built = free.program
            rec = {m: built.recompute_time_lower_bound(m) / built.mb if built is not None else 0.0 for m in bounds}
            self._act_floor[akey] = (
                {m: bd["activations"] for m, bd in bounds.items()},
                {m: bd["transient"] for m, bd in bounds.items()},
                rec,
                free.t_mb,
            )
        if skey not in self._state_floor:
            prog = self.program(1, first, last, dp, tp, 1)
            states, sync = {}, {}
            for z in prog.zero_choices:
                states[z], sync[z] = 0.0, 0.0
                for name, grp in prog.groups.items():
                    if prog.graph.kinds[name] != NodeKind.PARAM or not grp.count:
                        continue
                    ks = range(len(grp.strategies))
                    states[z] += grp.count * min(sum(prog.state_bytes(name, j, z)) for j in ks)
                    sync[z] += grp.count * min(prog.sync_time(name, j, z) + prog.optimizer_time(name, j, z) for j in ks)
            self._state_floor[skey] = (states, sync)
        return StageFloors(*self._act_floor[akey], *self._state_floor[skey])

    def compute_floor(self, first: bool, last: bool, tp: int, b: int) -> float:
        """A lower bound of the floors' t_mb (`floors`) of a one-layer stage view on tp devices at micro-batch size b,
        without building its program: every group at the strategy of least compute, each on its own; no
        resharding, no recompute (both only add). Without a cp axis (its attention is priced apart)."""
        key = (first, last, tp, b)
        if key not in self._compute_floor:
            m = self.batch // b
            groups = MeshGroups(
                self.view(1, first, last),
                tp=tp,
                tp_link=self.cluster.link_for_axis(tp, 1),
                data_ranks=1,
                batch=self.batch,
                num_microbatches=m,
                estimator=self.estimator,
            )
            total = 0.0
            for grp in groups.groups.values():
                if grp.count:
                    ks = range(len(grp.strategies))
                    total += grp.count * min(
                        sum(sum(groups.op_times(groups.graph.node(n), grp.divisor[n][k])) for n in grp.members)
                        for k in ks
                    )
            # the solver's binaries may sit a hair below 1: a bound a hair below the sum keeps it a bound
            self._compute_floor[key] = total / m * (1 - FLOOR_MARGIN)
        return self._compute_floor[key]

    @staticmethod
    def _record(prog: ShardingProgram, res: MeshResult, copies: float) -> PricedStage:
        if not res.feasible:
            return PricedStage(False, result=res)
        # cp attention's exposed communication is a term of its own in the stage program (not in compute_s), but
        # the stage waits for it every micro-batch as for its compute
        t_mb = (res.compute_s + res.reshard_s + res.cp_comm_s) / prog.mb
        last = prog.last_bucket_s(res.zero_stage) if prog.dp > 1 else 0.0
        return PricedStage(
            True,
            t_mb,
            res.grad_sync_s + res.optimizer_s,
            res.zero_stage,
            tuple(res.memory.items()),
            copies,
            res,
            prog,
            last_bucket_s=last,
        )


class StackPricer(StagePricer):
    """A `StagePricer` whose stage key is a layer range (a, b) of several stacks' sequence, not a count."""

    def __init__(self, graph: OpGraph, structure: LayerStructure, cluster: ClusterSpec, **kw):
        super().__init__(graph, structure, cluster, **kw)
        self.flat = stack_layers(graph.node_layer)[0]
        self._crossing: dict[int, float] = {}

    def view(self, k, first: bool, last: bool) -> OpGraph:
        if k not in self._views:
            self._views[k] = range_view(self.graph, self.flat, self.structure.num_layers, *k)
        return self._views[k]

    def crossing(self, cut: int) -> float:
        """Bytes per sample crossing the boundary before layer `cut`."""
        if cut not in self._crossing:
            self._crossing[cut] = crossing_bytes(self.graph, self.flat, self.structure.num_layers, cut, self.batch)
        return self._crossing[cut]

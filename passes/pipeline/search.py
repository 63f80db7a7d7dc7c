r"""Pipeline search: cut the layers into stages, give each stage a sub-mesh, choose micro-batches and a schedule.

Expects an `OpGraph` whose repeated layers are all alike (one container, every layer deduplicated
onto the first, as `OpGraph.from_traced` and the shortened preset traces give), or a full trace of
several stacks of layers (an encoder and a decoder; see "Several stacks" below). Returns a
`PipelineSolution`: the number of stages, the layers, sub-mesh, ZeRO stage, time and memory of
each stage, the micro-batches and the schedule, with the predicted step time and the best plan
without a pipeline next to it. It does not rewrite the graph.

Terms:
    W  world size;  L  layers;  B  global batch
    p  pipeline stages (pp); every stage runs on n = W / p consecutive devices as a dp x tp sub-mesh
    b  micro-batch size per data-parallel rank;  m = B / (dp b)  micro-batches per step
    v  virtual stages per device (interleaved 1F1B: device d runs chunks d, d + p, ..., d + (v-1) p)
    k_s  layers of stage s (sum_s k_s = L); stage 0 also runs what comes before the layers
         (embeddings), stage p-1 what comes after them (final norm, head, loss)

Stage price. A stage is a view of the graph (`stage_view`): the representative layer nodes stand
for k_s layers, the nodes before and after the layers count on the first and last stage only.
Identical layers share one set of decision groups, so a stage of any k_s is one small program.
The intra-op program (`ShardingProgram`) prices it on its sub-mesh at m micro-batches:
    t_s   compute and resharding of one micro-batch (forward and backward), on one device
    S_s   gradient synchronisation over the stage's dp axis (and ZeRO gathers), once per step
    a_s   micro-batches whose activations the schedule keeps alive on the stage at once (`schedules`)
    memory  states + a_s x activations of one micro-batch + working memory <= budget
    c_s   point-to-point transfers of one micro-batch: the boundary activation forward to the next
          stage and its gradient back to the previous one (v of each with interleaving), each device
          sending b x (bytes per sample) / tp over the link between the two device blocks (the
          inter-node link when the blocks sit on different nodes), then an all-gather over tp

Step time (`step_cost`), with the overlap the pipeline program runs (`plan.overlap`, on by default):
    T = slots max_s (t_s + e_s) + max_s (E_s + O_s),   slots = m + p - 1, or m + (p - 1)/v interleaved
  e_s and E_s the parts of c_s and of the gradient sync the step waits for.

Schedules: which are tried for a (p, m), the activations each keeps and its bubble (`schedules`).

Search. For every p dividing W (2 <= p <= L), sub-mesh dp x tp (tp within a node unless pinned),
micro-batch size b (ascending) and schedule:
  1. estimate: one-layer stage views give, per (tp, b), the memory-free time of one micro-batch on tp
     devices alone (compute and resharding do not depend on dp at a fixed b) and the leanest
     activations and working memory, and per (dp, tp) the leanest states and least gradient sync of
     each ZeRO stage; a stage of k layers costs the first/last view's figure plus k - 1 middle layers.
     The cut minimising the bottleneck under these costs, each stage at the cheapest ZeRO stage whose
     memory floor fits, is the estimate (close to a lower bound of T). A configuration where no cut
     fits is dropped, and so are larger b on its sub-mesh, as are b past the point where the
     estimate has risen by MICRO_BATCH_STOP over a smaller b (the bubble only grows from there);
  2. in order of the estimate, configurations are priced exactly until the estimate (less
     ESTIMATE_SLACK) is no better than the best exact T. Exact pricing starts from the estimate's cut
     less one layer per stage and adds layers one at a time to the stage whose cost
     (slots x (t_s + c_s) + S_s) grows least (optimal for a bottleneck with costs nondecreasing in
     k_s). Each (k, first, last, sub-mesh, m, a_s) is solved once and cached; middle stages are
     priced at the copies of the fullest of them (stage 1), so one program serves them all.
Pipelines use ZeRO stages 0 and 1 only, or the pinned one of them (see `stage_cost`).

Several stacks. An encoder-decoder model (T5) has two stacks whose layers are not alike (the first of
each stack computes the position bias, decoder layers cross-attend): `stack_structure` numbers their
layers as one sequence 0 .. L-1 (`pipeline_split.stack_layers`), and a stage is a range [a, b) of it,
priced by `range_view` over exactly the nodes `assign_stages` puts on that stage (the nodes between
the stacks where the split runs them). Each range is its own program, without deduplication (the
model is traced whole); the cut minimising the bottleneck is found by dynamic programming over
(stage, last layer), O(p L^2) range prices, with the estimate equal to the exact price. c_s is priced
from the values that cross each boundary (`crossing_bytes`: in the decoder, the hidden state, the
encoder's output and the position biases). Interleaving is not searched over several stacks.
The plan without a pipeline (p = 1) comes from `solve_sharding` and competes with the best pipeline.

A cp axis (constraints "cp" > 1, the graph traced for cp: each sequence is cp rows of seq/cp tokens, B counts
those rows). A stage's sub-mesh is then dp·cp x tp, its data axis the dp·cp ranks (a pinned "dp" counts dp
alone, and the data axis must hold whole cp groups), as in `solve_sharding`: per-token compute and activations
of a stage are those of its rows, i.e. divided by cp; each attention node is priced across the cp group by
`passes.context_parallel` with the pinned algorithm, else the fastest that applies on that sub-mesh; and
c_s sends this rank's rows, b sequences of seq/cp tokens: the boundary bytes per sequence divided by cp.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.ir import OpGraph
from autopar.passes import sharding_solver as ss
from autopar.passes.pipeline.layers import (
    layer_structure,
    stack_structure,
)
from autopar.passes.pipeline.pins import PIPELINE_CONSTRAINT_KEYS, check_pins, divisors, wants_pipeline
from autopar.passes.pipeline.schedules import (
    Schedule,
    activation_copies,
    bubble_fraction,
    schedule_choices,
    schedule_slots,
    stage_layer_ranges,
)
from autopar.passes.pipeline.solution import PipelineSolution, StagePlan
from autopar.passes.pipeline.stage_cost import PricedStage, StackPricer, StagePricer
from autopar.passes.pipeline.step_cost import (
    Overlap,
    Transfer,
    backward_time,
    block_link,
    overlap_efficiency,
    stage_transfers,
    step_price,
    transfer_time,
)
from autopar.passes.sharding_solver import (
    Precision,
    ShardingSolution,
    format_bytes,
)
from autopar.plan import PIPELINE_ZERO_STAGES

ESTIMATE_SLACK = 0.02  # how far an estimate may sit above the exact price before a configuration is skipped
MICRO_BATCH_STOP = 0.10  # see _Search._micro_batches


# ----------------------------------------------------------------------------------------- the search


@dataclass(frozen=True, slots=True)
class _Config:
    """One point of the search: stages, sub-mesh, micro-batches and schedule."""

    pp: int
    dp: int
    tp: int
    m: int
    schedule: Schedule
    v: int

    def describe(self, cp: int = 1) -> str:
        """The layout in words; with a cp axis of `cp` ranks, the data axis (dp here) as dp x cp."""
        sched = f"{self.schedule}" + (f" v={self.v}" if self.schedule == Schedule.INTERLEAVED_1F1B else "")
        data = f"dp={self.dp // cp} cp={cp}" if cp > 1 else f"dp={self.dp}"
        return f"pp={self.pp} {data} tp={self.tp} micro-batches={self.m} {sched}"


def _meshes(c: dict, cluster: ClusterSpec, pp: int, batch: int, cp: int = 1) -> list[tuple[int, int]]:
    """Sub-meshes (dp, tp) of world/pp devices: tp inside a node unless pinned, dp dividing the batch. With a cp
    axis dp is the data axis, dp·cp ranks (a pinned "dp" counts dp alone), and must hold the cp group."""
    n = cluster.world_size // pp
    out = []
    for tp in divisors(n):
        dp = n // tp
        if c.get("tp") is not None and tp != c["tp"] or c.get("dp") is not None and dp != c["dp"] * cp:
            continue
        if dp % cp:
            continue
        if c.get("tp") is None and tp > cluster.devices_per_node:
            continue  # a tensor axis across nodes pays the network on every layer
        if batch % dp == 0:
            out.append((dp, tp))
    return out


def _allocate(cost, start: list[int], total: int) -> list[int] | None:
    """Layers per stage minimising the largest cost(s, k_s), adding one layer at a time from `start`.

    Adding each layer to the stage whose cost grows to the least is optimal for a bottleneck when
    every cost is nondecreasing in k (an exchange argument); `start` must not exceed the optimum.
    """
    k = list(start)
    for s in range(len(k)):
        while not math.isfinite(cost(s, k[s])) and k[s] > 1:
            k[s] -= 1  # the estimate's cut overfills this stage (memory): start lower
        if not math.isfinite(cost(s, k[s])):
            return None
    left = total - sum(k)
    if left < 0:
        return None
    heap = [(cost(s, k[s] + 1), s) for s in range(len(k))]
    heapq.heapify(heap)
    while left:
        c, s = heapq.heappop(heap)
        if not math.isfinite(c):
            return None
        k[s] += 1
        left -= 1
        heapq.heappush(heap, (cost(s, k[s] + 1), s))
    return k


class _Search:
    """The search of `search_pipeline` over the configurations with more than one stage."""

    def __init__(self, pricer: StagePricer, constraints: dict, say):
        self.pricer, self.c, self.say = pricer, constraints, say
        self.cluster, self.structure = pricer.cluster, pricer.structure
        self.L, self.B, self.budget = pricer.structure.num_layers, pricer.batch, pricer.budget
        self.overlap = Overlap(bool(constraints.get("overlap", True)), overlap_efficiency(pricer.cluster))
        self.num_configurations = 0
        self.num_programs = 0  # stage programs this search solved (its pricer may hold others' too)
        self.least_memory: tuple[float, _Config] | None = None
        self.dropped = False  # whether some configuration fit no cut at the memory floors (memory bound the search)

    def kmin(self, cfg: _Config) -> int:
        return cfg.v if cfg.schedule == Schedule.INTERLEAVED_1F1B else 1

    def micro_batch(self, cfg: _Config) -> int:
        return self.B // (cfg.dp * cfg.m)

    def copies(self, cfg: _Config, s: int) -> float:
        return activation_copies(cfg.schedule, cfg.pp, s, cfg.m, cfg.v)

    def priced_copies(self, cfg: _Config, s: int) -> float:
        """Copies a stage is priced at: its own at the ends; middle stages share the fullest one's (stage 1),
        so that one program serves them all (the later ones then keep some memory spare)."""
        return self.copies(cfg, 1 if 0 < s < cfg.pp - 1 else s)

    # -------------------------------------------------------------------------------- estimates

    def configurations(self) -> list[tuple[float, _Config, list[int]]]:
        """(estimate, configuration, cut) of every allowed configuration where some cut fits the floors."""
        pps = [self.c["pp"]] if self.c.get("pp") else [p for p in divisors(self.cluster.world_size) if 2 <= p <= self.L]
        out = []
        for pp in pps:
            for dp, tp in _meshes(self.c, self.cluster, pp, self.B, self.pricer.cp.degree):
                if self.pricer.runs_cp_algorithm(tp):
                    out += self._micro_batches(pp, dp, tp)
        return out

    def _micro_batches(self, pp: int, dp: int, tp: int) -> list[tuple[float, _Config, list[int]]]:
        """The configurations of one sub-mesh, micro-batch sizes ascending.

        Stops at a micro-batch size where nothing fits (larger ones need more memory), and once the best
        estimate is more than MICRO_BATCH_STOP above the best at a smaller size: past the size where the
        time per sample stops falling, larger micro-batches only lengthen the bubble.
        """
        out, best = [], math.inf
        for m in reversed(ss._microbatch_choices(self.B // dp, self.c)):
            tried = [_Config(pp, dp, tp, m, s, v) for s, v in schedule_choices(self.c, pp, m, self.L)]
            self.num_configurations += len(tried)
            fits = [(est[0], cfg, est[1]) for cfg in tried if (est := self.estimate(cfg)) is not None]
            out += fits
            self.dropped |= len(fits) < len(tried)
            if tried and not fits:
                break
            here = min((f[0] for f in fits), default=math.inf)
            if here > best * (1 + MICRO_BATCH_STOP):
                break
            best = min(best, here)
        return out

    def estimate(self, cfg: _Config) -> tuple[float, list[int]] | None:
        """T under the affine stage costs of `StageFloors` (see the module docstring), and its cut."""
        b = self.micro_batch(cfg)
        transfers = stage_transfers(self.cluster, self.structure, cfg.pp, cfg.tp, b, cfg.schedule, cfg.v)
        slots = schedule_slots(cfg.schedule, cfg.pp, cfg.m, cfg.v)
        mid = self.pricer.floors(False, False, cfg.dp, cfg.tp, b)
        ends = {s: self.pricer.floors(s == 0, s == cfg.pp - 1, cfg.dp, cfg.tp, b) for s in (0, cfg.pp - 1)}
        leanest = [math.inf]

        def cost(s: int, k: int) -> float:
            if k < self.kmin(cfg) or k > self.L:
                return math.inf
            f = ends.get(s, mid)
            best = math.inf
            for m in f.acts:  # each allowed recompute mode: its leanest activations and its least recompute time
                # a middle layer with nothing to recompute under m keeps what it keeps without recompute
                m_mid = m if m in mid.acts else "none"
                acts = self.copies(cfg, s) * (f.acts[m] + (k - 1) * mid.acts[m_mid]) + f.transient[m]
                t = f.t_mb + f.recompute_s[m] + (k - 1) * (mid.t_mb + mid.recompute_s[m_mid])
                exposed = self.overlap.transfer_exposed(transfers[s], t)
                for z, states in f.states.items():
                    need = states + (k - 1) * mid.states[z] + acts
                    leanest[0] = min(leanest[0], need)
                    if need <= self.budget:
                        sync = f.sync[z] + (k - 1) * mid.sync[z]  # with the optimizer step: an estimate may err low
                        # no last bucket: the program is not solved yet, and an estimate may err low
                        sync -= self.overlap.sync_hidden(sync, self._alone_window(cfg, s, t), backward_time(t, cfg.v))
                        best = min(best, slots * (t + exposed) + sync)
            return best

        alloc = _allocate(cost, [self.kmin(cfg)] * cfg.pp, self.L)
        if alloc is None:  # remember what the fullest stage of a balanced cut needs at least, for the error message
            fullest = 0.0
            for s in range(cfg.pp):
                leanest[0] = math.inf
                cost(s, math.ceil(self.L / cfg.pp))
                fullest = max(fullest, leanest[0])
            if self.least_memory is None or fullest < self.least_memory[0]:
                self.least_memory = (fullest, cfg)
            return None
        return max(cost(s, k) for s, k in enumerate(alloc)), alloc

    def _alone_window(self, cfg: _Config, s: int, t_mb: float) -> float:
        """w_s of stage s priced alone (the cut search): the stages before it taken as long as it."""
        return s * backward_time(t_mb, cfg.v)

    def stage_cost(self, cfg: _Config, s: int, p: PricedStage, transfer: Transfer, slots: float) -> float:
        """What stage s adds to the step priced alone: slots (t_s + e_s) + E_s + O_s."""
        if not p.feasible:
            return math.inf
        hidden = self.overlap.sync_hidden(
            p.grad_sync(), self._alone_window(cfg, s, p.t_mb), backward_time(p.t_mb, cfg.v), p.last_bucket_s
        )
        return slots * (p.t_mb + self.overlap.transfer_exposed(transfer, p.t_mb)) + p.sync - hidden

    # ------------------------------------------------------------------------------ exact pricing

    def evaluate(self, cfg: _Config, guess: list[int]) -> tuple | None:
        """The exact T of `cfg` at its best cut (starting from `guess`), with the stages' prices."""
        b = self.micro_batch(cfg)
        transfers = stage_transfers(self.cluster, self.structure, cfg.pp, cfg.tp, b, cfg.schedule, cfg.v)
        slots = schedule_slots(cfg.schedule, cfg.pp, cfg.m, cfg.v)

        def priced(s: int, k: int) -> PricedStage:
            return self.pricer.price(k, s == 0, s == cfg.pp - 1, cfg.dp, cfg.tp, cfg.m, self.priced_copies(cfg, s))

        def cost(s: int, k: int) -> float:
            if k < self.kmin(cfg) or k > self.L:
                return math.inf
            return self.stage_cost(cfg, s, priced(s, k), transfers[s], slots)

        alloc = _allocate(cost, [max(self.kmin(cfg), k - 1) for k in guess], self.L)
        if alloc is None:
            return None
        stages = [priced(s, k) for s, k in enumerate(alloc)]
        price = step_price(slots, stages, transfers, self.overlap, cfg.v)
        return price.step_s, alloc, stages, transfers, price

    def run(self, bound: float = math.inf) -> tuple[list[dict], tuple | None]:
        """Estimate every configuration, price them exactly in order while they can still win (against each
        other and against `bound`, a step found elsewhere)."""
        t0 = time.perf_counter()
        ranked = sorted(self.configurations(), key=lambda r: (r[0], r[1].pp, r[1].v))
        self.say(
            f"pipeline: {len(ranked)} of {self.num_configurations} configurations fit the memory floors "
            f"({time.perf_counter() - t0:.1f} s, {self.pricer.num_programs} programs)"
        )
        records, best = [], None
        for est, cfg, guess in ranked:
            if est * (1 - ESTIMATE_SLACK) >= min(bound, best[0] if best is not None else math.inf):
                break
            got = self.evaluate(cfg, guess)
            records.append(
                {
                    "pp": cfg.pp,
                    "dp": cfg.dp,
                    "tp": cfg.tp,
                    "num_microbatches": cfg.m,
                    "schedule": cfg.schedule.value,
                    "virtual_stages": cfg.v,
                    "estimate_s": est,
                    "step_time_s": got[0] if got else None,
                    "reason": "" if got else "no cut fits the memory budget",
                }
                | ({"cp_attention": str(alg)} if (alg := self.pricer.cp_run(cfg.dp, cfg.tp, cfg.m)) else {})
            )
            if got is None:
                continue
            self.say(
                f"pipeline {cfg.describe(self.pricer.cp.degree)}: {got[0] * 1e3:.2f} ms "
                f"(estimate {est * 1e3:.2f} ms, cut {got[1]})"
            )
            if best is None or got[0] < best[0]:
                best = (got[0], cfg, *got[1:])
        return records, best


class _StackSearch(_Search):
    """The search over several stacks of unlike layers: every stage range priced exactly, cut by a bottleneck
    partition (dynamic programming over (stage, last layer), O(p L^2) range prices), without interleaving.

    The estimate is the exact price (stage programs of a few unlike layers cannot be extrapolated from one
    layer), and each boundary's transfer is priced from the values that cross it.
    """

    def __init__(self, pricer: StackPricer, constraints: dict, say):
        super().__init__(pricer, constraints, say)
        self._exact: dict[_Config, tuple | None] = {}

    def estimate(self, cfg: _Config) -> tuple[float, list[int]] | None:
        got = self.evaluate(cfg, [])
        return None if got is None else (got[0], got[1])

    def _transfer(self, cfg: _Config, s: int, a: int, e: int) -> Transfer:
        """c_s of stage s running layers a..e-1: the values crossing its boundaries, forward and back."""
        n, b = self.cluster.world_size // cfg.pp, self.micro_batch(cfg)
        t = Transfer()
        if s < cfg.pp - 1:
            t += transfer_time(self.cluster, self.pricer.crossing(e), block_link(self.cluster, n, s, s + 1), b, cfg.tp)
        if s > 0:
            t += transfer_time(self.cluster, self.pricer.crossing(a), block_link(self.cluster, n, s, s - 1), b, cfg.tp)
        return t

    def evaluate(self, cfg: _Config, guess: list[int]) -> tuple | None:
        if cfg.schedule == Schedule.INTERLEAVED_1F1B:
            return None
        if cfg not in self._exact:
            self._exact[cfg] = self._partition(cfg)
        return self._exact[cfg]

    def _note_least_memory(self, cfg: _Config) -> None:
        """Remember the least memory the fullest stage of a balanced cut needs, for the error message."""
        p, L = cfg.pp, self.L
        bounds = [round(s * L / p) for s in range(p + 1)]
        need = 0.0
        for s in range(p):
            prog = self.pricer.program(
                (bounds[s], bounds[s + 1]), s == 0, s == p - 1, cfg.dp, cfg.tp, cfg.m, self.copies(cfg, s)
            )
            need = max(need, sum(prog.memory_lower_bound().values()))
        if self.least_memory is None or need < self.least_memory[0]:
            self.least_memory = (need, cfg)

    def _partition(self, cfg: _Config):
        p, L = cfg.pp, self.L
        slots = schedule_slots(cfg.schedule, p, cfg.m, cfg.v)

        def priced(s: int, a: int, e: int) -> PricedStage:
            return self.pricer.price((a, e), s == 0, s == p - 1, cfg.dp, cfg.tp, cfg.m, self.priced_copies(cfg, s))

        def cost(s: int, a: int, e: int) -> float:
            return self.stage_cost(cfg, s, priced(s, a, e), self._transfer(cfg, s, a, e), slots)

        # best[s][e]: the least bottleneck of stages 0..s over layers 0..e-1, and where stage s starts
        best: list[dict[int, tuple[float, int]]] = [{e: (cost(0, 0, e), 0) for e in range(1, L - p + 2)}]
        for s in range(1, p):
            ends = [L] if s == p - 1 else range(s + 1, L - p + s + 2)
            best.append(
                {
                    e: min(
                        (
                            (max(best[s - 1][a][0], cost(s, a, e)), a)
                            for a in range(s, e)
                            if math.isfinite(best[s - 1][a][0])
                        ),
                        default=(math.inf, 0),
                    )
                    for e in ends
                }
            )
        if not math.isfinite(best[p - 1][L][0]):
            self._note_least_memory(cfg)
            return None
        cuts, e = [L], L
        for s in range(p - 1, 0, -1):
            e = best[s][e][1]
            cuts.insert(0, e)
        starts = [0] + cuts[:-1]
        stages = [priced(s, a, e) for s, (a, e) in enumerate(zip(starts, cuts, strict=True))]
        transfers = [self._transfer(cfg, s, a, e) for s, (a, e) in enumerate(zip(starts, cuts, strict=True))]
        price = step_price(slots, stages, transfers, self.overlap, cfg.v)
        return price.step_s, [e - a for a, e in zip(starts, cuts, strict=True)], stages, transfers, price


# ----------------------------------------------------------------------------------------- entry point


def _record_key(record: dict) -> tuple:
    """A priced configuration's identity in the search records: its layout and the cp algorithm it ran."""
    return tuple(
        record.get(k) for k in ("pp", "dp", "tp", "num_microbatches", "schedule", "virtual_stages", "cp_attention")
    )


def _cp_fallback(pricer: StagePricer, c: dict, say, records: list[dict], best: tuple | None, search: _Search):
    """The search again with every stage on one cp attention algorithm, for each algorithm, the fastest layout
    kept. The first search runs each sub-mesh's fastest algorithm; where memory binds, one that holds less (ring
    keeps no gathered K/V, all-gather keeps them, all-to-all its head-split copies) may need less recompute or
    fewer micro-batches and so win, or fit where nothing else does. Each search skips the configurations whose
    estimate cannot beat the best so far, and reuses the stages priced before where the algorithm is the fastest
    anyway (the stage-range search of several stacks prices exactly, so it estimates nothing).

    Returns the records of every search, the best layout (None if none fits) and the search it came from (or,
    with none, the one whose leanest layout needs least, for the error message)."""
    found = search
    try:
        for alg in pricer.leaner_cp_algorithms():
            pricer.cp_algorithm = alg
            again = type(search)(pricer, c, say)
            say(f"pipeline: every stage on {alg} cp attention")
            more, got = again.run(best[0] if best is not None else math.inf)
            seen = {_record_key(r) for r in records}
            records = records + [r for r in more if _record_key(r) not in seen]
            if got is not None and (best is None or got[0] < best[0]):
                best, found = got, again
            if (
                best is None
                and again.least_memory is not None
                and (found.least_memory is None or again.least_memory[0] < found.least_memory[0])
            ):
                found = again
    finally:
        pricer.cp_algorithm = None  # the pricer serves later searches (`pricers`) with the fastest algorithms
    return records, best, found


def search_pipeline(
    graph: OpGraph,
    cluster: ClusterSpec,
    *,
    estimator,
    precision: str = "bf16",
    constraints: dict | None = None,
    memory_budget_bytes: float | None = None,
    batch_size: int,
    progress=None,
    pricers: dict | None = None,
) -> PipelineSolution:
    """Choose pp, the stage cuts, the sub-mesh, the micro-batches and the schedule by predicted step time.

    Args:
        graph: the traced model (a shortened trace of identical layers is fine).
        cluster: the devices and links.
        estimator: a ComputeEstimator (analytic roofline or profiled).
        precision: "bf16"/"fp16" (mixed precision AdamW) or "fp32".
        constraints: optional pins: "pp" (stages), "schedule" ("gpipe", "1f1b", "interleaved_1f1b"),
            "virtual_stages" (chunks per device, interleaved), "num_microbatches" or "micro_batch_size"
            (per data-parallel rank), and per stage "tp", "dp" (the sub-mesh axes), "zero" (0-3).
        memory_budget_bytes: per-device cap; defaults to the device memory.
        batch_size: the global batch (dim 0 of the inputs).
        progress: optional callable(str) told what is being priced.
        pricers: a dict that keeps the stage programs solved here for later searches of the same graph,
            cluster, estimator, precision and batch (`autopar.plan` prices its alternatives with it: a layout
            the search priced is then read back, not solved again). Only the pins a stage program depends on
            (ZeRO stage, recompute, tp_min_split, the budget) tell its entries apart.
    Raises:
        ConfigError: a pin that cannot hold (the message says which values would).
        InfeasiblePlanError: no layout fits the memory budget, with the least memory one needs.
    """
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    structure = layer_structure(graph, batch_size) or stack_structure(graph, batch_size)
    num_layers = structure.num_layers if structure is not None else 1
    c = check_pins(constraints, graph, structure, cluster.world_size)
    budget = float(memory_budget_bytes if memory_budget_bytes is not None else cluster.device.memory_bytes)
    single, single_error = None, None
    stages_pinned = wants_pipeline(c)
    if c.get("pp") in (None, 1):
        flat = {k: v for k, v in c.items() if k not in PIPELINE_CONSTRAINT_KEYS}
        try:
            single = ss.solve_sharding(
                graph,
                cluster,
                estimator=estimator,
                precision=precision,
                constraints=flat,
                memory_budget_bytes=budget,
                batch_size=batch_size,
                progress=say,
            )
            say(f"no pipeline: {single.step_time_s * 1e3:.2f} ms")
        except (InfeasiblePlanError, ConfigError) as e:
            single_error = e
    records, best = [], None
    pipeline_zero = c.get("zero") in (None, *PIPELINE_ZERO_STAGES)
    if structure is not None and c.get("pp") != 1 and num_layers >= 2 and pipeline_zero:
        key = (c.get("zero"), c.get("recompute"), c.get("tp_min_split"), c.get("grad_reduce"), budget)
        pricer = (pricers or {}).get(key)
        if pricer is None:
            pricer_cls = StackPricer if structure.stacks else StagePricer
            pricer = pricer_cls(
                graph,
                structure,
                cluster,
                estimator=estimator,
                precision=Precision.get(precision, c.get("grad_reduce")),
                zero=c.get("zero"),
                budget=budget,
                batch=batch_size,
                recompute=c.get("recompute"),
                constraints=c,
            )
            if pricers is not None:
                pricers[key] = pricer
        programs_before = pricer.num_programs
        search = (_StackSearch if structure.stacks else _Search)(pricer, c, say)
        records, best = search.run()
        # where memory binds (nothing fits, a configuration fits no cut, or a stage of the best is priced within the
        # budget), a cp algorithm that holds less may win
        if (
            pricer.cp.on
            and pricer.cp.algorithm is None
            and (best is None or search.dropped or any(p.bound for p in best[3]))
        ):
            records, best, search = _cp_fallback(pricer, c, say, records, best, search)
        search.num_programs = pricer.num_programs - programs_before
    else:
        pricer = search = None
    single_ok = single is not None and not stages_pinned
    if best is None or (single_ok and single.step_time_s <= best[0]):
        if single_ok:
            return _single_solution(single, graph, batch_size, records, search, time.perf_counter() - t0)
        _raise_none_fits(c, search, single_error, budget)
    return _pipeline_solution(best, search, single, records, time.perf_counter() - t0)


def _raise_none_fits(c: dict, search: _Search | None, single_error: Exception | None, budget: float):
    if search is None or search.least_memory is None:
        if single_error is not None:
            raise single_error
        raise ConfigError(
            f"no pipeline layout satisfies the constraints {c}: the sub-mesh dp x tp must make "
            f"world size / pp devices, the global batch must divide over dp and the samples of a "
            f"data-parallel rank into the micro-batches, 1F1B needs at least pp micro-batches and "
            f"interleaving a multiple of pp; loosen the pins"
        )
    need, cfg = search.least_memory
    raise InfeasiblePlanError(
        f"no pipeline layout fits: the leanest ({cfg.describe(search.pricer.cp.degree)}, micro-batch size {search.micro_batch(cfg)}) needs "
        f"at least {format_bytes(need)} per device on its fullest stage with balanced cuts, but the budget is "
        f"{format_bytes(budget)}; raise memory_budget, use more devices or a smaller batch or sequence"
    )


def _single_solution(sol: ShardingSolution, graph: OpGraph, batch: int, records, search, dt) -> PipelineSolution:
    """The plan without a pipeline in the PipelineSolution form: one stage holding every layer."""
    num_layers = graph.num_layers
    stage = StagePlan(
        0,
        ((0, num_layers),),
        num_layers,
        True,
        True,
        sol.dp,
        sol.tp,
        sol.zero_stage,
        (sol.compute_s + sol.reshard_s + sol.cp_comm_s) / sol.num_microbatches,
        0.0,
        sol.grad_sync_s,
        1.0,
        dict(sol.memory),
        sol,
        sol.optimizer_s,
    )
    return PipelineSolution(
        1,
        sol.dp,
        sol.tp,
        (stage,),
        sol.num_microbatches,
        batch // (sol.dp * sol.num_microbatches),
        None,
        1,
        0.0,
        sol.step_time_s,
        stage.peak_memory_bytes,
        sol.step_time_s,
        sol,
        tuple(records),
        search.num_programs if search else 0,
        dt,
    )


def _pipeline_solution(best, search: _Search, single, records, dt) -> PipelineSolution:
    step, cfg, alloc, priced, transfers, price = best
    stages = []
    for s, (k, p, rng) in enumerate(
        zip(alloc, priced, stage_layer_ranges(alloc, cfg.schedule, cfg.pp, cfg.v), strict=True)
    ):
        copies = search.copies(cfg, s)
        sharding = ss._solution(p.program, p.result, (), (), p.result.solve_time_s) if p.program else None
        opt = p.result.optimizer_s if p.result is not None else 0.0
        stages.append(
            StagePlan(
                s,
                rng,
                k,
                s == 0,
                s == cfg.pp - 1,
                cfg.dp,
                cfg.tp,
                p.zero,
                p.t_mb,
                transfers[s].total_s,
                p.sync - opt,
                copies,
                p.memory_at(copies),
                sharding,
                opt,
                price.transfer_exposed[s],
                price.sync_hidden[s],
                p.last_bucket_s,
            )
        )
    return PipelineSolution(
        cfg.pp,
        cfg.dp,
        cfg.tp,
        tuple(stages),
        cfg.m,
        search.micro_batch(cfg),
        cfg.schedule,
        cfg.v,
        bubble_fraction(cfg.schedule, cfg.pp, cfg.m, cfg.v),
        step,
        max(st.peak_memory_bytes for st in stages),
        single.step_time_s if single is not None else None,
        single,
        tuple(records),
        search.num_programs,
        dt,
    )

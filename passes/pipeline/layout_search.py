r"""The search over pipeline layouts: stages, sub-mesh, micro-batches and schedule, and the cut of the layers.

Expects a `stage_cost.StagePricer` (a `StackPricer` over several stacks) and the checked pins (`pins`). Gives
every configuration it priced (a record each) and the fastest, with its cut, its stages' prices and its step
price; it does not choose between a pipeline and the plan without one (`search`). A configuration
(`Configuration`: pp, dp, tp, m, schedule, v) is one pipeline layout; a cut is the layers per stage, k_s.

Terms:
    W  world size;  L  layers;  B  global batch;  p  stages, each on n = W / p devices as a dp x tp sub-mesh
    b  micro-batch size per data-parallel rank;  m = B / (dp b)  micro-batches per step;  v  chunks per device
    cost(s, k)  what stage s with k layers adds to the step priced alone: slots (t_s + e_s) + E_s + O_s
                (-> Implemented in: LayoutSearch.stage_cost(); the step's terms are `step_cost`'s)

Search (-> Implemented in: LayoutSearch.run()). For every p dividing W (2 <= p <= L), sub-mesh dp x tp (tp within
a node unless pinned; -> _meshes()), micro-batch size b (ascending) and schedule (`schedules.schedule_choices`):
  1. estimate (-> Implemented in: LayoutSearch.configurations(), LayoutSearch.estimate()): the one-layer floors of
     `stage_cost` give a stage of k layers the first/last view's figure plus k - 1 middle layers. The cut
     minimising the bottleneck under these costs, each stage at the cheapest ZeRO stage whose memory floor fits,
     is the estimate (close to a lower bound of T). A configuration where no cut fits is dropped, and so are
     larger b on its sub-mesh, as are b past the point where the estimate has risen by MICRO_BATCH_STOP over a
     smaller b (the bubble only grows from there; -> LayoutSearch._micro_batches());
  2. in order of the estimate, configurations are priced exactly until the estimate (less ESTIMATE_SLACK) is no
     better than the best exact T (-> Implemented in: LayoutSearch.evaluate()). Exact pricing starts from the
     estimate's cut less one layer per stage and adds layers one at a time to the stage whose cost grows least
     (optimal for a bottleneck with costs nondecreasing in k_s; -> _allocate()). Each (k, first, last, sub-mesh,
     m, a_s) is solved once and cached; middle stages are priced at the copies of the fullest of them (stage 1),
     so one program serves them all (-> LayoutSearch.priced_copies()).

With a cp axis a stage's data axis is dp·cp ranks: a pinned "dp" counts dp alone, and the data axis must hold
whole cp groups (-> _meshes()).

Several stacks (-> Implemented in: StackLayoutSearch). Stages are ranges [a, b) of the stacks' sequence of layers
(`layers.stack_structure`), each its own program: the cut minimising the bottleneck is found by dynamic
programming over (stage, last layer), O(p L^2) range prices, with the estimate equal to the exact price, and each
boundary's transfer priced from the values that cross it. Interleaving is not searched over several stacks.

Where no cut of a configuration fits, the search keeps the least memory the fullest stage of a balanced cut
needs, for the error that says so (`least_memory`); where the floors fit but no cut does once priced exactly, the
configuration (`no_cut`), whose stage short of memory the error then names (-> LayoutSearch.short_of_memory()).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from autopar import time_limit
from autopar.cluster import ClusterSpec
from autopar.passes.pipeline.pins import divisors
from autopar.passes.pipeline.schedules import Schedule, activation_copies, schedule_choices, schedule_slots
from autopar.passes.pipeline.stage_cost import FLOOR_MARGIN, PricedStage, StackPricer, StagePricer
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
from autopar.passes.sharding import search as ss

ESTIMATE_SLACK = 0.02  # how far an estimate may sit above the exact price before a configuration is skipped
MICRO_BATCH_STOP = 0.10  # see LayoutSearch._micro_batches


@dataclass(frozen=True, slots=True)
class Configuration:
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


class LayoutSearch:
    """The search of `search_pipeline` over the configurations with more than one stage."""

    def __init__(self, pricer: StagePricer, constraints: dict, say):
        self.pricer, self.c, self.say = pricer, constraints, say
        self.cluster, self.structure = pricer.cluster, pricer.structure
        self.L, self.B, self.budget = pricer.structure.num_layers, pricer.batch, pricer.budget
        self.overlap = Overlap(bool(constraints.get("overlap", True)), overlap_efficiency(pricer.cluster))
        self.num_configurations = 0  # configurations estimated
        self.num_unestimated = 0  # configurations left unestimated when the search stopped (`run`)
        self.num_programs = 0  # stage programs this search solved (its pricer may hold others' too)
        self.least_memory: tuple[float, Configuration] | None = None
        self.dropped = False  # whether some configuration fit no cut at the memory floors (memory bound the search)
        # configurations that fit the memory floors but no cut of which fits once priced exactly, for the error
        self.no_cut: list[Configuration] = []

    def kmin(self, cfg: Configuration) -> int:
        return cfg.v if cfg.schedule == Schedule.INTERLEAVED_1F1B else 1

    def micro_batch(self, cfg: Configuration) -> int:
        return self.B // (cfg.dp * cfg.m)

    def copies(self, cfg: Configuration, s: int) -> float:
        return activation_copies(cfg.schedule, cfg.pp, s, cfg.m, cfg.v)

    def priced_copies(self, cfg: Configuration, s: int) -> float:
        """Copies a stage is priced at: its own at the ends; middle stages share the fullest one's (stage 1),
        so that one program serves them all (the later ones then keep some memory spare)."""
        return self.copies(cfg, 1 if 0 < s < cfg.pp - 1 else s)

    # -------------------------------------------------------------------------------- estimates

    def configurations(self) -> list[tuple[float, Configuration, list[int]]]:
        """(estimate, configuration, cut) of every allowed configuration where some cut fits the floors."""
        out = []
        for walk in self.walks():
            while not walk.done:
                out += walk.step()
        return out

    def walks(self) -> list[MicroBatchWalk]:
        """The micro-batch walk of every allowed sub-mesh (pp, dp, tp), in the order of the configurations."""
        pps = [self.c["pp"]] if self.c.get("pp") else [p for p in divisors(self.cluster.world_size) if 2 <= p <= self.L]
        return [
            MicroBatchWalk(self, pp, dp, tp)
            for pp in pps
            for dp, tp in _meshes(self.c, self.cluster, pp, self.B, self.pricer.cp.degree)
            if self.pricer.runs_cp_algorithm(tp)
        ]

    def _micro_batches(self, pp: int, dp: int, tp: int) -> list[tuple[float, Configuration, list[int]]]:
        """The configurations of one sub-mesh, micro-batch sizes ascending (`MicroBatchWalk`)."""
        walk, out = MicroBatchWalk(self, pp, dp, tp), []
        while not walk.done:
            out += walk.step()
        return out

    def compute_bound(self, cfg: Configuration) -> float:
        """A lower bound of `estimate(cfg)` from compute alone, without solving a program: the least bottleneck
        over the cuts of slots x (t_end + (k - 1) t_mid), each t the least compute of a one-layer view
        (`StagePricer.compute_floor`), below the estimate's own stage cost term by term (its t is the floors'
        solved optimum, and transfers, gradient sync and recompute only add), so its least bottleneck too."""
        b, floor = self.micro_batch(cfg), self.pricer.compute_floor
        slots = schedule_slots(cfg.schedule, cfg.pp, cfg.m, cfg.v)
        mid = floor(False, False, cfg.tp, b)
        ends = {s: floor(s == 0, s == cfg.pp - 1, cfg.tp, b) for s in (0, cfg.pp - 1)}

        def cost(s: int, k: int) -> float:
            if k < self.kmin(cfg) or k > self.L:
                return math.inf
            return slots * (ends.get(s, mid) + (k - 1) * mid)

        alloc = _allocate(cost, [self.kmin(cfg)] * cfg.pp, self.L)
        if alloc is None:
            return math.inf  # no cut at all: the estimate finds none either
        return max(cost(s, k) for s, k in enumerate(alloc)) * (1 - FLOOR_MARGIN)

    def estimate(self, cfg: Configuration) -> tuple[float, list[int]] | None:
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

    def _alone_window(self, cfg: Configuration, s: int, t_mb: float) -> float:
        """w_s of stage s priced alone (the cut search): the stages before it taken as long as it."""
        return s * backward_time(t_mb, cfg.v)

    def stage_cost(self, cfg: Configuration, s: int, p: PricedStage, transfer: Transfer, slots: float) -> float:
        """What stage s adds to the step priced alone: slots (t_s + e_s) + E_s + O_s."""
        if not p.feasible:
            return math.inf
        hidden = self.overlap.sync_hidden(
            p.grad_sync(), self._alone_window(cfg, s, p.t_mb), backward_time(p.t_mb, cfg.v), p.last_bucket_s
        )
        return slots * (p.t_mb + self.overlap.transfer_exposed(transfer, p.t_mb)) + p.sync - hidden

    # ------------------------------------------------------------------------------ exact pricing

    def evaluate(self, cfg: Configuration, guess: list[int]) -> tuple | None:
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

    # configurations are estimated lazily, in order of their compute bound (`run`); the searches whose estimates
    # are exact prices or whose memory decides a search of its own (cp) estimate every one first
    lazy = True

    def run(self, bound: float = math.inf) -> tuple[list[dict], tuple | None]:
        """Estimate every configuration, price them exactly in order while they can still win (against each
        other and against `bound`, a step found elsewhere).

        Without a cp axis the estimates are made lazily (`_ranked`): a sub-mesh's remaining micro-batch sizes are
        estimated only once the least compute bound among them (`compute_bound`) comes up in the order of the
        estimates, so that those whose compute alone cannot beat the best exact step are never estimated. The
        configurations priced, their order and the answer are those of estimating every one first.
        """
        t0 = time.perf_counter()
        records, best = [], None
        for est, cfg, guess in self._ranked():
            if est * (1 - ESTIMATE_SLACK) >= min(bound, best[0] if best is not None else math.inf):
                break
            if time_limit.expired():
                time_limit.skipped(
                    f"pipeline layouts from {cfg.describe(self.pricer.cp.degree)} (estimate {est * 1e3:.2f} ms) on, "
                    f"in order of their estimates"
                )
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
                self.no_cut.append(cfg)
                continue
            self.say(
                f"pipeline {cfg.describe(self.pricer.cp.degree)}: {got[0] * 1e3:.2f} ms "
                f"(estimate {est * 1e3:.2f} ms, cut {got[1]})"
            )
            if best is None or got[0] < best[0]:
                best = (got[0], cfg, *got[1:])
        self.say(
            f"pipeline: {self.num_configurations} configurations estimated, {self.num_unestimated} left unestimated "
            f"(their compute alone cannot win), {len(records)} priced exactly ({time.perf_counter() - t0:.1f} s, "
            f"{self.pricer.num_programs} programs)"
        )
        return records, best

    def _ranked(self):
        """(estimate, configuration, cut) in ascending order of the estimate (ties: fewer stages, fewer chunks,
        then the order of `configurations`), made as they are asked for."""
        if not self.lazy or self.pricer.cp.on:
            yield from sorted(self.configurations(), key=lambda r: (r[0], r[1].pp, r[1].v))
            return
        walks = self.walks()
        # (value, 0, walk) for a walk's unestimated sizes, at their least compute bound; (estimate, 1, pp, v,
        # position) for an estimated configuration: at equal values a walk is resumed first, as its estimates
        # are no lower than its bound
        heap: list[tuple] = [(w.bound(), 0, i) for i, w in enumerate(walks) if not w.done]
        heapq.heapify(heap)
        while heap:
            item = heapq.heappop(heap)
            if item[1] == 0:
                i = item[2]
                walk = walks[i]
                j = walk.j
                for pos, (est, cfg, cut) in enumerate(walk.step()):
                    heapq.heappush(heap, (est, 1, cfg.pp, cfg.v, (i, j, pos), cfg, cut))
                if not walk.done:
                    heapq.heappush(heap, (walk.bound(), 0, i))
                continue
            self.num_unestimated = sum(w.unestimated() for w in walks)
            yield item[0], item[5], item[6]
        self.num_unestimated = 0

    # ------------------------------------------------------------------------------- when nothing fits

    def balanced_stage(self, cfg: Configuration, s: int) -> tuple[int, int]:
        """(stage key, layers) of stage s in a balanced cut of `cfg`, at its fullest: ceil(L / p) layers."""
        k = math.ceil(self.L / cfg.pp)
        return k, k

    def short_of_memory(self, cfg: Configuration) -> ShortStage | None:
        """The first stage of a balanced cut of `cfg` that no layout fits within the budget, for the error message;
        None where each fits, or one has no layout at all (a tensor axis with nothing to split: not memory)."""
        for s in range(cfg.pp):
            (key, layers), first, last = self.balanced_stage(cfg, s), s == 0, s == cfg.pp - 1
            copies = self.priced_copies(cfg, s)
            if self.pricer.price(key, first, last, cfg.dp, cfg.tp, cfg.m, copies).feasible:
                continue
            fastest = self.pricer.free(key, first, last, cfg.dp, cfg.tp, cfg.m)
            if not fastest.feasible:
                return None
            bound = self.pricer.program(key, first, last, cfg.dp, cfg.tp, cfg.m, copies).memory_lower_bound()
            return ShortStage(cfg, s, layers, copies, bound, fastest.memory_at(copies))
        return None


class MicroBatchWalk:
    """The configurations of one sub-mesh (pp, dp, tp), micro-batch sizes ascending, one size per `step`.

    Stops at a micro-batch size where nothing fits (larger ones need more memory), and once the best
    estimate is more than MICRO_BATCH_STOP above the best at a smaller size: past the size where the
    time per sample stops falling, larger micro-batches only lengthen the bubble.
    """

    def __init__(self, search: LayoutSearch, pp: int, dp: int, tp: int):
        self.search, self.pp, self.dp, self.tp = search, pp, dp, tp
        self.ms = list(reversed(ss._microbatch_choices(search.B // dp, search.c)))
        self.j = 0  # the next size
        self.best = math.inf
        self.done = not self.ms
        self._bounds: list[float] | None = None

    def _tried(self, m: int) -> list[Configuration]:
        s = self.search
        return [Configuration(self.pp, self.dp, self.tp, m, sc, v) for sc, v in schedule_choices(s.c, self.pp, m, s.L)]

    def step(self) -> list[tuple[float, Configuration, list[int]]]:
        """(estimate, configuration, cut) of the next size's configurations where some cut fits the floors."""
        s = self.search
        tried = self._tried(self.ms[self.j])
        self.j += 1
        s.num_configurations += len(tried)
        fits = [(est[0], cfg, est[1]) for cfg in tried if (est := s.estimate(cfg)) is not None]
        s.dropped |= len(fits) < len(tried)
        here = min((f[0] for f in fits), default=math.inf)
        if (tried and not fits) or here > self.best * (1 + MICRO_BATCH_STOP) or self.j == len(self.ms):
            self.done = True
        self.best = min(self.best, here)
        return fits

    def bound(self) -> float:
        """The least compute bound (`LayoutSearch.compute_bound`) of the configurations of the sizes left."""
        if self._bounds is None:  # suffix minima over the sizes
            per = [min((self.search.compute_bound(c) for c in self._tried(m)), default=math.inf) for m in self.ms]
            for j in range(len(per) - 2, -1, -1):
                per[j] = min(per[j], per[j + 1])
            self._bounds = per
        return self._bounds[self.j]

    def unestimated(self) -> int:
        """Configurations of the sizes not walked yet (some of which the walk may never have reached)."""
        return 0 if self.done else sum(len(self._tried(m)) for m in self.ms[self.j :])


@dataclass(frozen=True, slots=True)
class ShortStage:
    """A stage that holds more than the memory budget in every layout its program allows.

    Attributes:
        cfg: the configuration; stage: its index; layers: the layers it runs (a balanced cut's fullest).
        copies: micro-batches whose activations it keeps alive (a_s, as priced).
        bound: its program's memory lower bound by part (states, activations, transient): each part at its
            leanest on its own, which no one layout need reach.
        fastest: its fastest layout's memory by part (the memory-free optimum at `copies`).
    """

    cfg: Configuration
    stage: int
    layers: int
    copies: float
    bound: dict[str, float]
    fastest: dict[str, float]


class StackLayoutSearch(LayoutSearch):
    """The search over several stacks of unlike layers: every stage range priced exactly, cut by a bottleneck
    partition (dynamic programming over (stage, last layer), O(p L^2) range prices), without interleaving.

    The estimate is the exact price (stage programs of a few unlike layers cannot be extrapolated from one
    layer), and each boundary's transfer is priced from the values that cross it.
    """

    lazy = False

    def __init__(self, pricer: StackPricer, constraints: dict, say):
        super().__init__(pricer, constraints, say)
        self._exact: dict[Configuration, tuple | None] = {}

    def estimate(self, cfg: Configuration) -> tuple[float, list[int]] | None:
        got = self.evaluate(cfg, [])
        return None if got is None else (got[0], got[1])

    def _transfer(self, cfg: Configuration, s: int, a: int, e: int) -> Transfer:
        """c_s of stage s running layers a..e-1: the values crossing its boundaries, forward and back."""
        n, b = self.cluster.world_size // cfg.pp, self.micro_batch(cfg)
        t = Transfer()
        if s < cfg.pp - 1:
            t += transfer_time(self.cluster, self.pricer.crossing(e), block_link(self.cluster, n, s, s + 1), b, cfg.tp)
        if s > 0:
            t += transfer_time(self.cluster, self.pricer.crossing(a), block_link(self.cluster, n, s, s - 1), b, cfg.tp)
        return t

    def evaluate(self, cfg: Configuration, guess: list[int]) -> tuple | None:
        if cfg.schedule == Schedule.INTERLEAVED_1F1B:
            return None
        if cfg not in self._exact:
            self._exact[cfg] = self._partition(cfg)
        return self._exact[cfg]

    def balanced_stage(self, cfg: Configuration, s: int) -> tuple[tuple[int, int], int]:
        """(layer range, layers) of stage s in a balanced cut of `cfg`."""
        a, e = round(s * self.L / cfg.pp), round((s + 1) * self.L / cfg.pp)
        return (a, e), e - a

    def _note_least_memory(self, cfg: Configuration) -> None:
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

    def _partition(self, cfg: Configuration):
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

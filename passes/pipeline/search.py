r"""The pipeline search's entry point: the fastest layout with stages, against the plan without them.

Expects an `OpGraph` whose repeated layers are all alike (one container, every layer deduplicated onto the first,
as `OpGraph.from_traced` and the shortened preset traces give), or a full trace of several stacks of layers (an
encoder and a decoder; see `layers`). Returns a `PipelineSolution`: the number of stages, the layers, sub-mesh,
ZeRO stage, time and memory of each stage, the micro-batches and the schedule, with the predicted step time and
the best plan without a pipeline next to it. It does not rewrite the graph.

Terms:
    W  world size;  L  layers;  B  global batch
    p  pipeline stages (pp); every stage runs on n = W / p consecutive devices as a dp x tp sub-mesh
    b  micro-batch size per data-parallel rank;  m = B / (dp b)  micro-batches per step
    v  virtual stages per device (interleaved 1F1B: device d runs chunks d, d + p, ..., d + (v-1) p)
    k_s  layers of stage s (sum_s k_s = L); stage 0 also runs what comes before the layers (embeddings), stage
         p-1 what comes after them (final norm, head, loss)
    T  the predicted step time, T = slots max_s (t_s + e_s) + max_s (E_s + O_s) (`step_cost`)

`search_pipeline` runs these steps, each in the module named:
  1. the layers to cut (`layers`) and the pins checked (`pins`);
  2. the plan without a pipeline (p = 1), from `solve_sharding` where the pins allow one: it competes with the
     best pipeline (-> _plan_without_pipeline());
  3. the stage pricer (`stage_cost`), kept in `pricers` for later searches of the same graph (-> _stage_pricer()),
     and the search over the configurations and their cuts (`layout_search`, which prices a step with `step_cost`
     and reads the schedules' figures from `schedules`; -> _search_layouts());
  4. with a cp axis, where memory binds, the search again with every stage on each cp attention algorithm that
     holds less (-> _cp_fallback());
  5. the answer as a `PipelineSolution` (`solution`; -> _single_solution(), _pipeline_solution()), or the error
     that says why nothing fits (-> _raise_none_fits()).

A cp axis (constraints "cp" > 1, the graph traced for cp: each sequence is cp rows of seq/cp tokens, B counts
those rows). A stage's sub-mesh is then dp·cp x tp, its data axis the dp·cp ranks (a pinned "dp" counts dp
alone, and the data axis must hold whole cp groups), as in `solve_sharding`: per-token compute and activations
of a stage are those of its rows, i.e. divided by cp; each attention node is priced across the cp group by
`passes.context_parallel` with the pinned algorithm, else the fastest that applies on that sub-mesh; and
c_s sends this rank's rows, b sequences of seq/cp tokens: the boundary bytes per sequence divided by cp.
"""

from __future__ import annotations

import math
import time

from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.ir import OpGraph
from autopar.passes.pipeline.layers import LayerStructure, layer_structure, stack_structure
from autopar.passes.pipeline.layout_search import LayoutSearch, ShortStage, StackLayoutSearch
from autopar.passes.pipeline.pins import PIPELINE_CONSTRAINT_KEYS, check_pins, wants_pipeline
from autopar.passes.pipeline.schedules import (
    bubble_fraction,
    stage_layer_ranges,
)
from autopar.passes.pipeline.solution import PipelineSolution, StagePlan
from autopar.passes.pipeline.stage_cost import StackPricer, StagePricer
from autopar.passes.sharding import search as ss
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.report import format_bytes
from autopar.passes.sharding.solution import ShardingSolution
from autopar.plan import PIPELINE_ZERO_STAGES


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
    beat_s: float = math.inf,
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
        beat_s: a step only a faster layout is asked to beat, for the plan without a pipeline (`solve_sharding`).
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
    if c.get("pp") in (None, 1):
        single, single_error = _plan_without_pipeline(
            graph, cluster, c, estimator, precision, budget, batch_size, say, beat_s
        )
    records, best, search = [], None, None
    pipeline_zero = c.get("zero") in (None, *PIPELINE_ZERO_STAGES)
    if structure is not None and c.get("pp") != 1 and num_layers >= 2 and pipeline_zero:
        pricer = _stage_pricer(graph, structure, cluster, c, estimator, precision, budget, batch_size, pricers)
        records, best, search = _search_layouts(pricer, c, say)
    single_ok = single is not None and not wants_pipeline(c)
    if best is None or (single_ok and single.step_time_s <= best[0]):
        if single_ok:
            return _single_solution(single, graph, batch_size, records, search, time.perf_counter() - t0)
        _raise_none_fits(c, search, single_error, budget)
    return _pipeline_solution(best, search, single, records, time.perf_counter() - t0)


def _plan_without_pipeline(
    graph: OpGraph,
    cluster: ClusterSpec,
    c: dict,
    estimator,
    precision: str,
    budget: float,
    batch_size: int,
    say,
    beat_s: float = math.inf,
) -> tuple[ShardingSolution | None, Exception | None]:
    """The best plan without stages (`solve_sharding` under the pins less the pipeline's), or why there is none."""
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
            beat_s=beat_s,
        )
    except (InfeasiblePlanError, ConfigError) as e:
        return None, e
    say(f"no pipeline: {single.step_time_s * 1e3:.2f} ms")
    return single, None


def _stage_pricer(
    graph: OpGraph,
    structure: LayerStructure,
    cluster: ClusterSpec,
    c: dict,
    estimator,
    precision: str,
    budget: float,
    batch_size: int,
    pricers: dict | None,
) -> StagePricer:
    """The stage pricer for these pins: the one `pricers` kept from an earlier search, else a new one, kept there.

    Only the pins a stage program depends on (ZeRO stage, recompute, tp_min_split, grad_reduce, overlap, the budget)
    tell the kept pricers apart: the synchronous plan's search (overlap off) gets stage programs priced without
    overlap, not those of the overlapping search before it.
    """
    key = (c.get("zero"), c.get("recompute"), c.get("tp_min_split"), c.get("grad_reduce"), c.get("overlap", True))
    key += (budget,)
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
    return pricer


def _search_layouts(pricer: StagePricer, c: dict, say) -> tuple[list[dict], tuple | None, LayoutSearch]:
    """The records of the configurations priced, the best (None if none fits) and the search it came from.

    With a cp axis, where memory binds (nothing fits, a configuration fits no cut, or a stage of the best is
    priced within the budget), a cp algorithm that holds less may win: the search runs again (`_cp_fallback`).
    """
    programs_before = pricer.num_programs
    search = (StackLayoutSearch if pricer.structure.stacks else LayoutSearch)(pricer, c, say)
    records, best = search.run()
    if (
        pricer.cp.on
        and pricer.cp.algorithm is None
        and (best is None or search.dropped or any(p.bound for p in best[3]))
    ):
        records, best, search = _cp_fallback(pricer, c, say, records, best, search)
    search.num_programs = pricer.num_programs - programs_before
    return records, best, search


def _record_key(record: dict) -> tuple:
    """A priced configuration's identity in the search records: its layout and the cp algorithm it ran."""
    return tuple(
        record.get(k) for k in ("pp", "dp", "tp", "num_microbatches", "schedule", "virtual_stages", "cp_attention")
    )


def _cp_fallback(pricer: StagePricer, c: dict, say, records: list[dict], best: tuple | None, search: LayoutSearch):
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


def _raise_none_fits(c: dict, search: LayoutSearch | None, single_error: Exception | None, budget: float):
    """Raise the error that says why no layout is the answer: the pins (no configuration to price), the plan
    without a pipeline's own error, or memory (with the figures of the configuration closest to fitting)."""
    if search is None or search.least_memory is None:
        if single_error is not None:
            raise single_error
        short = _closest_short_of_memory(search)
        if short is not None:
            raise ConfigError(_short_of_memory_message(search, short, budget))
        raise ConfigError(
            f"no pipeline layout satisfies the constraints {c}: the sub-mesh dp x tp must make "
            f"world size / pp devices, the global batch must divide over dp and the samples of a "
            f"data-parallel rank into the micro-batches, 1F1B needs at least pp micro-batches and "
            f"interleaving a multiple of pp; loosen the pins"
        )
    need, cfg = search.least_memory
    raise InfeasiblePlanError(
        f"no pipeline layout fits: the leanest ({cfg.describe(search.pricer.cp.degree)}, micro-batch size "
        f"{search.micro_batch(cfg)}) needs at least {format_bytes(need)} per device on its fullest stage with "
        f"balanced cuts, but the budget is {format_bytes(budget)}; raise memory_budget, use more devices or a "
        f"smaller batch or sequence"
    )


def _closest_short_of_memory(search: LayoutSearch | None) -> ShortStage | None:
    """Of the configurations that fit the floors but no cut of which fits, the stage short of memory whose lower
    bound is least (the configuration closest to fitting); None where memory is not what stopped them."""
    if search is None:
        return None
    shorts = [short for cfg in search.no_cut if (short := search.short_of_memory(cfg)) is not None]
    return min(shorts, key=lambda short: sum(short.bound.values()), default=None)


def _short_of_memory_message(search: LayoutSearch, short: ShortStage, budget: float) -> str:
    """What stops every configuration the pins leave: a stage that holds more than the budget in every layout."""
    cfg = short.cfg
    parts = (
        f"model states {format_bytes(short.bound['states'])}, activations {format_bytes(short.bound['activations'])}, "
        f"working memory {format_bytes(short.bound['transient'])}"
    )
    need = sum(short.bound.values())
    if need > budget:
        why = f"needs at least {format_bytes(need)} per device ({parts}), {format_bytes(need - budget)} over it"
    else:  # the program's lower bound takes each part at its leanest on its own, which no one layout reaches here
        why = (
            f"holds more than the budget in every layout: its fastest layout needs "
            f"{format_bytes(sum(short.fastest.values()))} per device, and no layout takes every part at its leanest "
            f"at once ({parts}: {format_bytes(need)})"
        )
    return (
        f"no pipeline layout fits the memory budget of {format_bytes(budget)} per device: none of the "
        f"{len(search.no_cut)} configuration(s) priced has a cut whose stages all fit. The closest is "
        f"{cfg.describe(search.pricer.cp.degree)} (micro-batch size {search.micro_batch(cfg)}), whose stage "
        f"{short.stage}, with {short.layers} of the {search.L} layers and the activations of {short.copies:g} "
        f"micro-batch(es) alive, {why}; raise memory_budget, use more devices or a smaller batch or sequence"
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


def _pipeline_solution(best, search: LayoutSearch, single, records, dt) -> PipelineSolution:
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

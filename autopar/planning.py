"""Planning: one `plan` call's search over cp degrees, pipelines and meshes, and the placements `compile` solves
again for the graph its program runs.

The inputs arrive checked (`input_validation.PlanRequest`). `plan_model` traces the model once per cp degree it
prices (`Jobs`: a degree's graph holds each sequence as cp chunks), solves each (`solve`: the pipeline search
where pipelines are searched, else the sharding solver over meshes; the synchronous program where it beats the
overlapping one), keeps the fastest (`cp_search.search_cp`), and prices next to it the layouts a user would pick
by hand and the user's own (`rationale.with_rationale`). `plan_to_compile` is that planning on the one trace the
program may reuse; `solve_placements` gives a plan the per-node placements of the program's own graph by solving
again with the plan's layout pinned. Plans are built from solutions in `plan_build`.

Terms: a job is the graph traced for one cp degree with the settings every layout priced on it shares
(`plan_build.Job`); pins are constraints in `plan`'s dict form.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings

from autopar import time_limit
from autopar.cluster import ClusterSpec
from autopar.constraints import Constraints
from autopar.cp_search import cp_degrees, search_cp
from autopar.ep_search import ep_degrees, ep_record, search_ep
from autopar.errors import InfeasiblePlanError
from autopar.expert_parallel import (
    EP_MEMORY_NOTE,
    check_ep,
    ep_memory_advice,
    expert_split,
    layout_pins,
    moe_shape,
    with_expert_parallel,
)
from autopar.input_validation import PlanRequest, batch_size, check_cp, resolve_estimator
from autopar.ir import OpGraph
from autopar.passes.fused_ops import (
    FUSION_KINDS,
    fuse_traced,
    fusion_kinds,
    fusion_knobs,
    fusion_report,
    fusion_setting,
    fusion_summary,
)
from autopar.plan import Plan, ProgramKind
from autopar.plan_build import Job, assumptions, pipeline_plan, pipeline_runner_up, sharded_plan, sharded_runner_up
from autopar.program_comm import resolved_prefetch_depth
from autopar.rationale import PINNED, with_rationale
from autopar.tracing import cp_rank_batch, cp_traced_batch, trace_in_format, trace_shortened


def plan_model(request: PlanRequest, *, traced=None, against: Plan | None = None) -> Plan:
    """The fastest plan of `request` that fits, with the layouts the request asks priced next to it.

    Args:
        request: one `plan` call's checked inputs (`input_validation.read_plan_request`).
        traced: the TracedModel of the request's model when the caller has one (at the pinned cp degree): no cp
            degree is searched, and its graph is fused in place when fusion is on.
        against: a plan made before (`autopar.compare`): no search, the request's `compare` layouts are priced
            next to it, and it is never replaced by one of them.
    """
    rq = request
    ep = rq.constraints.get("ep") or 1
    if ep > 1:  # solved as the data-parallel layout the expert-parallel program runs, with the experts split
        moe = check_ep(ep, rq.module, rq.cluster.world_size, rq.constraints.get("dp"))
        rq = dataclasses.replace(
            rq, constraints=Constraints.of({k: v for k, v in layout_pins(rq.constraints).items() if k != "ep"})
        )
    searched = traced is None and against is None
    degrees = cp_degrees(rq.constraints, rq.cluster.world_size, rq.args, rq.kwargs) if searched else []
    jobs = Jobs(rq, traced=traced)
    if len(degrees) > 1:
        chosen, runner_up, _ = search_cp(functools.partial(_plan_at, jobs, rq.constraints), degrees)
    elif ep > 1 and against is None:
        chosen, runner_up = _plan_ep(jobs, rq.constraints, moe, ep)
    else:
        chosen, runner_up, _ = _plan_at(jobs, rq.constraints, rq.cp, against=against)
    weighed = None
    if "ep" not in request.constraints and against is None:  # a free ep: weighed against the search's plan
        chosen, weighed = _weigh_ep(jobs, chosen)
    alternatives = rq.alternatives
    if alternatives is None:
        alternatives = traced is None  # compile's own planning builds a program, never a report
    if alternatives and time_limit.expired():
        time_limit.skipped("the layouts a report prices next to the plan (DDP, ZeRO-3, Megatron-style, runner-up)")
        alternatives = False
    if alternatives or rq.compare:
        t_alt = time.perf_counter()
        chosen = with_rationale(
            chosen,
            runner_up,
            functools.partial(_price_layout, jobs),
            say=rq.say,
            baselines=alternatives,
            compare=rq.compare,
            adopt=not rq.constraints and against is None,
            kept=PLANNED_BEFORE if against is not None else PINNED,
        )
        chosen = dataclasses.replace(
            chosen,
            stats=chosen.stats
            | {
                "alternatives_time_s": round(time.perf_counter() - t_alt, 3),
                "total_time_s": round(time.perf_counter() - rq.t0, 3),
            },
        )
    if weighed is not None:  # after the alternatives: each degree's line says why it lost to the plan that stands
        searched_plan, priced, why_not = weighed
        record = ep_record(chosen, searched_plan, priced, why_not)
        chosen = dataclasses.replace(chosen, expert_parallel=chosen.expert_parallel | {"search": record})
    config = getattr(rq.module, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    stats = chosen.stats | ({"hidden_size": int(hidden)} if isinstance(hidden, int) else {})
    stats["total_time_s"] = round(time.perf_counter() - rq.t0, 3)  # a searched plan may have been priced first
    return dataclasses.replace(
        chosen,
        stats=stats,
        assumptions=assumptions(rq.estimator, rq.cluster, rq.budget),
        max_grad_norm=rq.max_grad_norm,
    )


class Jobs:
    """The jobs of one `plan` call, one per cp degree (1: none), each traced the first time a degree is priced: by
    the cp search, and again by the layouts priced next to the plan (a user's "tp=2,cp=4", the hand layouts
    without cp), so that each layout is solved on the graph its degree runs. A trace handed in stands for the
    request's pinned degree."""

    def __init__(self, request: PlanRequest, *, traced=None):
        self.request = request
        self._traced = {request.cp: traced} if traced is not None else {}
        self._jobs: dict[int, Job] = {}

    def __call__(self, cp: int) -> Job:
        if cp not in self._jobs:
            self._jobs[cp] = self._trace(cp)
        return self._jobs[cp]

    def _trace(self, cp: int) -> Job:
        rq = self.request
        module, args, kwargs = rq.module, rq.args, rq.kwargs
        if cp > 1:  # traced on the cp ranks' shares stacked on the batch (`context_parallel.inputs`)
            args, kwargs = cp_traced_batch(module, args, kwargs, cp)
        t_start = time.perf_counter()
        rq.say(f"tracing {rq.name}" + (f" for cp={cp}" if cp > 1 else ""))
        traced, graph = self._traced.get(cp), None
        if traced is None and isinstance(rq.model, str):
            graph = trace_shortened(module, args, kwargs, rq.say, rq.fuse, cp, rq.fuse_kinds)
        if graph is None:
            traced = traced if traced is not None else trace_in_format(module, args, kwargs, rq.precision, cp)
            traced = fuse_traced(traced, **fusion_knobs(rq.fuse_kinds)) if rq.fuse else traced
            frozen = frozenset(n for n, p in module.named_parameters() if not p.requires_grad)
            graph = OpGraph.from_traced(traced, frozen_params=frozen)
        t_trace = time.perf_counter() - t_start
        fusion = fusion_summary(rq.fuse, fusion_report(graph.traced), graph.layer_count, rq.fuse_kinds)
        rq.say(
            f"traced {len(graph.graph.nodes)} nodes, {graph.num_layers} layers ({graph.deduplicated_layers} "
            f"deduplicated)"
        )
        return Job(
            graph,
            rq.name,
            rq.cluster,
            rq.estimator,
            rq.precision,
            rq.budget,
            rq.offload,
            rq.pipeline,
            batch_size(args, kwargs),
            args,
            kwargs,
            fusion,
            rq.t0,
            t_trace,
            rq.say,
            cp=cp,
            clip=rq.max_grad_norm is not None,
        )


def _plan_at(jobs: Jobs, constraints: dict, cp: int, *, against: Plan | None = None):
    """(plan, runner-up, job) of the model traced for cp degree `cp` (1: none) and solved under `constraints`;
    with `against` (a plan made before, `autopar.compare`), that plan and no search."""
    job = jobs(cp)
    if against is not None:
        return against, None, job
    chosen, runner_up = solve(job, constraints | ({"cp": cp} if cp > 1 else {}))
    return chosen, runner_up, job


def _price_layout(jobs: Jobs, pins: dict) -> Plan:
    """A layout priced next to the plan (`rationale.with_rationale`): solved on the job of its cp degree, none
    where it pins none (the hand layouts are without cp); a cp it cannot run is the autopar error that says why."""
    rq = jobs.request
    cp = check_cp(pins, rq.cluster, rq.args, rq.kwargs)
    return solve(jobs(cp), pins | ({"cp": cp} if cp > 1 else {}), quiet=True)[0]


def _plan_ep(jobs: Jobs, constraints: dict, moe, ep: int, *, quiet: bool = False):
    """(plan, runner-up) of the expert-parallel layout at degree `ep` (`constraints`: its layout pinned, without
    ep): solved with the experts split (`expert_split`), then priced with the axis (`with_expert_parallel`)."""
    try:
        chosen, runner_up = solve(
            jobs(1),
            constraints,
            quiet=quiet,
            experts=expert_split(moe, ep),
            memory_advice=ep_memory_advice(ep, moe.num_experts),
        )
    except InfeasiblePlanError as e:
        raise InfeasiblePlanError(f"{e} ({EP_MEMORY_NOTE.format(ep=ep)})") from e
    return with_expert_parallel(chosen, moe, ep), runner_up


def _weigh_ep(jobs: Jobs, searched: Plan):
    """The search's plan or, where one is faster and fits, the fastest expert-parallel plan of a model with experts
    (`ep_search`), and what was weighed: (searched plan, [(degree, Plan or error)], why none was) or None for a
    model without experts."""
    rq = jobs.request
    moe = moe_shape(rq.module)
    if moe is None:
        return searched, None
    degrees, why_not = ep_degrees(moe, rq.constraints, rq.cluster.world_size, rq.offload)
    if degrees:
        rq.say(f"weighing expert parallelism: ep in {degrees}")

    def price(d: int) -> Plan:
        pins = {k: v for k, v in layout_pins(dict(rq.constraints) | {"ep": d}).items() if k != "ep"}
        return _plan_ep(jobs, pins, moe, d, quiet=True)[0]

    chosen, priced = search_ep(searched, price, degrees)
    return chosen, (searched, priced, why_not)


# why a layout `compare` prices faster than the plan did not replace it (`rationale.loss_reason`)
PLANNED_BEFORE = "which was planned before this layout was priced"


def solve(
    job: Job, constraints: dict, *, quiet: bool = False, experts=None, memory_advice=None, beat_s: float = math.inf
):
    """The fastest plan under `constraints`, and the search's runner-up: a Plan, constraints to price, or None.

    `quiet` (pricing alternatives) keeps the warnings about ignored settings to the user's own plan. `experts`
    (`cost_model.experts.ExpertSplit`): expert weights split over an ep group, priced so (no pipeline is searched).
    `memory_advice`: what the error says to do when nothing fits in memory (`solve_sharding`; None: the default).
    `beat_s`: a step only a faster plan is asked to beat (the synchronous program's solve next to the overlapping
    one's): the meshes without a pipeline that cannot are not solved (`solve_sharding`). The plan is the one without
    it wherever that is faster than `beat_s`, though its runner-up and its table of meshes may not be.
    """
    from autopar.passes.sharding.search import solve_sharding  # PuLP and HiGHS: not for `autopar --help`

    graph, cluster, est, precision, batch, budget = (
        job.graph,
        job.cluster,
        job.est,
        job.precision,
        job.batch,
        job.budget,
    )
    say = (lambda msg: None) if quiet else job.say
    if _searches_pipeline(job.pipeline, cluster, constraints):
        from autopar.passes.pipeline import search_pipeline  # as solve_sharding

        psol = search_pipeline(
            graph,
            cluster,
            estimator=est,
            precision=precision,
            constraints=constraints,
            memory_budget_bytes=budget,
            batch_size=batch,
            progress=say,
            pricers=job.pricers,
            beat_s=beat_s,
        )
        if job.offload and not quiet:
            warnings.warn("offload=True: pipeline layouts keep every state on the device", stacklevel=3)
        if psol.pp > 1:
            pplan = pipeline_plan(job, psol)
            pplan = dataclasses.replace(
                pplan,
                fusion=job.fusion,
                grad_reduce=constraints.get("grad_reduce") or "fp32",
                overlap=bool(constraints.get("overlap", True)),
                prefetch_depth=_prefetch_depth(constraints),
            )
            return pplan, pipeline_runner_up(job, psol, pplan)
        sol = psol.single_stage
    else:
        ignored = sorted(k for k in ("schedule", "virtual_stages") if constraints.get(k) is not None)
        if ignored and not quiet:
            warnings.warn(
                f"constraints {ignored} apply to pipeline layouts, and this plan searches none (pp=1); "
                f"pin pp > 1 or pass pipeline=True to search one",
                stacklevel=3,
            )
        flat = {k: v for k, v in constraints.items() if k not in _PIPELINE_KEYS}
        sol = solve_sharding(
            graph,
            cluster,
            estimator=est,
            precision=precision,
            constraints=flat,
            memory_budget_bytes=budget,
            batch_size=batch,
            progress=say,
            offload=job.offload if experts is None else False,  # the expert-parallel program keeps states on device
            experts=experts,
            memory_advice=memory_advice,
            beat_s=beat_s,
        )
    overlap = bool(constraints.get("overlap", True))
    chosen = dataclasses.replace(
        sharded_plan(job, sol),
        grad_reduce=constraints.get("grad_reduce") or "fp32",
        overlap=overlap,
        prefetch_depth=_prefetch_depth(constraints),
    )
    if (
        "overlap" not in constraints
        and overlap
        and chosen.program in (ProgramKind.SHARDED, ProgramKind.OFFLOAD)
        and chosen.zero_stage >= 1
    ):
        # the overlapping program holds more than the synchronous one (ZeRO-1: whole fp32 gradients,
        # `ShardingProgram.overlap_grad_bytes`; ZeRO-2/3: the gradient buckets in flight, `in_flight_grad_bytes`;
        # from ZeRO-1 the weights gathered ahead): where that memory costs more than the overlap hides (more
        # micro-batches, recompute, offload), the synchronous program is the faster plan. A plan that offloads runs
        # the offload program, which overlaps or not as its plan says, and is priced so.
        # only a synchronous plan faster than this one is asked for: its meshes that cannot be are not solved (the
        # bound a hair above the step, past the searches' own 1e-9 tolerance, so that none that could is left out)
        sync = constraints | {"overlap": False}
        try:
            without = solve(job, sync, quiet=True, beat_s=chosen.predicted.step_time_s * (1 + 4e-9))
        except InfeasiblePlanError:
            without = None
        if without is not None and without[0].predicted.step_time_s < chosen.predicted.step_time_s:
            return solve(job, sync, quiet=True)  # it wins: solved in full, for its runner-up and table of meshes
    return chosen, sharded_runner_up(sol)


def _prefetch_depth(constraints: dict) -> int:
    """The plan's prefetch depth, by the one rule (`program_comm.resolved_prefetch_depth`)."""
    return resolved_prefetch_depth(constraints.get("prefetch_depth"), bool(constraints.get("overlap", True)))


_PIPELINE_KEYS = {"pp", "schedule", "virtual_stages"}


def _searches_pipeline(pipeline: bool | None, cluster: ClusterSpec, constraints: dict) -> bool:
    pp = constraints.get("pp")
    if pp is not None and pp != 1:
        return True
    if pp == 1:
        return False
    if pipeline is not None:
        return bool(pipeline)
    return cluster.device.kind == "gpu" and cluster.num_nodes > 1


def plan_to_compile(request: PlanRequest) -> tuple[Plan, object | None]:
    """`compile`'s plan of `request` (the layouts of a report are not priced unless asked), and the planning trace
    where one trace served it (no cp degree searched), which the program reuses where it runs the same shape."""
    rq = request
    if len(cp_degrees(rq.constraints, rq.cluster.world_size, rq.args, rq.kwargs)) > 1:
        # the cp degree is searched as `plan` searches it (one trace per degree); the program traces its own
        return plan_model(rq), None
    args, kwargs = cp_traced_batch(rq.module, rq.args, rq.kwargs, rq.cp) if rq.cp > 1 else (rq.args, rq.kwargs)
    traced = trace_in_format(rq.module, args, kwargs, rq.precision, rq.cp)
    return plan_model(rq, traced=traced), traced


def solve_placements(plan: Plan, model, cluster: ClusterSpec, traced, args, kwargs) -> Plan:
    """The plan with per-node placements for `traced`, the graph its program runs.

    The data-parallel and offload programs need none. The sharded and pipeline programs run the graph traced at the
    shape one rank of the data axis sees (its rows of one micro-batch, `Program.trace_parts`), with the plan's
    tensor-axis placements by node name. Where that graph has other nodes than the one planned (a batch of one
    drops some expands), its tensor-axis placements are solved on it alone: the plan's tensor axis, recompute and
    parameter placements pinned, no data axis (the graph is one rank's share already), no memory budget (the plan's
    own figures stand: the same program, so the same predictions). A pipeline plan carries its stages' placements
    (`plan.stage_plans`), used wherever the graph's nodes have them.
    """
    if plan.program not in (ProgramKind.SHARDED, ProgramKind.PIPELINE):
        return plan
    names = {n.name for n in traced.exported.graph.nodes}
    stages = plan.stage_plans
    if stages and all(st.node_output and all(n in names for n in st.node_output) for st in stages):
        return plan  # the pipeline runs the placements its stages were priced with
    if plan.node_output and all(n in names for n in plan.node_output):
        return plan
    tp, cp = plan.mesh["tp"], plan.mesh.get("cp", 1)
    # the tensor axis the plan priced: its size, recompute and where every parameter sits on it
    pins = {
        "dp": 1,
        "tp": tp,
        "zero": 0,
        "num_microbatches": 1,
        "recompute": plan.recompute,
        "param_placements": dict(plan.param_placements),
        "grad_reduce": plan.grad_reduce,
        "overlap": plan.overlap,
        "prefetch_depth": plan.prefetch_depth,
    }
    if plan.tensor_split:
        pins["tp_min_split"] = plan.tensor_split["min_fraction"]
    if plan.program == ProgramKind.PIPELINE:
        pins["pp"] = 1
    if cp > 1:  # the graph is one cp rank's share of the sequences: solved as it is, without a cp axis
        args, kwargs = cp_rank_batch(model, args, kwargs, cp)
    micro = _solved_on(
        traced,
        model,
        cluster.sub_cluster(tp),
        args,
        kwargs,
        pins,
        precision=plan.precision,
        budget=float("inf"),
        fuse=fusion_setting(plan.fusion),
        offload=False,
    )
    return dataclasses.replace(
        plan,
        node_output=micro.node_output,
        node_inputs=micro.node_inputs,
        node_strategy=micro.node_strategy,
        param_placements=micro.param_placements,
    )


def _solved_on(
    traced,
    model,
    cluster: ClusterSpec,
    args,
    kwargs,
    pins: dict,
    *,
    precision: str,
    budget: float,
    fuse,
    offload=None,
) -> Plan:
    """The plan of `model` on `traced` under `pins` (a whole layout): what `plan` gives with these settings."""
    args, kwargs = tuple(args), dict(kwargs or {})
    request = PlanRequest(
        model=model,
        module=model,
        args=args,
        kwargs=kwargs,
        name=type(model).__name__,
        cluster=cluster,
        constraints=dict(pins),
        cp=check_cp(pins, cluster, args, kwargs),
        precision=precision,
        estimator=resolve_estimator(None, cluster, precision),
        budget=budget,
        offload=offload,
        pipeline=None,
        fuse=bool(fusion_kinds(fuse)),
        compare=(),
        alternatives=False,
        say=lambda msg: None,
        t0=time.perf_counter(),
        fuse_kinds=fusion_kinds(fuse) or FUSION_KINDS,
    )
    return plan_model(request, traced=traced)

"""The public entry points: `plan` (price and choose a layout) and `compile` (build the parallel program)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable

import torch

from autopar.checkpoint import hf
from autopar.cluster import ClusterSpec, parse_bytes
from autopar.cp_search import cp_degrees, search_cp
from autopar.errors import InfeasiblePlanError
from autopar.input_validation import (
    as_cluster,
    batch_size,
    check_batch_of_plan,
    check_compile_inputs,
    check_constraints,
    check_cp,
    check_given_plan,
    check_offload,
    check_precision,
    default_precision,
    resolve_estimator,
    resolve_model,
)
from autopar.ir import OpGraph
from autopar.plan import Plan, ProgramKind
from autopar.plan_build import Job, assumptions, pipeline_plan, pipeline_runner_up, sharded_plan, sharded_runner_up
from autopar.tracing import cp_traced_batch, program_trace, trace_in_format, trace_shortened


def plan(
    model,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    constraints: dict | None = None,
    memory_budget=None,
    offload: bool | None = None,
    precision: str | None = None,
    estimator=None,
    progress: Callable[[str], None] | None = None,
    pipeline: bool | None = None,
    fuse_kernels: bool | None = None,
    compare=(),
    alternatives: bool | None = None,
    _traced=None,
    _against: Plan | None = None,
) -> Plan:
    """Trace `model`, price every layout on `cluster`, and return the fastest plan that fits.

    Args:
        model: an nn.Module (real, fake or meta parameters), a preset name ("llama2-70b") or a config.json path.
        cluster: a ClusterSpec or its string form ("4x8xA100-80GB", "cpu:4").
        example_inputs, example_kwargs: one global batch for a module (shapes matter, values do not).
        global_batch_size, seq_len: the batch for a preset.
        constraints: pins: "tp", "dp" (axis sizes), "zero" (0-3), "num_microbatches" (gradient accumulation
            steps per data-parallel rank), "micro_batch_size" (samples per micro-batch per rank) or
            "recompute" (activation recompute: "none", "selective" for attention internals, "full" for
            whole layers), "tp_min_split" (the fraction of the layer matmul weights' elements a tensor axis
            must split: 1 by default, 0 lets it split nothing), "param_placements" (parameter name ->
            placement on the tensor axis, "R" or "S(dim)").
        memory_budget: per-device cap, bytes or "20GB"; defaults to the device memory.
        offload: None (default) lets the solver put optimizer states (fp32 master weights and moments) and
            gradients on the host where device memory requires it; False keeps every state on the device;
            True puts all of them on the host (ZeRO-Offload). Pipeline layouts keep states on the device.
        precision: "bf16"/"fp16" (mixed precision AdamW) or "fp32"; default bf16 on GPUs, fp32 on CPUs.
        estimator: "analytic" (roofline, default), "profile" (time ops on this machine), or an estimator object.
        progress: callable told about each step of planning.
        pipeline: search pipeline layouts (stage cuts, sub-meshes, schedules). Default: on GPU clusters of
            more than one node, where links between nodes make pipelines pay; always when "pp" > 1 is
            pinned; never when "pp": 1 is.
        fuse_kernels: replace attention, norms and the LM-head loss by autopar's Triton ops before planning
            (`passes.fused_ops`), so the plan prices and names the fused graph. Default: on for GPU clusters,
            off on CPUs (where the kernels only run interpreted).
        compare: layouts to price next to the plan, for the report's "Your layout" section: strings like
            "tp=8,pp=4,zero=1" or constraint dicts (`autopar.compare` adds them to a plan afterwards).
        alternatives: price the layouts a user would pick by hand (DDP, ZeRO-3, the best Megatron-style
            tp x pp point, the search's runner-up) for the report's "Why this plan". Default: on, except for
            the plans `compile` makes for itself (`_traced` given).
        _traced: the TracedModel of `model` when the caller has one already (compile does); its graph is
            fused in place when fusion is on.
        _against: a plan made before (`autopar.compare`): no search, the `compare` layouts are priced next to
            it, and it is never replaced by one of them.
    """
    cluster = as_cluster(cluster)
    constraints = check_constraints(constraints)
    check_precision(precision)
    check_offload(offload)
    precision = precision or default_precision(cluster)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    module, args, kwargs, name = resolve_model(
        model, precision, example_inputs, example_kwargs, global_batch_size, seq_len
    )
    cp = check_cp(constraints, cluster, args, kwargs)
    from autopar.passes.fused_ops import default_fusion

    fuse = default_fusion(cluster.device.kind) if fuse_kernels is None else bool(fuse_kernels)
    settings = _Settings(
        name,
        cluster,
        resolve_estimator(estimator, cluster, precision),
        precision,
        budget,
        offload,
        pipeline,
        fuse,
        t0,
        say,
    )
    degrees = cp_degrees(constraints, cluster.world_size, args, kwargs) if _traced is None and _against is None else []
    jobs = Jobs(settings, module, model, args, kwargs, traced=_traced, traced_cp=cp)
    if len(degrees) > 1:
        chosen, runner_up, job = search_cp(functools.partial(_plan_at, jobs, constraints), degrees)
    else:
        chosen, runner_up, job = _plan_at(jobs, constraints, cp, against=_against)
    if alternatives is None:
        alternatives = _traced is None  # compile's own planning builds a program, never a report
    if alternatives or compare:
        from autopar.rationale import PINNED, with_rationale

        t_alt = time.perf_counter()
        chosen = with_rationale(
            chosen,
            runner_up,
            functools.partial(_price_layout, jobs),
            say=say,
            baselines=alternatives,
            compare=compare or (),
            adopt=not constraints and _against is None,
            kept=PLANNED_BEFORE if _against is not None else PINNED,
        )
        chosen = dataclasses.replace(
            chosen,
            stats=chosen.stats
            | {
                "alternatives_time_s": round(time.perf_counter() - t_alt, 3),
                "total_time_s": round(time.perf_counter() - t0, 3),
            },
        )
    config = getattr(module, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    stats = chosen.stats | ({"hidden_size": int(hidden)} if isinstance(hidden, int) else {})
    stats["total_time_s"] = round(time.perf_counter() - t0, 3)  # a searched plan may have been priced first
    return dataclasses.replace(chosen, stats=stats, assumptions=assumptions(settings.est, cluster, budget))


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """What every cp degree a `plan` call prices shares: the model's name, the cluster and the planning knobs."""

    name: str
    cluster: ClusterSpec
    est: object
    precision: str
    budget: float | None
    offload: bool | None
    pipeline: bool | None
    fuse: bool
    t0: float
    say: Callable[[str], None]


class Jobs:
    """The jobs of one `plan` call, one per cp degree (1: none), each traced the first time a degree is priced: by
    the cp search, and again by the layouts priced next to the plan (a user's "tp=2,cp=4", the hand layouts
    without cp), so that each layout is solved on the graph its degree runs."""

    def __init__(self, st: _Settings, module, model, args, kwargs, *, traced=None, traced_cp: int = 1):
        self.st, self.module, self.model, self.args, self.kwargs = st, module, model, args, kwargs
        self._traced = {traced_cp: traced} if traced is not None else {}
        self._jobs: dict[int, Job] = {}

    def __call__(self, cp: int) -> Job:
        if cp not in self._jobs:
            self._jobs[cp] = self._trace(cp)
        return self._jobs[cp]

    def _trace(self, cp: int) -> Job:
        from autopar.passes.fused_ops import fuse_traced, fusion_report, fusion_summary

        st, module, args, kwargs = self.st, self.module, self.args, self.kwargs
        if cp > 1:  # traced on the cp ranks' shares stacked on the batch (`context_parallel.inputs`)
            args, kwargs = cp_traced_batch(module, args, kwargs, cp)
        t_start = time.perf_counter()
        st.say(f"tracing {st.name}" + (f" for cp={cp}" if cp > 1 else ""))
        traced, graph = self._traced.get(cp), None
        if traced is None and isinstance(self.model, str):
            graph = trace_shortened(module, args, kwargs, st.say, st.fuse, cp)
        if graph is None:
            traced = traced if traced is not None else trace_in_format(module, args, kwargs, st.precision, cp)
            traced = fuse_traced(traced) if st.fuse else traced
            frozen = frozenset(n for n, p in module.named_parameters() if not p.requires_grad)
            graph = OpGraph.from_traced(traced, frozen_params=frozen)
        t_trace = time.perf_counter() - t_start
        fusion = fusion_summary(st.fuse, fusion_report(graph.traced), graph.layer_count)
        st.say(
            f"traced {len(graph.graph.nodes)} nodes, {graph.num_layers} layers ({graph.deduplicated_layers} "
            f"deduplicated)"
        )
        return Job(
            graph,
            st.name,
            st.cluster,
            st.est,
            st.precision,
            st.budget,
            st.offload,
            st.pipeline,
            batch_size(args, kwargs),
            args,
            kwargs,
            fusion,
            st.t0,
            t_trace,
            st.say,
            cp=cp,
        )


def _plan_at(jobs: Jobs, constraints: dict, cp: int, *, against: Plan | None = None):
    """(plan, runner-up, job) of the model traced for cp degree `cp` (1: none) and solved under `constraints`;
    with `against` (a plan made before, `autopar.compare`), that plan and no search."""
    job = jobs(cp)
    if against is not None:
        return against, None, job
    chosen, runner_up = _solve(job, constraints | ({"cp": cp} if cp > 1 else {}))
    return chosen, runner_up, job


def _price_layout(jobs: Jobs, pins: dict) -> Plan:
    """A layout priced next to the plan (`rationale.with_rationale`): solved on the job of its cp degree, none
    where it pins none (the hand layouts are without cp); a cp it cannot run is the autopar error that says why."""
    st = jobs.st
    cp = check_cp(pins, st.cluster, jobs.args, jobs.kwargs)
    return _solve(jobs(cp), pins | ({"cp": cp} if cp > 1 else {}), quiet=True)[0]


# why a layout `compare` prices faster than the plan did not replace it (`rationale.loss_reason`)
PLANNED_BEFORE = "which was planned before this layout was priced"


def _solve(job: Job, constraints: dict, *, quiet: bool = False):
    """The fastest plan under `constraints`, and the search's runner-up: a Plan, constraints to price, or None.

    `quiet` (pricing alternatives) keeps the warnings about ignored settings to the user's own plan.
    """
    from autopar.passes.sharding_solver import solve_sharding

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
        from autopar.passes.pipeline_search import search_pipeline

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
            offload=job.offload,
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
        try:
            without = _solve(job, constraints | {"overlap": False}, quiet=True)
        except InfeasiblePlanError:
            without = None
        if without is not None and without[0].predicted.step_time_s < chosen.predicted.step_time_s:
            return without
    return chosen, sharded_runner_up(sol)


def _prefetch_depth(constraints: dict) -> int:
    """The plan's prefetch depth: the pinned one, else 1 (0 where overlap is off: gathers stay on demand)."""
    depth = constraints.get("prefetch_depth")
    if depth is None:
        return 1 if constraints.get("overlap", True) else 0
    return int(depth)


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


def compile(
    model: torch.nn.Module,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    optimizer=None,
    plan: Plan | None = None,
    pretrained=None,
    **plan_kwargs,
):
    """Plan (unless `plan` is given) and build the parallel program; call inside torchrun.

    Every rank must call it with the same model (same initial parameters) and inputs. The world
    size of the process group must equal the cluster's. The model is traced once for planning (at the
    global batch) and at most once more, at the shape the program runs (`Program.trace_parts`), both in the
    plan's compute format. Without a cp pin, where the sequence allows a cp axis (`cp_search.cp_degrees`),
    the cp degree is searched as `plan` searches it: one planning trace per degree priced.

    Args:
        model: the single-device model with real parameters on the CPU.
        cluster: ClusterSpec or string; its world size must match the launch.
        example_inputs, example_kwargs: one global batch, as `train_step` will get it.
        optimizer: callable(params) -> torch.optim.Optimizer over the local shards (default AdamW, lr 1e-3).
        plan: a plan from `autopar.plan` / `Plan.from_json` to use instead of planning.
        pretrained: a folder of Hugging Face safetensors weights to start from; each rank reads only its slices
            (`Program.load_pretrained`). The model may then be built on the meta device: its buffers get values
            first (`autopar.checkpoint.hf.materialize_buffers`), its parameters are made by the program.
        plan_kwargs: passed to `autopar.plan` (constraints=, memory_budget=, ...).
    """
    from autopar import runtime

    cluster = as_cluster(cluster)
    check_compile_inputs(model, optimizer)
    if plan is not None:
        check_given_plan(plan, cluster, model)
    runtime.ensure_process_group(cluster)
    built = model  # what the program is built from; `model` is what is planned and traced
    if pretrained is not None:
        hf.materialize_buffers(model, pretrained)  # before tracing: lifted constants take the buffers' values
        if hf.is_meta(model):
            model = hf.traceable_stand_in(model)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    planning_trace = None
    if plan is None:
        precision = plan_kwargs.get("precision") or default_precision(cluster)
        constraints = dict(plan_kwargs.get("constraints") or {})
        cp = check_cp(constraints, cluster, args, kwargs)
        if len(cp_degrees(constraints, cluster.world_size, args, kwargs)) > 1:
            # the cp degree is searched as `plan` searches it (one trace per degree); the program traces its own
            plan = _plan(model, cluster, args, kwargs, **({"alternatives": False} | plan_kwargs))
        else:
            planning_trace = trace_in_format(
                model, *(cp_traced_batch(model, args, kwargs, cp) if cp > 1 else (args, kwargs)), precision, cp
            )
            plan = _plan(model, cluster, args, kwargs, _traced=planning_trace, **plan_kwargs)
    check_batch_of_plan(plan, args, kwargs)
    program = runtime.program_class(plan)
    parts = program.trace_parts(plan)
    traced = None
    if parts is not None:
        part_args, part_kwargs = runtime.micro_batches(args, kwargs, plan.global_batch_size, parts)[0]
        traced = (
            planning_trace
            if parts == 1 and planning_trace is not None
            else program_trace(model, plan, part_args, part_kwargs)
        )
        plan = _complete_placements(plan, model, cluster, traced, part_args, part_kwargs)
    if pretrained is None:
        pm = program(model, plan, traced, cluster, optimizer=optimizer)
        pm.expect_inputs(args, kwargs)
        return pm
    if plan.program == "offload" and hf.is_meta(built):  # it copies the whole model: give it parameters to copy
        built = copy.deepcopy(built)
        hf.materialize_parameters(built)
    pm = program(built, plan, traced, cluster, optimizer=optimizer)
    pm.expect_inputs(args, kwargs)
    pm.load_pretrained(pretrained)
    return pm


def _complete_placements(plan: Plan, model, cluster: ClusterSpec, traced, args, kwargs) -> Plan:
    """The plan with per-node placements for `traced`, the graph its program runs.

    The data-parallel and offload programs need none. A sharded plan names the nodes of the graph it was
    planned on; where the program's graph (traced at one micro-batch) has other nodes (a batch of one drops
    some expands), the placements are solved again on it with the plan's mesh, ZeRO stage and memory pinned:
    the same program, so the same predictions. A pipeline plan carries its stages' placements
    (`plan.stage_plans`); only where the graph's nodes differ (or a plan file predates them) are they solved
    again on one stage's (dp, tp) block for the micro-batch graph.
    """
    from autopar.plan import ProgramKind

    if plan.program not in (ProgramKind.SHARDED, ProgramKind.PIPELINE):
        return plan
    fused = bool(plan.fusion.get("enabled", False))
    names = {n.name for n in traced.exported.graph.nodes}
    stages = plan.stage_plans
    if stages and all(st.node_output and all(n in names for n in st.node_output) for st in stages):
        return plan  # the pipeline runs the placements its stages were priced with
    if plan.node_output and all(n in names for n in plan.node_output):
        return plan
    dp, tp = plan.mesh["dp"], plan.mesh["tp"]
    # the layout the plan priced: its axes, ZeRO stage, recompute and where every parameter sits on the tensor axis
    pins = {
        "dp": dp,
        "tp": tp,
        "zero": plan.zero_stage,
        "num_microbatches": 1,
        "recompute": plan.recompute,
        "param_placements": dict(plan.param_placements),
        "grad_reduce": plan.grad_reduce,
        "overlap": plan.overlap,
        "prefetch_depth": plan.prefetch_depth,
    }
    if plan.tensor_split:
        pins["tp_min_split"] = plan.tensor_split["min_fraction"]
    if plan.mesh.get("cp", 1) > 1:
        pins |= {"cp": plan.mesh["cp"], "cp_attention": plan.context_parallel["algorithm"]}
    if plan.program == ProgramKind.PIPELINE:
        block = cluster.sub_cluster(dp * plan.mesh.get("cp", 1) * tp)  # one stage's devices
        micro = _plan(
            model,
            block,
            args,
            kwargs,
            _traced=traced,
            constraints=pins | {"pp": 1},
            memory_budget=float("inf"),
            precision=plan.precision,
            offload=False,
            fuse_kernels=fused,
        )
    else:
        try:
            micro = _plan(
                model,
                cluster,
                args,
                kwargs,
                _traced=traced,
                constraints=pins,
                memory_budget=plan.predicted.peak_memory_bytes * 1.01,
                precision=plan.precision,
                fuse_kernels=fused,
            )
        except InfeasiblePlanError:
            micro = _plan(
                model,
                cluster,
                args,
                kwargs,
                _traced=traced,
                constraints=pins,
                precision=plan.precision,
                memory_budget=float("inf"),
                fuse_kernels=fused,
            )
    return dataclasses.replace(
        plan,
        node_output=micro.node_output,
        node_inputs=micro.node_inputs,
        node_strategy=micro.node_strategy,
        param_placements=micro.param_placements,
    )


_plan = plan  # `compile` and `compare` take a `plan=` argument that hides the function


def compare(plan: Plan, layouts, model=None, example_inputs=(), example_kwargs=None, **plan_kwargs) -> Plan:
    """`plan` with `layouts` priced next to it under the same cost model (the report's "Your layout").

    Args:
        plan: a plan from `autopar.plan` or `Plan.from_json`.
        layouts: strings like "tp=8,pp=4,zero=1" or constraint dicts; one that cannot run is listed
            with the reason, never dropped.
        model: the model the plan is for; default its preset name (`plan.model_name`). A plan of an
            nn.Module needs the module and `example_inputs` / `example_kwargs` (one global batch).
        plan_kwargs: other `autopar.plan` settings (estimator=, offload=, pipeline=) when the plan used some.
    """
    if isinstance(layouts, (str, dict)):
        layouts = [layouts]
    kw = {
        "precision": plan.precision,
        "fuse_kernels": bool(plan.fusion.get("enabled", False)),
        "memory_budget": plan.assumptions.get("memory_budget_bytes"),
    } | plan_kwargs
    if model is None or isinstance(model, str):
        kw |= {"global_batch_size": plan.global_batch_size, "seq_len": plan.tokens_per_step // plan.global_batch_size}
    # priced next to `plan` itself, so that each layout's one line says how it compares with this plan
    priced = _plan(
        model if model is not None else plan.model_name,
        plan.cluster,
        example_inputs,
        example_kwargs,
        alternatives=False,
        compare=list(layouts),
        _against=plan,
        **kw,
    )
    return dataclasses.replace(plan, comparisons=tuple(plan.comparisons) + tuple(priced.comparisons))


__all__ = ["plan", "compile", "compare", "parse_bytes"]

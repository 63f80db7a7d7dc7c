"""The public entry points: `plan` (price and choose a layout) and `compile` (build the parallel program)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from autopar.checkpoint import hf
from autopar.cluster import ClusterSpec, parse_bytes
from autopar.cp_search import cp_degrees
from autopar.errors import InfeasiblePlanError
from autopar.input_validation import (
    as_cluster,
    check_batch_of_plan,
    check_compile_inputs,
    check_cp,
    check_given_plan,
    default_precision,
    read_plan_request,
)
from autopar.plan import Plan, ProgramKind
from autopar.planning import plan_model
from autopar.tracing import cp_traced_batch, program_trace, trace_in_format


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
            the plans `compile` makes for itself and those of a trace handed in (`_traced`).
        _traced: the TracedModel of `model` when the caller has one already (tests and benchmarks that plan one
            trace under many settings); its graph is fused in place when fusion is on.
    """
    request = read_plan_request(
        model,
        cluster,
        example_inputs,
        example_kwargs,
        global_batch_size=global_batch_size,
        seq_len=seq_len,
        constraints=constraints,
        memory_budget=memory_budget,
        offload=offload,
        precision=precision,
        estimator=estimator,
        progress=progress,
        pipeline=pipeline,
        fuse_kernels=fuse_kernels,
        compare=compare,
        alternatives=alternatives,
    )
    return plan_model(request, traced=_traced)


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
    request = read_plan_request(
        model if model is not None else plan.model_name,
        plan.cluster,
        example_inputs,
        example_kwargs,
        alternatives=False,
        compare=list(layouts),
        **kw,
    )
    priced = plan_model(request, against=plan)
    return dataclasses.replace(plan, comparisons=tuple(plan.comparisons) + tuple(priced.comparisons))


__all__ = ["plan", "compile", "compare", "parse_bytes"]

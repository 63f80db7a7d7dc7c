"""The public verbs: `plan` (price every layout of a model on a cluster and choose one), `compile` (plan, unless
given a plan, and build the parallel program) and `compare` (price a user's layouts next to a plan).

Each reads its arguments through `input_validation` and hands the work behind it to a module of its own:
`planning` (the search over cp degrees, pipelines and meshes, and the placements of a program's graph),
`tracing` (the traces taken), `plan_build` (Plans from the solvers' solutions), `flops` (a step's FLOPs) and
`runtime` (the programs `compile` builds).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from autopar.checkpoint import hf
from autopar.constraints import Constraints
from autopar.input_validation import (
    as_cluster,
    check_batch_of_plan,
    check_compile_inputs,
    check_given_plan,
    read_plan_request,
)
from autopar.passes.fused_ops import fusion_setting
from autopar.plan import Plan
from autopar.planning import plan_model, plan_to_compile, solve_placements
from autopar.time_limit import limited
from autopar.tracing import length_tracer, program_trace


def plan(
    model,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    constraints: dict | Constraints | None = None,
    memory_budget=None,
    offload: bool | None = None,
    precision: str | None = None,
    estimator=None,
    progress: Callable[[str], None] | None = None,
    pipeline: bool | None = None,
    fuse_kernels=None,
    compare=(),
    alternatives: bool | None = None,
    max_grad_norm: float | None = None,
    time_limit_s: float | None = None,
    _traced=None,
) -> Plan:
    """Trace `model`, price every layout on `cluster`, and return the fastest plan that fits.

    Args:
        model: an nn.Module (real, fake or meta parameters), a preset name ("llama2-70b") or a config.json path.
        cluster: a ClusterSpec or its string form ("4x8xA100-80GB", "cpu:4").
        example_inputs, example_kwargs: one global batch for a module (shapes matter, values do not).
        global_batch_size, seq_len: the batch for a preset.
        constraints: pins, a dict such as {"tp": 2, "zero": 1} or an `autopar.Constraints`: each field of
            `autopar.constraints.Constraints` is a key (axis sizes, the ZeRO stage, micro-batches, recompute, the
            pipeline's stages and schedule, cp, overlap...); what is left out, the planner decides.
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
            off on CPUs (where the kernels only run interpreted). Some of "attention", "norms" and
            "cross_entropy" (a name or a collection) fuse those kinds only and leave the rest as eager ops.
        compare: layouts to price next to the plan, for the report's "Your layout" section: strings like
            "tp=8,pp=4,zero=1" or constraint dicts (`autopar.compare` adds them to a plan afterwards).
        alternatives: price the layouts a user would pick by hand (DDP, ZeRO-3, the best Megatron-style
            tp x pp point, the search's runner-up) for the report's "Why this plan". Default: on, except for
            the plans `compile` makes for itself and those of a trace handed in (`_traced`).
        max_grad_norm: the global gradient norm the program will clip to (`compile`'s, which a plan given to it
            brings): priced as its passes over the gradients (`autopar.cost_model.step_guard`).
        time_limit_s: seconds planning may take: past them the searches try no more candidates and the best plan
            found so far comes back (each search solves one at least), with `plan.stats["time_limit"]` saying
            whether the search was cut short and what it did not try (`autopar.time_limit`). Default: none.
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
        max_grad_norm=max_grad_norm,
    )
    with limited(time_limit_s) as limit:
        chosen = plan_model(request, traced=_traced)
    return _with_limit_record(chosen, limit)


def compile(
    model: torch.nn.Module,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    optimizer=None,
    plan: Plan | None = None,
    pretrained=None,
    compile_mode: str | None = None,
    **plan_kwargs,
):
    """Plan (unless `plan` is given) and build the parallel program; call inside torchrun.

    Every rank must call it with the same model (same initial parameters) and inputs. The world
    size of the process group must equal the cluster's. Rank 0 plans; the other ranks wait for its plan
    (`AUTOPAR_PLAN_WAIT_S`, an hour by default) and every rank runs that plan. The model is traced once for planning (at the
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
        compile_mode: hand the graphs the program runs to `torch.compile` in this mode ("default",
            "reduce-overhead", "max-autotune", ...); None runs them as they are. The offload program, which runs
            the model eagerly, refuses it.
        plan_kwargs: passed to `autopar.plan` (constraints=, memory_budget=, max_grad_norm=, time_limit_s=, ...), but for the
            training loop's options (`autopar.loop`): on_nonfinite=, local_batch=, loss_fn=, loss_reduction=,
            loss_inputs=, loss_tokens=.
    """
    from autopar import runtime  # torch.distributed programs and Triton: imported when a program is built
    from autopar.loop import LoopOptions  # it reads the runtime's loss and data helpers
    from autopar.runtime.shared_plan import plan_on_rank_zero

    time_limit_s = plan_kwargs.pop("time_limit_s", None)
    loop = LoopOptions.take(plan_kwargs, model)
    cluster = as_cluster(cluster)
    check_compile_inputs(model, optimizer)
    if plan is not None:
        check_given_plan(plan, cluster, model)
    runtime.ensure_process_group(cluster)
    model, example_kwargs = loop.traced(model, dict(example_kwargs or {}))
    built = model  # what the program is built from; `model` is what is planned and traced
    if pretrained is not None:
        hf.materialize_buffers(model, pretrained)  # before tracing: lifted constants take the buffers' values
        if hf.is_meta(model):
            model = hf.traceable_stand_in(model)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    planning_trace = None
    if plan is None:  # rank 0 plans; every rank runs its plan (`runtime.shared_plan`)
        request = read_plan_request(model, cluster, args, kwargs, **({"alternatives": False} | plan_kwargs))
        plan, planning_trace = plan_on_rank_zero(lambda: _limited_plan(request, time_limit_s))
    check_batch_of_plan(plan, args, kwargs)
    program = runtime.program_class(plan)
    parts = program.trace_parts(plan)
    traced = None
    if parts is not None:  # the program runs a graph: the planning trace where it has the program's shape
        part_args, part_kwargs = runtime.micro_batches(args, kwargs, plan.global_batch_size, parts)[0]
        # the planning trace holds the global batch (with cp, every cp rank's share stacked): the program's shape
        # only without cp and with one part
        reuse = parts == 1 and plan.mesh.get("cp", 1) == 1 and planning_trace is not None
        traced = planning_trace if reuse else program_trace(model, plan, part_args, part_kwargs)
        plan = solve_placements(plan, model, cluster, traced, part_args, part_kwargs)
    if pretrained is not None and plan.program == "offload" and hf.is_meta(built):
        built = copy.deepcopy(built)  # the offload program copies the whole model: give it parameters to copy
        hf.materialize_parameters(built)
    pm = program(built, plan, traced, cluster, optimizer=optimizer)
    pm.expect_inputs(args, kwargs, tracer=length_tracer(model, plan, traced))
    loop.apply(pm, plan)
    if pretrained is not None:
        pm.load_pretrained(pretrained)
    if compile_mode is not None:
        pm.compile_graphs(compile_mode)
    return pm


def _limited_plan(request, time_limit_s: float | None):
    """`plan_to_compile` under `plan`'s time limit: one rank plans, so a limit cannot part the ranks' plans."""
    with limited(time_limit_s) as limit:
        chosen, traced = plan_to_compile(request)
    return _with_limit_record(chosen, limit), traced


def _with_limit_record(chosen: Plan, limit) -> Plan:
    """`chosen` with what its time limit cut short in `stats["time_limit"]` (as it is without a limit)."""
    if limit is None:
        return chosen
    return dataclasses.replace(chosen, stats=chosen.stats | {"time_limit": limit.record()})


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
        "fuse_kernels": fusion_setting(plan.fusion),
        "memory_budget": plan.assumptions.get("memory_budget_bytes"),
        "max_grad_norm": plan.max_grad_norm,
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


__all__ = ["plan", "compile", "compare"]

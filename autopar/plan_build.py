"""Plans from solutions: the Plan of a layout the sharding solver or the pipeline search chose, with what it
predicts (step time, FLOP/s, MFU, memory), where its time goes (`rationale`'s terms), the layouts it was
chosen over, and what planning cost.

A `Job` is what one planning call solves on: the traced graph and the settings every layout it prices shares.
A solution's figures are per device and for the data axis it priced (dp·cp ranks with a cp axis, each holding
cp rows per sequence); a plan gives dp and cp apart and its batch in whole sequences.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.step_guard import estimate_step_guard_time_s
from autopar.flops import step_flops
from autopar.input_validation import count_tokens
from autopar.ir import OpGraph
from autopar.passes.sharding.precision import Precision
from autopar.plan import Plan, Predicted
from autopar.rationale import hidden_terms, pipeline_terms, sharded_terms


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """What one `plan` call solves on: the traced graph and the settings every layout it prices shares."""

    graph: OpGraph
    name: str
    cluster: ClusterSpec
    est: object
    precision: str
    budget: float | None
    offload: bool | None
    pipeline: bool | None
    batch: int
    args: tuple
    kwargs: dict
    fusion: dict
    t0: float
    t_trace: float
    say: Callable[[str], None]
    # the pipeline search's stage programs, kept for the layouts priced after the search (`search_pipeline`'s
    # `pricers`): a layout the search priced is read back, not solved again
    pricers: dict = dataclasses.field(default_factory=dict)
    cp: int = 1  # the pinned cp degree: `batch` counts cp rows per sequence, the data axis dp·cp ranks
    clip: bool = False  # the step guard clips (`cost_model.step_guard`)


def expand_placements(graph: OpGraph, placements: dict) -> dict:
    """Parameter placements under every name of the model (a shortened trace names its first layers only)."""
    layer = {p.name: p.layer for p in graph.params.values()}
    out = {}
    for fqn, pl in placements.items():
        for name in graph.expand_param_name(fqn, layer.get(fqn, (None, None))):
            out[name] = pl
    return out


def sharded_runner_up(sol) -> dict | None:
    """The mesh that came closest to the chosen one (solved, or its bound when it could not win), as pins."""
    others = [r for r in sol.candidates if (r.dp, r.tp) != (sol.dp, sol.tp) and r.step_time_s < float("inf")]
    if not others:
        return None
    r = min(others, key=lambda r: (not r.feasible, r.step_time_s))
    cp = sol.cp.get("degree", 1)
    return {"pp": 1, "dp": r.dp // cp, "tp": r.tp} | ({"cp": cp} if cp > 1 else {})


def pipeline_runner_up(job: Job, psol, chosen: Plan):
    """The next fastest layout the pipeline search priced exactly (as pins), else the best plan without one."""
    layout = (
        chosen.mesh["pp"],
        chosen.mesh["dp"],
        chosen.mesh["tp"],
        chosen.num_microbatches,
        chosen.pipeline["schedule"],
        chosen.pipeline.get("virtual_stages", 1),
    )
    priced = [
        c
        for c in (_per_dp(c, job.cp) for c in psol.candidates)
        if c["step_time_s"] is not None
        and (c["pp"], c["dp"], c["tp"], c["num_microbatches"], c["schedule"], c["virtual_stages"]) != layout
    ]
    if priced:
        c = min(priced, key=lambda c: c["step_time_s"])
        return {
            "pp": c["pp"],
            "dp": c["dp"],
            "tp": c["tp"],
            "num_microbatches": c["num_microbatches"],
            "schedule": c["schedule"],
            "virtual_stages": c["virtual_stages"],
        } | ({"cp": job.cp} if job.cp > 1 else {})
    if psol.single_stage is not None:
        return sharded_plan(job, psol.single_stage)
    return None


def sharded_plan(job: Job, sol) -> Plan:
    """The Plan of a layout without a pipeline (mesh dp x tp), from the sharding solver's solution."""
    graph, cluster, precision = job.graph, job.cluster, job.precision
    tokens = count_tokens(job.args, job.kwargs)
    cp = job.cp
    model_flops, hw_flops = step_flops(graph, tokens, sol.recompute, sol.layer_modes, cp=cp)
    peak = cluster.device.peak_matmul_flops(_dtype_of(precision))
    world = cluster.world_size
    guard = step_guard_s(cluster, sol.memory, precision, job.clip)
    step = sol.step_time_s + guard
    offload_s = sol.offload.get("time_s", 0.0) + sol.activation_offload.get("time_s", 0.0)
    predicted = _predicted(
        step,
        model_flops,
        hw_flops,
        tokens,
        world,
        peak,
        sol.memory,
        compute_s=sol.compute_s,
        reshard_s=sol.reshard_s,
        grad_sync_s=sol.grad_sync_s,
        grad_sync_hidden_s=sol.grad_sync_hidden_s,
        offload_s=offload_s,
        optimizer_s=sol.optimizer_s + guard,
    )
    alternatives = tuple(
        {
            "dp": r.dp // cp,
            **({"cp": cp} if cp > 1 else {}),
            "tp": r.tp,
            "num_microbatches": r.num_microbatches,
            "feasible": r.feasible,
            # with the step guard, as the plan's own step time (`step_guard_s`)
            "step_time_s": r.step_time_s + step_guard_s(cluster, r.memory, precision, job.clip) if r.feasible else None,
            "compute_s": r.compute_s,
            "reshard_s": r.reshard_s,
            "grad_sync_s": r.grad_sync_s,
            "zero_stage": r.zero_stage,
            "recompute": r.recompute,
            "layer_modes": dict(r.layer_modes),
            "memory": r.memory,
            "solve_time_s": r.solve_time_s,
            "offload_fraction": r.offload.get("optimizer_fraction", 0.0),
            "reason": r.reason,
        }
        for r in sol.candidates
    )
    stats = _stats(graph, job.est, job.t0, job.t_trace, sol.solve_time_s, decision_groups=sol.num_groups)
    terms = sharded_terms(
        step_s=step,
        compute_s=sol.compute_s,
        recompute_s=sol.recompute_s,
        reshard_s=sol.reshard_s,
        grad_sync_s=sol.grad_sync_s,
        offload_s=offload_s,
        optimizer_s=sol.optimizer_s + guard,
        cp_comm_s=sol.cp_comm_s,
    )
    return Plan(
        model_name=job.name,
        cluster=cluster,
        mesh={"dp": sol.dp // cp, "cp": cp, "tp": sol.tp} if cp > 1 else {"dp": sol.dp, "tp": sol.tp},
        context_parallel=dict(sol.cp),
        zero_stage=sol.zero_stage,
        num_microbatches=sol.num_microbatches,
        recompute=sol.recompute,
        offload=dict(sol.offload),
        layer_modes=dict(sol.layer_modes),
        activation_offload=dict(sol.activation_offload),
        tensor_split=dict(sol.tensor_split),
        layer_ops=tuple(dict(e, stages=[]) for e in sol.layer_ops),
        precision=precision,
        global_batch_size=job.batch // cp,
        tokens_per_step=tokens,
        num_parameters=graph.num_parameters(),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        predicted=predicted,
        param_placements=expand_placements(graph, sol.param_placements),
        node_output=sol.node_output,
        node_inputs=sol.node_inputs,
        node_strategy=sol.node_strategy,
        alternatives=alternatives,
        unruled_ops=sol.unruled_ops,
        stats=stats,
        fusion=job.fusion,
        time_breakdown=terms,
        hidden_communication=hidden_terms(
            grad_sync_hidden_s=sol.grad_sync_hidden_s,
            cp_hidden_s=sol.cp_comm_hidden_s,
            tp_hidden_s=sol.reshard_hidden_s,
        ),
    )


def step_guard_s(cluster: ClusterSpec, memory: dict, precision: str, clip: bool) -> float:
    """The step guard's passes over a device's gradients and its all-reduce (`cost_model.step_guard`), added to every
    layout a plan prices, so the plan, its baselines and comparisons carry it alike. The gradients it reads are those
    of the masters the device's optimizer steps (fp32, one per element of its optimizer states on the device; not
    the whole gradients ZeRO-1 holds in the backward)."""
    masters = memory.get("optimizer", 0.0) / Precision.get(precision).optimizer_bytes
    return estimate_step_guard_time_s(cluster, 4.0 * masters, clip=clip)


def assumptions(est, cluster: ClusterSpec, budget: float | None) -> dict:
    """What the predictions rest on besides the cluster's figures: the estimator (and its profile) and the budget."""
    out = {
        "estimator": "analytic" if type(est).__name__ == "AnalyticEstimator" else type(est).__name__,
        "memory_budget_bytes": float(budget if budget is not None else cluster.device.memory_bytes),
    }
    path = getattr(est, "cache_path", None)
    if path is not None:
        out["estimator"] = "profile"
        found = os.path.exists(path)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.path.getmtime(path))) if found else None
        out["profile"] = {
            "path": str(path),
            "device": getattr(est, "device", None),
            "written": stamp,
            "ranks_per_core": getattr(est, "ranks_per_core", 1.0),
            "in_step": list(getattr(est, "in_step", (1.0, 1.0))),
        }
    return out


def pipeline_plan(job: Job, psol) -> Plan:
    """The Plan of a pipeline layout: mesh pp x dp x tp (pp x dp x cp x tp with a cp axis: the search's data axis
    is dp·cp ranks and its batch cp rows per sequence), per-stage figures in `plan.pipeline`."""
    graph, name, cluster, precision, batch, cp = job.graph, job.name, job.cluster, job.precision, job.batch, job.cp
    args, kwargs, t0, t_trace, est = job.args, job.kwargs, job.t0, job.t_trace, job.est
    fullest = max(psol.stages, key=lambda st: sum(st.memory.values()))
    recompute = max(
        (st.sharding.recompute for st in psol.stages if st.sharding is not None),
        key=("none", "selective", "full").index,
        default="none",
    )
    tokens = count_tokens(args, kwargs)
    model_flops, hw_flops = step_flops(graph, tokens, recompute, cp=cp)
    peak = cluster.device.peak_matmul_flops(_dtype_of(precision))
    guard = max(step_guard_s(cluster, st.memory, precision, job.clip) for st in psol.stages)
    world, step = cluster.world_size, psol.step_time_s + guard
    # the step ends with the stage whose exposed sync and optimizer step take longest
    tail = max(psol.stages, key=lambda st: st.grad_sync_exposed_s + st.optimizer_s)
    sync, opt = tail.grad_sync_exposed_s, tail.optimizer_s + guard
    # compute: the pipelined forward and backward, bubble and transfers included
    predicted = _predicted(
        step,
        model_flops,
        hw_flops,
        tokens,
        world,
        peak,
        fullest.memory,
        compute_s=step - sync - opt,
        reshard_s=0.0,
        grad_sync_s=sync,
        optimizer_s=opt,
        grad_sync_hidden_s=tail.grad_sync_hidden_s,
    )
    layer = {p.name: p.layer for p in graph.params.values()}
    placements = {}
    for st in psol.stages:
        if st.sharding is None:
            continue
        for fqn, pl in st.sharding.param_placements.items():
            container, idx = layer.get(fqn, (None, None))
            if container is not None and container in graph.repeats and idx == 0:
                rest = fqn[len(f"{container}.0.") :]
                for a, b in st.layers:
                    placements.update({f"{container}.{i}.{rest}": pl for i in range(a, b)})
            elif container is None:
                placements[fqn] = pl
    stages = [
        {
            "index": st.index,
            "layers": [list(r) for r in st.layers],
            "num_layers": st.num_layers,
            "dp": st.dp // cp,
            **({"cp": cp} if cp > 1 else {}),
            "tp": st.tp,
            "zero_stage": st.zero_stage,
            "recompute": st.sharding.recompute if st.sharding is not None else "none",
            "time_per_microbatch_s": st.time_per_microbatch_s,
            "transfer_per_microbatch_s": st.transfer_per_microbatch_s,
            "grad_sync_s": st.grad_sync_s,
            "activation_copies": st.activation_copies,
            # what the stage waits for of its transfers, and what its dp sync hides behind its own last
            # backward and the later ones
            "transfer_exposed_per_microbatch_s": st.transfer_exposed_per_microbatch_s,
            "grad_sync_hidden_s": st.grad_sync_hidden_s,
            "memory_bytes": sum(st.memory.values()),
            "memory": dict(st.memory),
            # the placements the stage was priced with (its layer nodes stand for every layer of the stage)
            "node_output": dict(st.sharding.node_output) if st.sharding is not None else {},
            "node_inputs": {k: list(v) for k, v in st.sharding.node_inputs.items()} if st.sharding is not None else {},
        }
        for st in psol.stages
    ]
    info = {
        "schedule": str(psol.schedule),
        "virtual_stages": psol.virtual_stages,
        "bubble_fraction": psol.bubble_fraction,
        "micro_batch_size": psol.micro_batch_size,
        "stages": stages,
        "step_time_without_pipeline_s": psol.single_stage_step_time_s,
        "priced": [_per_dp(c, cp) for c in psol.candidates],
        # the step guard (`step_guard_s`): in the plan's step time, not in the search's figures above
        "step_guard_s": guard,
    }
    stats = _stats(graph, est, t0, t_trace, psol.solve_time_s, stage_programs=psol.num_stage_programs)
    layer_ops = _stage_layer_ops(psol.stages)
    slowest = max(psol.stages, key=lambda st: st.time_per_microbatch_s + st.transfer_exposed_per_microbatch_s)
    # the bottleneck stage's cp attention communication per micro-batch: exposed (in its t_s) and hidden
    cp_sol = slowest.sharding
    cp_s, cp_hidden = (
        (cp_sol.cp_comm_s / cp_sol.num_microbatches, cp_sol.cp_comm_hidden_s / cp_sol.num_microbatches)
        if cp_sol is not None
        else (0.0, 0.0)
    )
    # and its tensor-axis collectives launched early, hidden behind the ops before their use (per micro-batch)
    tp_hidden = cp_sol.reshard_hidden_s / cp_sol.num_microbatches if cp_sol is not None else 0.0
    terms = pipeline_terms(
        step_s=step,
        num_microbatches=psol.num_microbatches,
        stage_s=slowest.time_per_microbatch_s,
        transfer_s=slowest.transfer_exposed_per_microbatch_s,
        grad_sync_s=sync,
        optimizer_s=opt,
        cp_s=cp_s,
    )
    transfer_hidden = slowest.transfer_per_microbatch_s - slowest.transfer_exposed_per_microbatch_s
    hidden = hidden_terms(
        grad_sync_hidden_s=tail.grad_sync_hidden_s,
        transfer_hidden_s=psol.num_microbatches * transfer_hidden,
        cp_hidden_s=psol.num_microbatches * cp_hidden,
        tp_hidden_s=psol.num_microbatches * tp_hidden,
    )
    mesh = (
        {"pp": psol.pp, "dp": psol.dp // cp, "cp": cp, "tp": psol.tp}
        if cp > 1
        else {"pp": psol.pp, "dp": psol.dp, "tp": psol.tp}
    )
    # the stages price attention alike (one algorithm per sub-mesh): the first stage's record stands for all
    cp_info = dict(next(st.sharding for st in psol.stages if st.sharding is not None).cp) if cp > 1 else {}
    return Plan(
        model_name=name,
        cluster=cluster,
        mesh=mesh,
        context_parallel=cp_info,
        zero_stage=max(st.zero_stage for st in psol.stages),
        num_microbatches=psol.num_microbatches,
        recompute=recompute,
        precision=precision,
        global_batch_size=batch // cp,
        tokens_per_step=tokens,
        num_parameters=graph.num_parameters(),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        predicted=predicted,
        param_placements=placements,
        node_output={},
        node_inputs={},
        node_strategy={},
        alternatives=(),
        unruled_ops=(),
        stats=stats,
        pipeline=info,
        time_breakdown=terms,
        hidden_communication=hidden,
        layer_ops=layer_ops,
    )


def _per_dp(candidate: dict, cp: int) -> dict:
    """A configuration the pipeline search priced, its data axis (dp·cp ranks) given as dp and cp."""
    if cp == 1:
        return dict(candidate)
    return dict(candidate, dp=candidate["dp"] // cp, cp=cp)


def _stage_layer_ops(stages) -> tuple[dict, ...]:
    """The stages' layer tables (`ShardingSolution.layer_ops`), one entry per distinct table with the stages
    that run it (stages holding as many layers on the same sub-mesh share one)."""
    out: list[dict] = []
    for st in stages:
        for entry in st.sharding.layer_ops if st.sharding is not None else ():
            same = next((e for e in out if e["layer"] == entry["layer"] and e["ops"] == entry["ops"]), None)
            if same is not None:
                same["stages"].append(st.index)
            else:
                out.append(dict(entry, stages=[st.index]))
    return tuple(out)


def _predicted(
    step: float, model_flops: float, hw_flops: float, tokens: int, world: int, peak: float, memory: dict, **times
) -> Predicted:
    """Per-step figures from the step time; `peak` is one device's matrix peak, `times` the step's parts."""
    return Predicted(
        step_time_s=step,
        tflops_per_device=model_flops / step / world / 1e12 if step else 0.0,
        mfu=model_flops / (step * world * peak) if step else 0.0,
        hardware_flops_utilization=hw_flops / (step * world * peak) if step else 0.0,
        peak_memory_bytes=sum(memory.values()),
        memory_breakdown=dict(memory),
        tokens_per_s=tokens / step if step else 0.0,
        **times,
    )


def _stats(graph: OpGraph, est, t0: float, t_trace: float, solve_time_s: float, **extra) -> dict:
    """How planning went: times, solver, graph size, layers."""
    from autopar.passes.sharding.solver import solver_name  # PuLP and HiGHS: not for `autopar --help`

    return {
        "trace_time_s": round(t_trace, 3),
        "solve_time_s": round(solve_time_s, 3),
        "total_time_s": round(time.perf_counter() - t0, 3),
        "solver": solver_name(),
        "graph_nodes": len(graph.graph.nodes),
        "traced_layers": {c: k for c, (k, _) in graph.repeats.items()},
        **extra,
        "layers": graph.num_layers,
        "deduplicated_layers": graph.deduplicated_layers,
        "estimator": type(est).__name__,
    }


def _dtype_of(precision: str):
    """The format peak FLOP/s are read for: the compute format, fp32 for "fp32"."""
    from autopar.runtime.base import compute_dtype  # the runtime (and Triton): not for `autopar --help`

    return compute_dtype(precision) or torch.float32


__all__ = [
    "Job",
    "assumptions",
    "expand_placements",
    "pipeline_plan",
    "pipeline_runner_up",
    "sharded_plan",
    "sharded_runner_up",
]

"""The search over meshes: every (dp, tp) factorisation of the world size, each mesh's micro-batch counts and
recompute modes, solved cheapest bound first, and the fastest feasible layout returned (`solve_sharding`).

How the programs are solved: the step time never falls as m or recompute grows, nor as the ZeRO stage grows past 1
(for the same placements); stage 1 can beat stage 0, its optimizer step being 1/dp of it. So the program at the fewest
micro-batches that fit under the leanest allowed mode and no recompute, solved without the memory row at the lowest
stage and at the lowest stage from 1 (the faster of the two), is a lower bound L(dp, tp) of everything its mesh can
reach. Meshes are visited in order of L; a mesh whose L is not below the best plan found is not solved further; a
mesh whose memory-free optimum fits is done (recompute is never considered where memory does not bind). Otherwise
each recompute mode, none first, searches its own micro-batch counts (the fewest that fit under it first, more while
that helps), skipped when the best plan found reaches its bound L + sum_g n_g min_k sum_{m in R_r} T_fwd[m,k] (or its
own memory-free optimum at its fewest micro-batches); within a mode each stage is solved with z fixed (presolve then
removes the product rows, which HiGHS solves much faster than the joint program), stopping at a stage that reaches
the mode's bound (`ShardingProgram.solve_best`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings

from autopar import time_limit
from autopar.cluster import ClusterSpec
from autopar.cost_model.experts import ExpertSplit
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.ir import OpGraph
from autopar.passes import sharding_rules as rules
from autopar.passes.activation_plan import layer_indices, mix_layer_modes
from autopar.passes.context_parallel import CPPricing, CPSpec, check_cp_graph, price_cp_attention
from autopar.passes.recompute import RECOMPUTE_MODES, recompute_segments
from autopar.passes.sharding.graph import ANY_SPLIT, TensorSplit
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.program import ShardingProgram
from autopar.passes.sharding.report import (
    cp_report,
    exposed_fraction,
    infeasible_message,
    layer_ops_report,
    mesh_words,
    tensor_split_report,
)
from autopar.passes.sharding.solution import MeshResult, ShardingSolution
from autopar.passes.sharding_rules import placement_str


def factorizations(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, tp) with dp * tp == world_size, tp ascending."""
    return [(world_size // t, t) for t in range(1, world_size + 1) if world_size % t == 0]


def _pinned(constraints: dict, world_size: int, batch: int) -> list[tuple[int, int]]:
    meshes = factorizations(world_size)
    tp, dp = constraints.get("tp"), constraints.get("dp")
    for key, v in (("tp", tp), ("dp", dp)):
        if v is not None and (not isinstance(v, int) or v < 1 or world_size % v):
            raise ConfigError(
                f"constraints[{key!r}]={v!r} does not divide the world size {world_size}; "
                f"choose one of {[t for _, t in meshes]}"
            )
    meshes = [(d, t) for d, t in meshes if (tp is None or t == tp) and (dp is None or d == dp)]
    if not meshes:
        raise ConfigError(f"constraints tp={tp}, dp={dp} do not multiply to the world size {world_size}")
    for key in ("num_microbatches", "micro_batch_size"):
        v = constraints.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"constraints[{key!r}]={v!r}: expected a positive integer")
    ok = [(d, t) for d, t in meshes if batch % d == 0]
    if not ok:
        raise ConfigError(
            f"the global batch of {batch} does not divide over the data axis "
            f"(dp={meshes[0][0]}); use a batch size that is a multiple of it"
        )
    split = [(d, t) for d, t in ok if _microbatch_choices(batch // d, constraints)]
    if not split:
        what = {k: constraints[k] for k in ("num_microbatches", "micro_batch_size") if k in constraints}
        raise ConfigError(
            f"the global batch of {batch} does not split into {what} on any data axis size "
            f"{sorted({d for d, _ in ok})}; the samples per data-parallel rank must be a multiple "
            f"of the micro-batch size (and of the micro-batch count)"
        )
    return split


def solve_sharding(
    graph: OpGraph,
    cluster: ClusterSpec,
    *,
    estimator,
    precision: str = "fp32",
    constraints: dict | None = None,
    memory_budget_bytes: float | None = None,
    batch_size: int,
    progress=None,
    offload: bool | None = False,
    experts: ExpertSplit | None = None,
    memory_advice=None,
    beat_s: float = math.inf,
) -> ShardingSolution:
    """Solve every allowed (dp, tp) mesh and return the fastest feasible layout.

    Args:
        graph: the traced model.
        cluster: the devices and links.
        estimator: a ComputeEstimator (analytic roofline or profiled).
        precision: "bf16"/"fp16" (mixed precision AdamW) or "fp32".
        constraints: optional pins: "tp", "dp", "zero" (0-3), "num_microbatches" (gradient accumulation
            steps per data-parallel rank), "micro_batch_size" (samples per micro-batch per rank) or
            "recompute" ("none", "selective", "full"), "tp_min_split" (the fraction of the layer matmul
            weights' elements a tensor axis must split: default 1; 0 opts out).
        memory_budget_bytes: per-device cap; defaults to the device memory.
        batch_size: the global batch (dim 0 of the inputs), split over dp.
        progress: optional callable(str) told about each mesh as it is solved.
        offload: False keeps every state on the device; None lets each program put optimizer states and
            gradients on the host where memory requires it; True puts all of them there. Only meshes without
            a tensor axis (tp=1) offload: that is what the offload program runs.
        experts: expert weights split over an ep group of the data axis (the expert-parallel program): their
            states and gradient sync priced as it holds and sends them; meshes whose data axis ep does not divide
            are refused.
        memory_advice: what the error says to do when no mesh fits in memory, `advice(parts, budget)` of
            `report.infeasible_message` (None: the advice of a free layout).
        beat_s: a step only a faster layout is asked to beat: meshes and recompute modes whose lower bound reaches
            it are not solved, as if a plan that fast had been found. The answer is the search's without it wherever
            that is faster than `beat_s` (the results of the meshes not solved say so); elsewhere a layout no faster
            than `beat_s`, or the InfeasiblePlanError.
    Raises:
        InfeasiblePlanError: no mesh fits, with the memory the best layout needs.
    """
    constraints = dict(constraints or {})
    zero = _checked_zero(constraints, cluster, offload)
    budget = float(memory_budget_bytes if memory_budget_bytes is not None else cluster.device.memory_bytes)
    prec = Precision.get(precision, constraints.get("grad_reduce"))
    pins = _checked_placements(constraints)
    recompute = _pinned_recompute(graph, constraints.get("recompute"))
    cp = CPSpec.from_constraints(constraints, cluster.world_size)
    attention = check_cp_graph(graph.graph, cp) if cp.on else []
    if cp.on and constraints.get("dp") is not None:
        constraints["dp"] = constraints["dp"] * cp.degree  # the data axis: dp·cp ranks
    rules.UNRULED_OPS.clear()
    t0 = time.perf_counter()
    results, bounds, candidates = [], [], []
    for dp, tp in _pinned(constraints, cluster.world_size, batch_size):
        if dp % cp.degree:
            continue
        if candidates and time_limit.expired():  # one mesh is solved at least, so that a plan comes back
            results.append(_refused(dp, tp, "not solved: the time limit had passed"))
            time_limit.skipped(f"mesh dp={dp // cp.degree} tp={tp}")
            continue
        pricing = None
        if cp.on:
            m0 = (_microbatch_choices(batch_size // dp, constraints) or [1])[0]
            pricing = price_cp_attention(
                attention, cluster, cp, data=dp, tp=tp, num_microbatches=m0, precision=precision
            )
        if offload is True and tp > 1:
            results.append(_refused(dp, tp, "offload=True: host offload runs on meshes without a tensor axis"))
            continue
        if experts is not None and dp % experts.degree:
            results.append(_refused(dp, tp, f"ep={experts.degree} does not divide the data axis"))
            continue
        factory = functools.partial(
            _program_factory,
            graph,
            cluster,
            dp,
            tp,
            estimator=estimator,
            precision=prec,
            zero_stage=zero,
            budget=budget,
            batch_size=batch_size,
            recompute=recompute,
            offload=offload if tp == 1 else False,
            tensor_split=TensorSplit.from_constraints(constraints, tp),
            pinned_placements=pins,
            overlap=bool(constraints.get("overlap", True)),
            prefetch_depth=constraints.get("prefetch_depth"),
            experts=experts,
        )
        if tp == 1 and any(v != "R" for v in pins.values()):
            results.append(_refused(dp, tp, "param_placements splits parameters, and this mesh has no tensor axis"))
            continue
        fits, make, refusal = _first_fit(factory, pricing, dp, tp, cp.degree, batch_size, constraints, budget, bounds)
        if fits is None:
            results.append(_refused(dp, tp, refusal))
            continue
        fits.build()
        free = fits.solve_free()
        candidates.append((free, fits, make))
    best, best_prog = _solve_candidates(candidates, results, batch_size, constraints, progress, beat_s)
    if best is None:
        raise InfeasiblePlanError(infeasible_message(bounds, budget, offload, memory_advice))
    unruled = tuple(sorted(rules.UNRULED_OPS))
    if unruled and best.tp > 1:
        warnings.warn(
            f"no sharding rule for {', '.join(unruled)}: these ops run replicated on the tensor axis", stacklevel=2
        )
    return _solution(best_prog, best, tuple(results), unruled, time.perf_counter() - t0)


def _checked_zero(constraints: dict, cluster: ClusterSpec, offload: bool | None) -> int | None:
    """The pinned ZeRO stage, checked, and `offload` checked against the pins."""
    zero = constraints.get("zero")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ConfigError(f"constraints['zero']={zero!r}: expected 0, 1, 2 or 3")
    if offload is True and constraints.get("tp", 1) != 1:
        raise ConfigError(
            f"offload=True with constraints['tp']={constraints['tp']}: host offload runs on meshes "
            f"without a tensor axis; pin tp=1 or leave offload to the solver (offload=None)"
        )
    if offload is True and zero is not None and zero < 3 and cluster.world_size > 1 and constraints.get("dp", 2) > 1:
        raise ConfigError(
            f"offload=True with constraints['zero']={zero}: the offload program runs the states as "
            f"ZeRO-3 chunks over the data axis; pin zero=3 or leave the stage to the solver"
        )
    return zero


def _checked_placements(constraints: dict) -> dict:
    """The pinned parameter placements on the tensor axis (parameter name -> placement string), checked."""
    pins = constraints.get("param_placements") or {}
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise ConfigError(
            f"constraints['param_placements']={pins!r}: expected a mapping of parameter names to "
            f"placements on the tensor axis, such as {{'lm_head.weight': 'S(0)'}}"
        )
    return pins


def _refused(dp: int, tp: int, reason: str) -> MeshResult:
    """The result of a mesh that is not solved, and why."""
    return MeshResult(dp, tp, False, math.inf, 0, 0, 0, -1, {}, 0.0, reason)


def _first_fit(factory, pricing: CPPricing | None, dp, tp, cp: int, batch_size, constraints, budget, bounds):
    """(program, its factory, None) at the fewest micro-batches whose memory lower bound fits the budget, under the
    fastest cp algorithm that fits; (None, None, why) where none does. Every bound tried is added to `bounds`."""
    make = factory(cp=pricing)
    fits = None
    for alg in pricing.ranked if pricing is not None else (None,):
        if alg is not None and alg != pricing.algorithm:  # the faster ones did not fit
            faster = ", ".join(str(a) for a in pricing.ranked[: pricing.ranked.index(alg)])
            pricing = pricing.with_algorithm(
                alg,
                f"{faster}: faster, but does not fit the memory budget on dp={dp // cp} cp={cp} tp={tp}",
            )
            make = factory(cp=pricing)
        for m in _microbatch_choices(batch_size // dp, constraints):
            prog = make(m)
            if prog.cannot_split():
                break
            bound = prog.memory_lower_bound()
            bounds.append((sum(bound.values()), mesh_words(dp, tp, cp), m, bound, prog.leanest_recompute()))
            if sum(bound.values()) <= budget:
                fits = prog
                break
        if fits is not None or prog.cannot_split():
            break
    if fits is None and prog.cannot_split():
        return (
            None,
            None,
            f"the tensor axis would split no matmul weight (none has a dimension divisible "
            f"by tp={tp}): that is data parallelism, which dp={dp * tp} runs",
        )
    if fits is None:
        return None, None, "does not fit even with micro-batches of one sample"
    return fits, make, None


def _solve_candidates(
    candidates: list, results: list, batch_size: int, constraints: dict, progress, beat_s: float = math.inf
):
    """(best result, its program) over the meshes that fit, each (memory-free optimum, program, factory), in the
    order of their memory-free optimum (a lower bound of anything they can reach): once the best plan found (or
    `beat_s`, a step found elsewhere) is faster than a mesh's bound, that mesh cannot win and is not solved. Every
    mesh's result is added to `results`."""
    candidates.sort(key=lambda c: c[0].step_time_s)
    best, best_prog = None, None
    for free, prog, make in candidates:
        if best is not None and time_limit.expired() and free.step_time_s < best.step_time_s:
            results.append(dataclasses.replace(free, feasible=False, reason="not solved: the time limit had passed"))
            time_limit.skipped(f"mesh dp={free.dp} tp={free.tp} (at least {free.step_time_s * 1e3:.2f} ms)")
            continue
        bar = min(beat_s, best.step_time_s if best is not None else math.inf)  # what a mesh must beat
        if free.step_time_s >= bar:
            results.append(
                dataclasses.replace(
                    free,
                    feasible=False,
                    reason=f"cannot beat the chosen plan: at least "
                    f"{free.step_time_s * 1e3:.2f} ms even without a memory limit",
                )
            )
            continue
        res, res_prog = _solve_mesh(
            free,
            prog,
            make,
            batch_size,
            constraints,
            progress,
            beat_s=bar,
        )
        results.append(res)
        if res.feasible and (best is None or res.step_time_s < best.step_time_s):
            best, best_prog = res, res_prog
    return best, best_prog


def _pinned_recompute(graph: OpGraph, pinned) -> str | None:
    """The pinned recompute mode, checked; a mode with nothing to recompute in this graph warns and is "none"."""
    if pinned is None:
        return None
    if pinned not in RECOMPUTE_MODES:
        raise ConfigError(f"constraints['recompute']={pinned!r}: expected one of {', '.join(RECOMPUTE_MODES)}")
    if pinned != "none" and not recompute_segments(graph.graph, pinned):
        warnings.warn(
            f"recompute={pinned!r}: the model has no repeated layers (attention blocks) to recompute; "
            f"planning without recompute",
            stacklevel=3,
        )
        return "none"
    return pinned


def _program_factory(
    graph,
    cluster,
    dp,
    tp,
    *,
    estimator,
    precision,
    zero_stage,
    budget,
    batch_size,
    recompute=None,
    offload=False,
    tensor_split: TensorSplit = ANY_SPLIT,
    pinned_placements=None,
    overlap: bool = True,
    cp: CPPricing | None = None,
    prefetch_depth: int | None = None,
    experts: ExpertSplit | None = None,
):
    def make(m: int) -> ShardingProgram:
        return ShardingProgram(
            graph,
            cluster,
            dp,
            tp,
            estimator=estimator,
            precision=precision,
            zero_stage=zero_stage,
            memory_budget_bytes=budget,
            batch_dim_size=batch_size,
            num_microbatches=m,
            recompute=recompute,
            offload=offload,
            tensor_split=tensor_split,
            pinned_placements=pinned_placements,
            overlap=overlap,
            cp=cp,
            prefetch_depth=prefetch_depth,
            experts=experts,
        )

    return make


def _solve_mesh(
    free: MeshResult,
    prog: ShardingProgram,
    make,
    batch_size: int,
    constraints: dict,
    progress,
    beat_s: float = math.inf,
):
    """The best layout of one mesh: per recompute mode, fewest micro-batches that fit first, more while that helps.

    `free` is the memory-free optimum at the fewest micro-batches without recompute: when it fits,
    nothing on this mesh is faster (more micro-batches, higher ZeRO stages and recompute never cost
    less), so it is the answer. Otherwise the modes are searched cheapest first, each over its own
    micro-batch counts (more micro-batches can make recompute unnecessary, so the step time is not
    monotone across modes); a mode whose time bound (`free` plus its least recompute time) the best
    plan found already reaches, on this mesh or `beat_s` on another, is skipped. Where a mode needs
    more micro-batches than `free` has, its own memory-free optimum there tightens its bound first.
    """
    say = progress or (lambda msg: None)
    if free.feasible and sum(free.memory.values()) <= prog.budget:
        say(f"mesh dp={prog.dp} tp={prog.tp} micro-batches={prog.mb}: {free.step_time_s * 1e3:.2f} ms")
        return free, prog  # prog.last_choice holds the memory-free solution
    programs = {prog.mb: prog}
    counts = [c for c in _microbatch_choices(batch_size // prog.dp, constraints) if c >= prog.mb]
    best, last = None, None  # best: (result, program, choice)
    lower = free.step_time_s
    for mode in prog.recompute_choices:
        bound = lower + (prog.recompute_time_lower_bound(mode) if mode != "none" else 0.0)
        target = min(beat_s, best[0].step_time_s if best is not None else math.inf)
        if target <= bound * (1 + 1e-9):
            continue
        mode_best = None
        for m in counts:
            if m not in programs:
                programs[m] = make(m)
            p = programs[m]
            if sum(p.memory_lower_bound(mode).values()) > p.budget:
                continue  # this mode needs more micro-batches
            if not p.x:
                p.build()
            if mode_best is None and m != prog.mb:  # the mode's own memory-free optimum: a tighter bound
                tight = p.solve_free(recompute=mode)
                if tight.feasible:
                    bound = max(bound, tight.step_time_s)
                if target <= bound * (1 + 1e-9):
                    break
            res = last = mix_layer_modes(p, p.solve_best(bound if mode == "none" else lower, recompute=mode))
            say(
                f"mesh dp={p.dp} tp={p.tp} micro-batches={m}, {mode} recompute: "
                + (f"{res.step_time_s * 1e3:.2f} ms" if res.feasible else "infeasible")
            )
            if mode_best is not None and (not res.feasible or res.step_time_s >= mode_best[0].step_time_s):
                break  # more micro-batches only pay more latency once the states have stopped shrinking
            if res.feasible:
                mode_best = (res, p, p.last_choice)
                if res.step_time_s <= bound * (1 + 1e-9):
                    break  # as fast as this mode can be
        if mode_best is not None and (best is None or mode_best[0].step_time_s < best[0].step_time_s):
            best = mode_best
    if best is None:
        if last is None and beat_s < math.inf:
            return dataclasses.replace(
                free,
                feasible=False,
                reason=f"cannot beat the chosen plan: at least "
                f"{lower * 1e3:.2f} ms with the micro-batches memory needs",
            ), None
        return last or dataclasses.replace(free, feasible=False, reason="no micro-batch count fits"), None
    res, p, choice = best
    p.last_choice = choice
    return res, p


def _microbatch_choices(per_rank: int, constraints: dict) -> list[int]:
    """Micro-batch counts to try on a data-parallel rank holding `per_rank` samples, fewest first."""
    m, b = constraints.get("num_microbatches"), constraints.get("micro_batch_size")
    if m is not None:
        return [m] if per_rank % m == 0 else []
    if b is not None:
        return [per_rank // b] if per_rank % b == 0 else []
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0]


def _solution(prog: ShardingProgram, best: MeshResult, results, unruled, dt) -> ShardingSolution:
    chosen = prog.last_choice
    out, ins, strat, params = {}, {}, {}, {}
    graph = prog.graph
    for node in graph.graph.nodes:
        rep = graph.representative[node.name]
        if rep not in prog.group_of:
            continue
        gname = prog.group_of[rep]
        grp, k = prog.groups[gname], chosen[gname]
        out[node.name] = placement_str(grp.out[rep][k])
        ins[node.name] = tuple(placement_str(p) for p in grp.need[rep][k])
        strat[node.name] = grp.strategies[k].name if gname == rep else "follows " + gname
        if node.name in graph.params:
            params[graph.params[node.name].name] = out[node.name]
    return ShardingSolution(
        best.dp,
        best.tp,
        best.num_microbatches,
        best.zero_stage,
        best.step_time_s,
        best.compute_s,
        best.reshard_s,
        best.grad_sync_s,
        best.memory,
        out,
        ins,
        strat,
        params,
        results,
        unruled,
        len(prog.groups),
        dt,
        recompute=best.recompute,
        offload=best.offload,
        layer_modes=layer_indices(best.layer_modes, graph) if best.layer_modes else {},
        activation_offload=best.activation_offload,
        optimizer_s=best.optimizer_s,
        recompute_s=best.recompute_s,
        grad_sync_hidden_s=best.grad_sync_hidden_s,
        cp_comm_s=best.cp_comm_s,
        cp_comm_hidden_s=best.cp_comm_hidden_s,
        reshard_hidden_s=best.reshard_hidden_s,
        tensor_split=tensor_split_report(prog, chosen),
        layer_ops=layer_ops_report(prog, chosen, best.zero_stage, exposed_fraction(best)),
        cp=cp_report(prog.cp),
    )

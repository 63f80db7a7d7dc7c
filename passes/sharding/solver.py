"""How one mesh's program is solved: quietly by HiGHS (CBC where HiGHS is missing), with the ZeRO stage fixed or
free and the memory row on or off (`solve`); the memory-free optimum over the stages (`solve_free`) and the best
layout over recompute modes and stages (`solve_best`), the strategies `search` builds on; and the result read off a
solved program (`read_result`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TYPE_CHECKING

import pulp

from autopar.passes.sharding.offload import offload_result
from autopar.passes.sharding.solution import MeshResult

if TYPE_CHECKING:
    from autopar.passes.sharding.program import ShardingProgram


def solve(
    prog: ShardingProgram,
    time_limit_s: float = 60.0,
    *,
    stage: int | None = None,
    memory: bool = True,
    recompute: str | None = None,
) -> MeshResult:
    """Solve the program, optionally with the ZeRO stage fixed and without the memory constraint.

    Fixing the stage turns the stage product into constants that presolve removes; HiGHS solves
    the four fixed programs faster than the joint one. Without the memory constraint the optimum
    is a lower bound of the step time for this mesh and any more micro-batches or higher stage.
    `recompute` picks the mode (default: the first allowed, "none" unless pinned).
    """
    mode = recompute or prog.recompute_choices[0]
    prog.use_mode(mode)
    for s, z in prog.z.items():
        z.lowBound, z.upBound = (0, 1) if stage is None else ((1, 1) if s == stage else (0, 0))
    mem_con = None if memory else prog.prob.constraints.pop("memory_peak", None)
    t0 = time.perf_counter()
    try:
        _quiet_solve(prog.prob, time_limit_s)
    finally:
        if mem_con is not None:
            prog.prob.constraints["memory_peak"] = mem_con
    dt = time.perf_counter() - t0
    status = pulp.LpStatus[prog.prob.status]
    if status != "Optimal":
        return MeshResult(
            prog.dp, prog.tp, False, math.inf, 0, 0, 0, -1, {}, dt, f"solver status {status}", prog.mb, mode
        )
    prog.last_choice = prog.chosen()
    return read_result(prog, mode, dt)


def solve_free(prog: ShardingProgram, recompute: str | None = None) -> MeshResult:
    """The memory-free optimum over the allowed ZeRO stages: the lowest stage, or the lowest from 1 when
    faster (its optimizer step is 1/dp; higher stages only add communication)."""
    low = prog.zero_choices[0]
    if prog.offload is True and prog.dp > 1 and 3 in prog.zero_choices:
        low = 3  # every state on the host: only the ZeRO-3 layout the offload program runs can hold that
    best, choice = solve(prog, stage=low, memory=False, recompute=recompute), prog.last_choice
    sharded = next((s for s in prog.zero_choices if s >= 1), None)
    if prog.dp > 1 and low == 0 and sharded is not None:
        res = solve(prog, stage=sharded, memory=False, recompute=recompute)
        if res.feasible and (not best.feasible or res.step_time_s < best.step_time_s):
            best, choice = res, prog.last_choice
    prog.last_choice = choice
    return best


def solve_best(prog: ShardingProgram, lower_bound_s: float = 0.0, *, recompute: str | None = None) -> MeshResult:
    """The optimum over the allowed recompute modes and ZeRO stages, each solved with both fixed.

    `lower_bound_s` is a step time nothing on this mesh can beat (the memory-free optimum at the
    lowest stage, no recompute). A mode adds at least `recompute_time_lower_bound` to it: a mode
    whose bound the best plan found already reaches is not solved, nor a (mode, stage) whose
    memory lower bound exceeds the budget; a stage that reaches its mode's bound ends that mode.
    """
    best, best_choice = None, None
    modes = prog.recompute_choices if recompute is None else [recompute]
    for mode in modes:
        bound = lower_bound_s + (prog.recompute_time_lower_bound(mode) if mode != "none" else 0.0)
        if best is not None and best.step_time_s <= bound * (1 + 1e-9):
            continue
        acts = sum(prog.activations.lower_bound(mode)) + prog.activations.transient_bytes()
        for s in prog.zero_choices:
            if prog.prices.states_lower_bound([s], prog.z) + acts > prog.budget:
                continue
            res = solve(prog, stage=s, recompute=mode)
            if res.feasible and (best is None or res.step_time_s < best.step_time_s):
                best, best_choice = res, prog.last_choice
                if res.step_time_s <= bound * (1 + 1e-9):
                    break
    if best is None:
        return MeshResult(prog.dp, prog.tp, False, math.inf, 0, 0, 0, -1, {}, 0.0, "no stage fits", prog.mb)
    prog.last_choice = best_choice
    return best


def read_result(prog: ShardingProgram, mode: str, dt: float) -> MeshResult:
    """The optimum `prog` holds after a solve under recompute mode `mode` that took `dt` seconds: its step time by
    term, its memory by state, and the parts the plan reports apart (what overlap hides, the latencies)."""
    val = {k: sum(pulp.value(t) or 0.0 for t in v) for k, v in prog.terms.cost.items()}
    mem = {k: sum(pulp.value(t) or 0.0 for t in v) for k, v in prog.terms.memory.items()}
    mem["transient"] = prog.transient
    if not mem.get("recompute"):
        mem.pop("recompute", None)
    if not mem.get("prefetch"):
        mem.pop("prefetch", None)
    chosen_stage = next(s for s, z in prog.z.items() if (pulp.value(z) or 0) > 0.5)
    step = sum(val.values())
    hidden = 0.0
    if prog.terms.exposed is not None and mode == "none":
        whole = sum(pulp.value(t) or 0.0 for t in prog.terms.plain_sync)
        hidden = max(whole - (pulp.value(prog.terms.exposed) or 0.0), 0.0)
    for terms, exposed in prog.terms.sharded_hidden:  # the sharded program overlaps under every recompute mode
        hidden += max(sum(pulp.value(t) or 0.0 for t in terms) - (pulp.value(exposed) or 0.0), 0.0)
    # recomputed forwards are compute; resharding they repeat is counted with them
    return MeshResult(
        prog.dp,
        prog.tp,
        True,
        step,
        val.get("compute", 0.0) + val.get("recompute", 0.0),
        val.get("reshard", 0.0),
        val.get("grad_sync", 0.0),
        chosen_stage,
        mem,
        dt,
        num_microbatches=prog.mb,
        recompute=mode,
        offload=_offload_of(prog, mem, val.get("offload", 0.0)),
        optimizer_s=val.get("optimizer", 0.0),
        recompute_s=val.get("recompute", 0.0),
        grad_sync_hidden_s=hidden,
        cp_comm_s=val.get("cp_comm", 0.0),
        cp_comm_hidden_s=sum(pulp.value(t) or 0.0 for t in prog.terms.cp_hidden),
        step_gather_s=sum(pulp.value(t) or 0.0 for t in prog.terms.step_gathers),
        sync_fixed_s=sum(pulp.value(t) or 0.0 for t in prog.terms.sync_fixed),
        reshard_hidden_s=sum(pulp.value(t) or 0.0 for t in prog.terms.tp_hidden),
    )


def _offload_of(prog: ShardingProgram, mem: dict[str, float], offload_s: float) -> dict:
    """What the solved program keeps on the host (`offload.offload_result`)."""
    if not prog.h:
        return {}
    host = tuple(pulp.value(prog.h[k]) or 0.0 for k in ("optimizer", "grads", "params"))
    return offload_result(
        host,
        mem,
        offload_s,
        host_capacity=prog.host_capacity(),
        devices_per_node=prog.cluster.devices_per_node,
        budget=prog.budget,
    )


def _quiet_solve(prob: pulp.LpProblem, time_limit_s: float) -> None:
    """Solve without the banner HiGHS writes straight to the process's stdout when it starts."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            prob.solve(_solver(time_limit_s))
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solver(time_limit_s: float):
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def solver_name() -> str:
    return "HiGHS" if pulp.HiGHS(msg=False).available() else "CBC"

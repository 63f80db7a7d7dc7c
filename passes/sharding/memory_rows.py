"""The sharding program's memory row and the recompute mode's terms: the peak at the turn from forward to
backward, and what each recompute mode adds to the objective and the memory (see the program's module docstring,
"memory" and "recomputed segment").

Each function builds one family of `ShardingProgram` (`prog`), which calls it from the method of the same
name; they were its methods and read its variables and terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pulp

from autopar.passes.sharding.lp_terms import scaled

if TYPE_CHECKING:
    from autopar.passes.sharding.program import ShardingProgram


@dataclass
class ModeTerms:
    """What one recompute mode puts into a program: its objective, terms and rows."""

    objective: pulp.LpAffineExpression
    extra: list
    activations: list
    peak: list
    rows: dict[str, pulp.LpConstraint]


def add_memory_constraint(prog: ShardingProgram, recompute: str | None = None) -> None:
    """sum n_w u M_state + sum_s z[s] M_comm[s] + sum n_g x M_saved(r) + M_recompute(r) + M_transient <= budget.

    The peak is at the turn from forward to backward. Under recompute mode r, M_saved(r) keeps only
    what enters each recomputed segment, and the first segment the backward recomputes holds its
    values again: M_recompute(r) >= sum_{(g,m) in S} x[g,k] M_value[m,k] for every segment S.
    """
    if prog.transient is None:
        for (name, k, s), u in prog.u.items():
            count = prog.groups[name].count
            p, g, o = prog.prices.state_bytes(name, k, s)
            prog.terms.memory["params"].append(scaled(count * p, u))
            prog.terms.memory["grads"].append(scaled(count * g, u))
            prog.terms.memory["optimizer"].append(scaled(count * o, u))
        prog._add_overlap_grads()
        prog.transient = prog.activations.transient_bytes()
        ahead = prog.prices.prefetch_bytes(prog.z)
        if ahead:
            prog.terms.memory["prefetch"] = [
                ahead * z for s, z in prog.z.items() if s >= 1 and prog.prices.comm(s).overlaps_data_axis
            ]
    prog.use_mode(recompute or prog.recompute_choices[0])


def add_recompute_cost(prog: ShardingProgram, recompute: str) -> list:
    """Objective terms of recompute mode r: the forward of every recomputed node and the resharding its
    arguments need, once more (`RecomputeTerms.forward_terms`): sum_{g, m in R} n_g sum_k x[g,k] F[m,k] +
    sum_{e into R} n_e y Rf, and the weights it gathers again (`RecomputeTerms.regathered`): sum_{w read in R}
    sum_{k, s} regather_s(w, k, s) u[w,k,s]."""
    terms = [
        prog.prices.regather_s(w, k, st) * u
        for w in prog.recompute_terms.regathered(recompute)
        for (name, k, st), u in prog.u.items()
        if name == w and prog.prices.regather_s(w, k, st)
    ]
    return terms + prog.recompute_terms.forward_terms(recompute, prog.x)


def fixed_activations(
    prog, choice: dict[str, int], recompute: str, stage: int | None = None
) -> tuple[float, float, float]:
    """(saved activation bytes, recomputed-segment peak bytes, recompute seconds) of the layout `choice`
    (strategy per group) at ZeRO stage `stage` (None: the weights' gathers left out) under recompute mode r:
    the program's M_saved(r), M_recompute(r) and recompute objective terms evaluated at that layout, without
    solving."""
    acts, peak = prog.activations.fixed(choice, recompute)
    if recompute == "none":
        return acts, peak, 0.0
    seconds = prog.recompute_terms.fixed_forward_s(choice, recompute)
    if stage is not None:
        seconds += sum(prog.prices.regather_s(w, choice[w], stage) for w in prog.recompute_terms.regathered(recompute))
    return acts, peak, seconds


def mode_terms(prog: ShardingProgram, recompute: str) -> ModeTerms:
    if recompute in prog._modes:
        return prog._modes[recompute]
    acts = []
    for name, grp in prog.groups.items():
        for k in range(len(grp.strategies)):
            b = prog.activations.saved_bytes(name, k, recompute) * prog.activation_copies
            if b:
                acts.append(scaled(grp.count * b, prog.x[name][k]))
    rows, peak = {}, []
    segs = [
        pulp.lpSum(
            scaled(prog.mesh_groups.member_bytes(prog.groups[g], m, k), prog.x[g][k])
            for g, m in seg
            for k in range(len(prog.groups[g].strategies))
        )
        for seg in prog.activations.recomputed_saves(recompute)
    ]
    if len(segs) == 1:
        peak = [segs[0]]
    elif segs:  # the largest segment: one variable above each
        w = prog.prob.add_variable(f"recompute_peak_{recompute}", 0)
        rows = {f"recompute_peak_{recompute}_{i}": w >= e for i, e in enumerate(segs)}
        peak = [w]
    states = [t for key in ("params", "grads", "optimizer", "prefetch") for t in prog.terms.memory.get(key, ())]
    total = pulp.lpSum(states + acts + peak) + prog.transient
    if math.isfinite(prog.budget):
        rows["memory_peak"] = total <= prog.budget
    base = [t for key, terms in prog.terms.cost.items() if key != "recompute" for t in terms]
    extra = prog.add_recompute_cost(recompute) if recompute != "none" else []
    if extra and 0 in prog.z and prog.prices.comm(0).runs_plain and prog.prices.leaving_plain_s:
        extra.append(prog.prices.leaving_plain_s * prog.z[0])  # recompute runs on the sharded runtime
    if extra and prog.terms.exposed is not None:  # which does not overlap its gradient reductions with backward
        extra.append(pulp.lpSum(prog.terms.plain_sync) - prog.terms.exposed)
    prog._modes[recompute] = ModeTerms(pulp.lpSum(base + extra), extra, acts, peak, rows)
    return prog._modes[recompute]


def use_mode(prog: ShardingProgram, recompute: str) -> None:
    """Make the objective and the memory rows those of recompute mode `recompute`."""
    if recompute == prog._mode:
        return
    if prog._mode is not None:
        for name in prog._modes[prog._mode].rows:
            prog.prob.constraints.pop(name, None)
    terms = prog._mode_terms(recompute)
    prog.prob.setObjective(terms.objective)
    for name, row in terms.rows.items():
        prog.prob.addConstraint(row, name)
    prog.terms.memory["activations"] = terms.activations
    prog.terms.memory["recompute"] = terms.peak
    prog.terms.cost["recompute"] = terms.extra
    prog._mode = recompute

"""The sharding program's objective families over strategies and stages: compute, resharding on the edges,
the data-axis sync and optimizer step per parameter and ZeRO stage, and host offload (see the program's module
docstring, "Objective").

Each function builds one family of `ShardingProgram` (`prog`), which calls it from the method of the same
name; they were its methods and read its variables and terms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pulp

from autopar.cost_model.compute import optimizer_step_time_s
from autopar.passes.sharding.lp_terms import scaled
from autopar.passes.sharding.offload import offload_prices
from autopar.units import FP32_BYTES

if TYPE_CHECKING:
    from autopar.passes.sharding.program import ShardingProgram


def add_compute_cost(prog: ShardingProgram) -> None:
    """Objective term sum_g n_g sum_k x[g,k] (T_fwd + T_bwd), plus resharding inside merged groups."""
    for name, grp in prog.groups.items():
        for k in range(len(grp.strategies)):
            t = back = comm = hid = 0.0
            for m in grp.members:
                fwd, bwd = prog.mesh_groups.op_times(prog.graph.node(m), grp.divisor[m][k])
                t += fwd + bwd
                back += bwd
                exposed, hidden = prog.mesh_groups.cp_comm_s(m, grp.divisor[m][k])
                comm, hid = comm + exposed, hid + hidden
                prog.recompute_terms.forward_s[name].setdefault(m, [0.0] * len(grp.strategies))[k] = grp.count * fwd
            # cp attention's exposed communication is a term of its own (the cp axis's), not compute
            prog.terms.cost["compute"].append(scaled(grp.count * (t - comm), prog.x[name][k]))
            if comm:
                prog.terms.cost["cp_comm"].append(scaled(grp.count * comm, prog.x[name][k]))
            if hid:
                prog.terms.cp_hidden.append(scaled(grp.count * hid, prog.x[name][k]))
            if back:
                prog.terms.backward.append(scaled(grp.count * back, prog.x[name][k]))
            if t - back:
                prog.terms.forward.append(scaled(grp.count * (t - back), prog.x[name][k]))
            if grp.extra_s[k]:
                prog.terms.cost["reshard"].append(scaled(grp.extra_s[k], prog.x[name][k]))


def add_edge_constraint(prog: ShardingProgram) -> None:
    """y marginals sum_l y[e,k,m] = x[a,k], sum_k y[e,k,m] = x[c,m]; objective n_e * (Rf + Rb - H) * y, H the
    part of Rf a collective launched early hides behind the ops before its consumer (`MeshGroups.early_window`):
    H = eta min(Rf - Rf_fix, W), the collective's latency (Rf_fix) never hidden."""
    for idx, (edge, mult) in enumerate(prog.mesh_groups.edges().items()):
        gp, _, gc, c, _ = edge
        gpr, gcr = prog.groups[gp], prog.groups[gc]
        cost, fwd_cost, hidden = prog.mesh_groups.edge_prices(edge, mult, prog.eta if prog.tp_overlap else 0.0)
        if not any(v for row in cost + hidden for v in row):
            continue
        if gp == gc:  # both ends in one group: the strategy index is shared
            prog.terms.cost["reshard"] += [scaled(cost[k][k], prog.x[gp][k]) for k in range(len(cost)) if cost[k][k]]
            prog.terms.tp_hidden += [scaled(hidden[k][k], prog.x[gp][k]) for k in range(len(cost)) if hidden[k][k]]
            prog.recompute_terms.edge_forward += [
                (c, fwd_cost[k][k], prog.x[gp][k], ((gp, k),)) for k in range(len(cost)) if fwd_cost[k][k]
            ]
            continue
        if len(gpr.strategies) == 1 or len(gcr.strategies) == 1:
            for k, row in enumerate(cost):
                for m, v in enumerate(row):
                    var = prog.x[gc][m] if len(gpr.strategies) == 1 else prog.x[gp][k]
                    if v:
                        prog.terms.cost["reshard"].append(scaled(v, var))
                    if hidden[k][m]:
                        prog.terms.tp_hidden.append(scaled(hidden[k][m], var))
                    if fwd_cost[k][m]:
                        prog.recompute_terms.edge_forward.append((c, fwd_cost[k][m], var, ((gp, k), (gc, m))))
            continue
        y = [
            [prog.prob.add_variable(f"y_{idx}_{k}_{m}", 0, 1) for m in range(len(gcr.strategies))]
            for k in range(len(gpr.strategies))
        ]
        for k in range(len(gpr.strategies)):
            prog.prob += pulp.lpSum(y[k]) == prog.x[gp][k], f"edge_src_{idx}_{k}"
        for m in range(len(gcr.strategies)):
            prog.prob += (
                pulp.lpSum(y[k][m] for k in range(len(gpr.strategies))) == prog.x[gc][m],
                f"edge_dst_{idx}_{m}",
            )
        prog.terms.cost["reshard"] += [
            scaled(cost[k][m], y[k][m]) for k in range(len(cost)) for m in range(len(cost[0])) if cost[k][m]
        ]
        prog.terms.tp_hidden += [
            scaled(hidden[k][m], y[k][m]) for k in range(len(cost)) for m in range(len(cost[0])) if hidden[k][m]
        ]
        prog.recompute_terms.edge_forward += [
            (c, fwd_cost[k][m], y[k][m], ((gp, k), (gc, m)))
            for k in range(len(cost))
            for m in range(len(cost[0]))
            if fwd_cost[k][m]
        ]


def add_stage_product_constraint(prog: ShardingProgram) -> None:
    """u[w,k,s] >= x[w,k] + z[s] - 1, u <= x[w,k], u <= z[s]; objective n_w * Sync * u (the plain layout's
    part through `add_overlap_constraint`)."""
    plain = []  # the sync terms of the plain layout, when its all-reduces overlap backward
    # the sharded program's hideable parts (`SyncPricing.sharded_parts`); gradients by how often a step reduces
    # them (one list where m = 1)
    grads: dict[int, list] = {1: [], prog.mb: []}
    gathers = []
    for name in prog.mesh_groups.param_groups():
        grp = prog.groups[name]
        for k in range(len(grp.strategies)):
            for s, zs in prog.z.items():
                u = prog.prob.add_variable(f"u_{name}_{k}_{s}", 0, 1)
                prog.u[(name, k, s)] = u
                if len(prog.z) > 1:
                    prog.prob += u >= prog.x[name][k] + zs - 1, f"zero_product_lo_{name}_{k}_{s}"
                    prog.prob += u <= zs, f"zero_product_hi_{name}_{k}_{s}"
                else:
                    prog.prob += u >= prog.x[name][k], f"zero_product_lo_{name}_{k}_{s}"
                prog.prob += u <= prog.x[name][k], f"zero_product_x_{name}_{k}_{s}"
                t = prog.prices.sync_time(name, k, s)
                if t and prog.prices.comm(s).overlaps_data_axis:
                    g_bw, g_fix, a_bw, a_fix = prog.prices.sharded_sync_parts(name, k, s)
                    grads[prog.prices.comm(s).reductions_per_step].append(grp.count * g_bw * u)
                    gathers += [grp.count * a_bw * u] if a_bw else []
                    prog.terms.cost["grad_sync"].append(grp.count * (g_fix + a_fix) * u)
                elif t:
                    fixed = prog.prices.bucket_latency_s(name, k, s)  # a bucketed reduction's latency never hides
                    if prog.prices.comm(s).overlaps_all_reduce:
                        plain.append(grp.count * (t - fixed) * u)
                        prog.terms.cost["grad_sync"].append(grp.count * fixed * u)
                    else:
                        prog.terms.cost["grad_sync"].append(grp.count * t * u)
                    if fixed:
                        prog.terms.sync_fixed.append(grp.count * fixed * u)
                    gather = prog.prices.step_gather_time(name, k, s)
                    if gather:
                        prog.terms.step_gathers.append(grp.count * gather * u)
                t = prog.prices.optimizer_time(name, k, s)
                if t:
                    prog.terms.cost["optimizer"].append(grp.count * t * u)
    for s, zs in prog.z.items():
        if prog.prices.sync_floor(s):
            prog.terms.cost["grad_sync"].append(prog.prices.sync_floor(s) * zs)
            prog.terms.sync_fixed.append(prog.prices.sync_floor(s) * zs)
    if plain:
        prog.add_overlap_constraint(plain)
    if any(prog.prices.comm(s).overlaps_data_axis for s in prog.z):
        prog.add_sharded_overlap_constraint(grads, gathers)


def add_offload_constraint(prog: ShardingProgram) -> None:
    """h_o <= sum n u M_opt, h_g <= sum n u M_grad (= when pinned), B_opt h_g = B_grad h_o,
    B_opt h_p = B_param h_o, h_o + h_g <= host memory per device; objective C_o h_o + C_g h_g + C_p h_p;
    memory rows lose h_o + h_g + h_p.

    h_p: the weights of the chunks whose optimizer states are on the host. The offload program keeps
    no device copy of them between uses (each gather brings the shard up from the host's master
    weights), so they leave the device with their states, and pay the host link at every gather."""
    if prog.offload is False:
        return
    opt, grad = [], []
    for (name, k, s), u in prog.u.items():
        _, g, o = prog.prices.state_bytes(name, k, s)
        count = prog.groups[name].count
        opt += [count * o * u] if o else []
        grad += [count * g * u] if g else []
    h_o = prog.h["optimizer"] = prog.prob.add_variable("offload_optimizer_bytes", 0)
    h_g = prog.h["grads"] = prog.prob.add_variable("offload_grad_bytes", 0)
    h_p = prog.h["params"] = prog.prob.add_variable("offload_param_bytes", 0)
    if prog.offload is True:
        prog.prob += h_o == pulp.lpSum(opt), "offload_optimizer_all"
        prog.prob += h_g == pulp.lpSum(grad), "offload_grads_all"
    else:
        prog.prob += h_o <= pulp.lpSum(opt), "offload_optimizer_at_most_all"
        prog.prob += h_g <= pulp.lpSum(grad), "offload_grads_at_most_all"
    pr = prog.precision
    # the offload program adds each micro-batch's gradient of a host chunk into its host buffer
    prog.prob += pr.optimizer_bytes * h_g == pr.grad_bytes_at(3) * h_o, "offload_grads_with_their_optimizer_states"
    prog.prob += pr.optimizer_bytes * h_p == pr.param_bytes * h_o, "offload_weights_with_their_optimizer_states"
    prog.prob += h_o + h_g <= prog.prices.host_capacity(), "host_memory"
    prog._offloading = prog.offload is True  # the offload program runs, holding no gradient buckets
    if prog.dp > 1:  # the offload program runs its chunks as ZeRO-3: only a stage-3 layout offloads
        if 3 in prog.z:
            prog.prob += h_o <= prog.prices.host_capacity() * prog.z[3], "offload_runs_zero3"
            if not prog._offloading and prog.prices.in_flight_grad_bytes(3):
                # o = 1 where anything is on the host: the offload program runs, holding no gradient buckets in
                # flight (`_add_overlap_grads`)
                o = prog._offload_runs = prog.prob.add_variable("offload_program_runs", cat="Binary")
                prog.prob += h_o <= prog.prices.host_capacity() * o, "offload_program_runs_if_offloading"
                prog.prob += o <= prog.z[3], "offload_program_runs_zero3"
        else:
            h_o.upBound = 0
    host_rate = prog.cluster.device.host_adamw_params_per_s
    c_o, c_g, c_p = offload_prices(prog.precision, prog.cluster.host_link, host_rate, prog.mb)
    prog.terms.cost["offload"] += [c_o * h_o] + ([c_g * h_g] if c_g else []) + ([c_p * h_p] if c_p else [])
    # the device no longer steps the states on the host (their per-tensor cost is kept: an upper bound)
    d_o = min(c_o, optimizer_step_time_s(prog.estimator, prog.cluster.device, 0, FP32_BYTES / pr.optimizer_bytes))
    if d_o:
        prog.terms.cost["optimizer"].append(-d_o * h_o)
    prog.terms.memory["optimizer"].append(-1.0 * h_o)
    prog.terms.memory["grads"].append(-1.0 * h_g)
    prog.terms.memory["params"].append(-1.0 * h_p)

"""The sharding program's overlap families: what a program that overlaps its data-axis communication with
compute leaves exposed (see the program's module docstring, "plain overlap" and "sharded overlap").

Each function builds one family of `ShardingProgram` (`prog`), which calls it from the method of the same
name; they were its methods and read its variables and terms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pulp

if TYPE_CHECKING:
    from autopar.passes.sharding.program import ShardingProgram


def add_overlap_grads(prog: ShardingProgram) -> None:
    """Memory rows gain what the overlapping sharded program holds beyond `state_bytes`: `overlap_grad_bytes`
    of the layout (ZeRO-1) and `in_flight_grad_bytes` of the stage (ZeRO-2/3), unless the offload program runs
    the layout (offload pinned, or o of `add_offload_constraint` where the solver may offload: it runs at ZeRO-3,
    and its gradient staging buffers, a chunk each, stand in for the buckets; the runtime sizes its chunks so
    that the ones in flight take a small share of the budget, and they are not counted here)."""
    for (name, k, s), u in prog.u.items():
        extra = prog.groups[name].count * prog.prices.overlap_grad_bytes(name, k, s)
        if extra and not (prog._offloading and s == 3):
            prog.terms.memory["grads"].append(extra * u)
    for s, z in prog.z.items():
        buffers = prog.prices.in_flight_grad_bytes(s)
        if buffers and not (prog._offloading and s == 3):
            prog.terms.memory["grads"].append(buffers * z)
            if s == 3 and prog._offload_runs is not None:  # z[3] - o: the sharded program runs the layout
                prog.terms.memory["grads"].append(-buffers * prog._offload_runs)


def add_sharded_overlap_constraint(prog: ShardingProgram, grads: dict[int, list], gathers: list) -> None:
    """The sharded program with overlap; objective E_g + E_a + fixed costs instead of sum(Sync):

        E_g >= sum G_bw - eta B r / m,  E_g >= (1 - eta) sum G_bw,  E_g >= r T_last,g z[s]   (gradient buckets
                                                                        behind the backwards that issue them)
        E_a >= sum A_bw - eta F,      E_a >= (1 - eta) sum A_bw,  E_a >= T_first,a z[s]  (gathers ahead of use
                                                                        behind the forward, depth > 0)

    summed over the sharded stages s (one z[s] is 1), eta the device's overlap efficiency (`hiding`; hidden =
    eta min(communication, compute), as in `add_overlap_constraint`). A step reduces each gradient r times
    (`ProgramComm.reductions_per_step`): once at stages 0 and 1, from the last micro-batch's backward (B / m
    hides them), once per micro-batch at stages 2 and 3, each micro-batch's backward hiding its own buckets
    (r B / m = B); one E_g per r, over the stages that reduce r times (the other's terms are 0 where its stages
    are not chosen). Exposed = what the communication needs beyond the compute it hides behind (the backward of
    the layers after each bucket; F: the forward of the layers before each gather, every micro-batch's), never
    less than the collectives nothing hides: the last bucket of each reducing backward, issued when it ends
    (T_last,g, `SyncPricing.last_bucket_bw_s`; the offload program's chunks in `ChunkPricing`), and each
    micro-batch's first gather, which no layer precedes (T_first,a, `SyncPricing.first_gather_bw_s`; stage 3's
    backward gathers are in G_bw: they share the backward's link with the buckets). The fixed latency of every
    collective (G_fix, A_fix of `SyncPricing.sharded_parts`) and one bucket's latency per reducing backward are
    in the objective as they are: they never hide.
    """
    sharded = [s for s in prog.z if prog.prices.comm(s).overlaps_data_axis]
    for r, terms in sorted(grads.items()):
        stages = [s for s in sharded if prog.prices.comm(s).reductions_per_step == r]
        if not stages:
            continue
        suffix = "" if r == 1 else "_per_microbatch"
        e_g = prog.prob.add_variable(f"exposed_sharded_grads{suffix}", 0)
        hides = prog.hiding(prog.terms.backward) * (r / prog.mb)
        prog.prob += e_g >= pulp.lpSum(terms) - hides, f"sharded_exposed_grads{suffix}"
        last = pulp.lpSum(r * prog.prices.last_bucket_bw_s(s) * prog.z[s] for s in stages)
        prog.prob += e_g >= last, f"sharded_last_bucket{suffix}"
        if prog.eta < 1:  # at most the share eta of the communication hides, however long the compute
            prog.prob += e_g >= pulp.lpSum(terms) * (1.0 - prog.eta), f"sharded_grads_efficiency{suffix}"
        prog.terms.cost["grad_sync"].append(e_g)
        prog.terms.sharded_hidden.append((terms, e_g))
    for s in sharded:
        if prog.prices.comm(s).runs_chunks:  # one latency per chunk, in G_fix already
            continue
        prog.terms.cost["grad_sync"].append(prog.prices.sync.reduction_latency(prog.prices.comm(s)) * prog.z[s])
    if gathers:
        e_a = prog.prob.add_variable("exposed_sharded_gathers", 0)
        prog.prob += e_a >= pulp.lpSum(gathers) - prog.hiding(prog.terms.forward), "sharded_exposed_gathers"
        first = pulp.lpSum(prog.prices.first_gather_bw_s(s) * prog.z[s] for s in sharded if s >= 1)
        prog.prob += e_a >= first, "sharded_first_gather"
        if prog.eta < 1:
            prog.prob += e_a >= pulp.lpSum(gathers) * (1.0 - prog.eta), "sharded_gathers_efficiency"
        prog.terms.cost["grad_sync"].append(e_a)
        prog.terms.sharded_hidden.append((gathers, e_a))


def add_overlap_constraint(prog: ShardingProgram, plain: list) -> None:
    """E >= sum(plain) - eta B / m, E >= (1 - eta) sum(plain), E >= T_last z[s], E >= 0; objective E instead
    of sum(plain).

    The data-parallel program's all-reduces (sum(plain): every bucket's bandwidth time) run while the last
    micro-batch's backward (B / m, B the step's backward) goes on. Of that, the share eta
    (`DeviceSpec.overlap_efficiency`) hides: hidden = eta min(sum(plain), B / m), and the first two rows are
    exposed = sum(plain) - hidden. The last bucket (the first parameters, whose gradients come last) is
    launched when backward ends and is exposed whole (T_last: the bandwidth part of one all-reduce of
    min(bucket, all gradient bytes)). The buckets' latencies (`bucket_latency_s`, `sync_floor`) are in the
    objective as they are: they never hide. eta is 1 on GPUs and measured for gloo on CPU, where communication
    competes with compute for the cores. With equal buckets the serial link's per-bucket price, max_k (sum_{j >=
    k} T_j - eta H_k) (H_k the backward left when bucket k goes out), is these rows; it is approximated in one
    respect: the backward before the first bucket fills counts as hiding (less than one bucket's share of B,
    small but for models of a few buckets). With overlap off (constraints={"overlap": False}) E is not used and
    the sync is paid whole."""
    s = next(s for s in prog.z if prog.prices.comm(s).runs_plain)
    e = prog.prob.add_variable("exposed_sync", 0)
    backward = pulp.lpSum(prog.terms.backward) * (prog.eta / prog.mb)
    prog.prob += e >= pulp.lpSum(plain) - backward, "overlap_exposed_sync"
    if prog.eta < 1:
        prog.prob += e >= pulp.lpSum(plain) * (1.0 - prog.eta), "overlap_efficiency"
    prog.prob += e >= prog.prices.last_bucket_s() * prog.z[s], "overlap_last_bucket"
    prog.terms.cost["grad_sync"].append(e)
    prog.terms.plain_sync = plain
    prog.terms.exposed = e

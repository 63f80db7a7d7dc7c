"""What a solved sharding layout says about itself: the plan's records of its tensor axis (`tensor_split_report`),
of each layer's ops and collectives (`layer_ops_report`) and of its cp axis (`cp_report`), and the words of an
infeasible search (`infeasible_message`)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.cost_model.comm import Collective
from autopar.cost_model.experts import EXPERT_SYNC_AXIS
from autopar.ir import NodeKind, tensor_args
from autopar.passes.context_parallel import CPPricing
from autopar.passes.sharding.graph import layer_matmul_weights, matmul_weights
from autopar.passes.sharding.reshard import R, grad_layout, redistribute_kind, redistribute_time
from autopar.passes.sharding.solution import MeshResult
from autopar.passes.sharding_rules import placement_str
from autopar.units import GIB

if TYPE_CHECKING:
    from autopar.passes.sharding.program import ShardingProgram


def cp_report(pricing: CPPricing | None) -> dict:
    """The plan's record of its cp axis: degree, algorithm, and each algorithm's price or why it cannot run."""
    if pricing is None:
        return {}
    return {
        "degree": pricing.degree,
        "algorithm": str(pricing.algorithm),
        "layout": "zigzag",
        "priced": list(pricing.lines),
    }


def tensor_split_report(prog: ShardingProgram, chosen: dict[str, int]) -> dict:
    """What the tensor axis of `prog`'s layout `chosen` splits: the fraction of all parameter elements and of the
    layer matmul weights', the rule it was held to, and every parameter kept whole (under each name of the model)
    with the reason. Empty without a tensor axis."""
    if prog.tp == 1:
        return {}
    graph, rule = prog.graph, prog.tensor_split
    layer, matmul = layer_matmul_weights(graph), matmul_weights(graph)
    total = split = layer_total = layer_split = 0
    replicated = {}
    members = defaultdict(list)  # representative -> every parameter node it stands for (identical layers)
    for node_name in graph.params:
        members[graph.representative[node_name]].append(graph.params[node_name])
    for name in prog.mesh_groups.param_groups():
        grp, info = prog.groups[name], graph.params[name]
        size = grp.count * info.meta.numel
        whole = not isinstance(grp.strategies[chosen[name]].output, Shard)
        total += size
        split += 0 if whole else size
        if name in layer:
            layer_total += size
            layer_split += 0 if whole else size
        if whole:
            reason = _kept_whole_reason(prog, name, name in layer, name in matmul)
            for member in members[name]:
                for fqn in graph.expand_param_name(member.name, member.layer):
                    replicated[fqn] = reason
    return {
        "split_fraction": split / total if total else 0.0,
        "layer_matmul_split_fraction": layer_split / layer_total if layer_total else 0.0,
        "min_fraction": rule.min_fraction,
        "replicated": dict(sorted(replicated.items())),
    }


# what the data axis runs for one parameter's gradient (and, sharded, its weights) at each ZeRO stage
_SYNC_WORDS = {
    0: "all_reduce of the gradient",
    1: "reduce_scatter of the gradient, all_gather of the weights",
    2: "reduce_scatter of the gradient per micro-batch, all_gather of the weights",
    3: "reduce_scatter of the gradient per micro-batch, all_gather of the weights per forward and backward",
}


# the sharded program with overlap: gradient buckets from backward (stages 0, 1: the last micro-batch's; 2, 3: every
# micro-batch's), gathers issued ahead of use
_OVERLAP_SYNC_WORDS = {
    0: "all_reduce of the gradient (bucketed, from backward)",
    1: "reduce_scatter of the gradient (bucketed, from backward), all_gather of the weights",
    2: "reduce_scatter of the gradient per micro-batch (bucketed, from backward), all_gather of the weights",
    3: "reduce_scatter of the gradient per micro-batch (bucketed, from backward), all_gather of "
    "the weights per forward and backward",
}


# a ZeRO-1 pipeline stage with overlap (`ShardingProgram.step_gathers`)
_STEP_GATHER_WORDS = "reduce_scatter of the gradient (bucketed, once a step), all_gather of the weights (once a step)"


def exposed_fraction(res: MeshResult) -> float:
    """The share of the data axis's sync that the step waits for: E / sum(Sync) of `add_overlap_constraint` at the
    optimum `res` (its grad_sync_s is E, its grad_sync_hidden_s the rest), 1 where nothing is hidden."""
    whole = res.grad_sync_s + res.grad_sync_hidden_s
    return res.grad_sync_s / whole if res.grad_sync_hidden_s > 0 and whole > 0 else 1.0


def layer_ops_report(
    prog: ShardingProgram, chosen: dict[str, int], stage: int, exposed: float = 1.0
) -> tuple[dict, ...]:
    """Per deduplicated layer of `prog`'s layout `chosen` (and one entry for what runs outside the layers):
    its parameters and ops with their placements on the tensor axis, and the collectives the layout inserts,
    as the program priced them.

    An entry is {"layer": container ("" outside the layers), "num_layers": layers it stands for, "ops": [...]};
    an op is {"node", "op", "strategy", "inputs", "output", "collectives"}; a collective is {"kind", "axis",
    "pass" ("forward", "backward" or "step"), "arg", "from", "bytes" (the full tensor on one data-parallel rank
    for one micro-batch), "time_s" (one run), "per_step" (runs per step: layers x micro-batches)}. Followers
    (views, elementwise ops that keep their producer's layout) without a collective are left out.

    `exposed` (`exposed_fraction`): where overlap hides part of the data axis's sync, each parameter's dp (or dp/ep)
    collective also carries "exposed_s", the part of one run the step waits for. The program prices the overlap
    for the step as a whole (E of `add_overlap_constraint`), not per bucket, so the exposed time is apportioned
    pro rata to each parameter's sync time: exposed_s = time_s x E / sum(Sync). The one bucket latency a step
    pays (`sync_floor`; on the sharded program with overlap, one latency per step) is in no row; its exposed
    share is the rest of E. With the sharded program's overlap a row's time is its `sharded_sync_parts` summed.
    """
    graph = prog.graph
    found = _tensor_axis_collectives(prog, chosen)
    entries: dict[str, dict] = {}
    for node in graph.graph.nodes:
        name = node.name
        if graph.representative.get(name) != name or name not in prog.group_of or not graph.layer_count.get(name):
            continue
        gname = prog.group_of[name]
        grp, k = prog.groups[gname], chosen[gname]
        kind = graph.kinds.get(name)
        ops = list(found.get(name, ()))
        if kind == NodeKind.PARAM and prog.dp > 1:
            ops += _data_axis_collectives(prog, name, k, stage, exposed)
        if kind not in (NodeKind.PARAM, NodeKind.COMPUTE) or (gname != name and not ops):
            continue
        container = graph.node_layer.get(name, (None, None))[0] or ""
        entry = entries.setdefault(container, {"layer": container, "num_layers": 0, "ops": []})
        entry["num_layers"] = max(entry["num_layers"], graph.layer_count[name] if container else 1)
        entry["ops"].append(
            {
                "node": graph.params[name].name if kind == NodeKind.PARAM else name,
                "op": "parameter" if kind == NodeKind.PARAM else _short_target(node),
                "strategy": grp.strategies[k].name if gname == name else "follows " + gname,
                "inputs": [placement_str(pl) for pl in grp.need[name][k]],
                "output": placement_str(grp.out[name][k]),
                "collectives": ops,
            }
        )
    return tuple(sorted(entries.values(), key=lambda e: e["layer"] == ""))


def _source(prog: ShardingProgram, name: str) -> str:
    """A parameter by its name in the model, anything else by its node."""
    params = prog.graph.params
    return params[name].name if name in params else name


def _tensor_axis_collectives(prog: ShardingProgram, chosen: dict[str, int]) -> dict[str, list]:
    """Consumer node -> the tensor-axis collectives layout `chosen` inserts before it: each edge's forward and
    backward redistribution, and the gather before a follower that cannot keep its producer's layout."""
    graph, tp_link = prog.graph, prog.tp_link
    found: dict[str, list] = defaultdict(list)
    for (gp, p, gc, c, i), mult in prog.mesh_groups.edges().items():
        src = prog.groups[gp].out[p][chosen[gp]]
        need, grad = prog.groups[gc].need[c][chosen[gc]][i], prog.groups[gc].grads[c][chosen[gc]][i]
        nbytes = prog.mesh_groups.act_bytes(graph.node(p))
        for when, a, b in (("forward", src, need), ("backward", grad, grad_layout(src))):
            t = redistribute_time(a, b, nbytes, prog.tp, tp_link)
            if t:
                found[c].append(
                    _collective(
                        redistribute_kind(a, b), "tp", when, i, _source(prog, p), a, b, nbytes, t, mult * prog.mb
                    )
                )
    for grp in prog.groups.values():
        for member, gathers in grp.follow_fwd_s.items():
            if gathers[chosen[grp.leader]]:
                (arg,) = tensor_args(graph.node(member))
                src, nbytes = grp.out[arg.name][chosen[grp.leader]], prog.mesh_groups.act_bytes(arg)
                t = redistribute_time(src, R, nbytes, prog.tp, tp_link)
                kind, per_step = redistribute_kind(src, R), grp.count * prog.mb
                found[member].append(
                    _collective(kind, "tp", "forward", 0, _source(prog, arg.name), src, R, nbytes, t, per_step)
                )
    return found


def _data_axis_collectives(prog: ShardingProgram, name: str, k: int, stage: int, exposed: float) -> list[dict]:
    """Parameter group `name`'s data-axis collectives at strategy k and ZeRO stage `stage`, as one row (none
    without a sync): the words of what runs, its bytes and time, and its exposed share (`layer_ops_report`)."""
    t = prog.sync_time(name, k, stage)
    comm = prog.comm(stage)
    if t and comm.overlaps_data_axis:
        t = sum(prog.prices.sharded_sync_parts(name, k, stage))  # as the overlapping sharded program runs them
    if not t:
        return []
    local = prog.prices.local_numel(name, k)
    words = (
        "all_reduce of the gradient (bucketed)"
        if comm.buckets_all_reduce
        else _STEP_GATHER_WORDS
        if comm.gathers_once_a_step
        else (_OVERLAP_SYNC_WORDS if comm.overlaps_data_axis else _SYNC_WORDS)[stage]
    )
    row = {
        "kind": words,
        "axis": EXPERT_SYNC_AXIS if prog.prices.is_expert(name) else "dp",
        "pass": "step",
        "arg": None,
        "from": _source(prog, name),
        "bytes": local * prog.precision.grad_bytes,
        "time_s": t,
        "per_step": prog.groups[name].count,
    }
    return [row | ({"exposed_s": t * exposed} if exposed < 1.0 else {})]


def _collective(
    kind: Collective,
    axis: str,
    when: str,
    arg: int,
    source: str,
    a: Placement,
    b: Placement,
    nbytes: float,
    time_s: float,
    per_step: float,
) -> dict:
    return {
        "kind": str(kind),
        "axis": axis,
        "pass": when,
        "arg": arg,
        "from": source,
        "placements": f"{placement_str(a)} -> {placement_str(b)}",
        "bytes": float(nbytes),
        "time_s": time_s,
        "per_step": per_step,
    }


def _short_target(node: fx.Node) -> str:
    """aten.mm.default -> mm, aten.add.Tensor -> add.Tensor."""
    text = str(node.target).removeprefix("aten.")
    return text.removesuffix(".default")


def _kept_whole_reason(prog: ShardingProgram, name: str, in_layer: bool, is_matmul: bool) -> str:
    """Why parameter `name` stays whole on the tensor axis, in words for the report."""
    if not any(isinstance(s.output, Shard) for s in prog.groups[name].strategies):
        return f"no dimension divisible by tp={prog.tp}"
    if in_layer:
        return f"splitting it prices dearer and tp_min_split={prog.tensor_split.min_fraction:g} allows it whole"
    if is_matmul:
        return "matmul outside the layers (LM head): splitting it prices dearer"
    if len(prog.graph.params[name].meta.shape) == 1:
        return "a vector (norm weight or bias): splitting it prices dearer"
    return "not a matmul weight (embedding or table): splitting it prices dearer"


def format_bytes(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (so small budgets do not read as 0.00 GiB)."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.2f} MiB"


def mesh_words(data: int, tp: int, cp: int) -> str:
    """'dp=2 cp=2 tp=1' for a data axis of `data` ranks (dp·cp of them) as a user pins the mesh."""
    return f"dp={data // cp} cp={cp} tp={tp}" if cp > 1 else f"dp={data} tp={tp}"


def infeasible_message(bounds, budget, offload=False, advice=None) -> str:
    """Say how much memory the leanest layout needs per device, next to the budget, and what to do.

    `bounds` holds (bytes, mesh words, micro-batches, parts, recompute mode) of every program considered;
    the figure is each program's lower bound (every choice at its leanest), so "at least" is exact. `advice`:
    a caller whose program rules out some of the usual remedies (host offload, ZeRO) says what to do instead,
    as `advice(parts, budget)` of the leanest layout's memory parts; None gives the advice of a free layout.
    """
    if not bounds:
        return "no layout satisfies the constraints"
    total, mesh, m, parts, mode = min(bounds, key=lambda b: b[0])
    if total <= budget:  # memory is not what stops it
        return (
            f"no layout satisfies the constraints, though memory would allow one (at least "
            f"{format_bytes(total)} of {format_bytes(budget)} per device at {mesh}); loosen the pins"
        )
    recompute = "no activation recompute" if mode == "none" else f"{mode} activation recompute"
    if offload is False:
        recompute += ", nothing offloaded to the host (offload=False)"
    else:
        recompute += ", optimizer states and gradients on the host as far as host memory allows"
    return (
        f"the model needs at least {format_bytes(total)} per device (model states "
        f"{format_bytes(parts['states'])}, activations {format_bytes(parts['activations'])}, working memory "
        f"{format_bytes(parts['transient'])}, at {mesh} with {m} micro-batch(es), states sharded "
        f"as far as allowed and {recompute}), but the budget is {format_bytes(budget)} per device: "
        f"{format_bytes(total - budget)} short; "
        + (
            advice(parts, budget)
            if advice is not None
            else "raise memory_budget, use more devices or a smaller batch"
            + ("" if offload is not False else ", or allow host offload (offload=None)")
        )
    )

"""The decision groups of one (dp, tp) mesh: every op's strategies on the tensor axis, what each costs in compute,
and the sizes the program's terms are made of.

A group is a leader node (a parameter, an input, an op) with the followers merged into it: views and unary ops whose
placement follows from their producer's, so that they add no variable. Identical layers share the groups of their
first layer (`OpGraph.representative`); a group's count says how many layers it stands for. Edges join a producer's
group to a consumer's, with their multiplicity.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.cost_model.devices import LinkSpec
from autopar.errors import ConfigError
from autopar.ir import NodeKind, OpGraph, output_meta, tensor_args
from autopar.passes import sharding_rules as rules
from autopar.passes.context_parallel import CPPricing, is_attention
from autopar.passes.parallelize import launches_early, local_op_targets
from autopar.passes.sharding.graph import analysis, batch_split_nodes, frozen_weight_matmuls, layer_matmul_weights
from autopar.passes.sharding.reshard import R, grad_layout, reshard_memo
from autopar.passes.sharding_rules import OpStrategy


@dataclass
class Group:
    """A decision group: a leader node and the followers whose placement derives from it."""

    leader: str
    strategies: list[OpStrategy]
    count: int
    members: list[str] = field(default_factory=list)
    # per member node: per strategy k, output placement / required argument placements / argument gradients
    out: dict[str, list[Placement]] = field(default_factory=dict)
    need: dict[str, list[tuple[Placement, ...]]] = field(default_factory=dict)
    grads: dict[str, list[tuple[Placement, ...]]] = field(default_factory=dict)
    divisor: dict[str, list[int]] = field(default_factory=dict)
    extra_s: list[float] = field(default_factory=list)
    # per follower: per strategy k, the forward part of extra_s (a gather before it), which recompute repeats
    follow_fwd_s: dict[str, list[float]] = field(default_factory=dict)


_OP_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _estimator_memo(estimator) -> dict:
    """The (node, divisor) -> (forward, backward) seconds `estimator` gave, kept while it lives: an estimator is a
    pure function of the node and the divisor, and one plan's programs (meshes, stage views, micro-batch counts) ask
    it the same questions again and again. A fresh dict (no sharing) for an estimator that takes no weak reference."""
    try:
        found = _OP_TIMES.get(estimator)
        if found is None:
            found = _OP_TIMES[estimator] = {}
    except TypeError:
        return {}
    return found


class MeshGroups:
    """The decision groups of one mesh at m micro-batches (see the module docstring).

    Args:
        graph: the traced model.
        tp: the tensor axis's size; `tp_link` its link.
        data_ranks: ranks on the data axis (dp·cp), which split the batch with the micro-batches.
        batch: the global batch (dim 0 of the inputs); `num_microbatches` per data-parallel rank.
        estimator: a ComputeEstimator (forward and backward seconds of an op's share of work).
        cp: a cp plan's attention pricing (None without a cp axis).
    """

    def __init__(
        self,
        graph: OpGraph,
        *,
        tp: int,
        tp_link: LinkSpec,
        data_ranks: int,
        batch: int,
        num_microbatches: int,
        estimator,
        cp: CPPricing | None = None,
    ):
        self.graph, self.tp, self.tp_link = graph, tp, tp_link
        self._reshard = reshard_memo(tp_link)  # redistribute_time on this link, shared with every equal link's
        self.batch, self.mb = batch, num_microbatches
        self.estimator, self.cp = estimator, cp
        self.batch_split = batch_split_nodes(graph, batch)
        self.batch_div = data_ranks * num_microbatches  # how many pieces a batch-split value is cut into
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}
        self._cp_costs: dict = {}  # (attention node, head divisor) -> CPAttentionCost
        # (node, divisor) -> the estimator's (forward, backward) seconds, shared by every program priced with it
        self._op_times = _estimator_memo(estimator)
        self._build_groups()

    def rep(self, name: str) -> str:
        return self.graph.representative[name]

    def _build_groups(self) -> None:
        g = self.graph
        for node in g.graph.nodes:
            if g.representative[node.name] != node.name or node.op == "output":
                continue
            kind = g.kinds[node.name]
            if kind == NodeKind.PARAM:
                self._new_group(node, self._param_strategies(node))
            elif kind == NodeKind.INPUT:
                self._new_group(node, self._input_strategies(node))
            elif kind in (NodeKind.BUFFER, NodeKind.CONSTANT):
                self._new_group(node, [OpStrategy((), R)])
            elif rules.is_follower(node) and self._can_merge(node):
                self._merge_follower(node)
            else:
                self._new_group(node, rules.strategies_for(node, self.tp))

    def _param_strategies(self, node: fx.Node) -> list[OpStrategy]:
        meta = output_meta(node)
        out = [OpStrategy((), R)]
        if self.tp > 1:
            out += [OpStrategy((), Shard(d)) for d, s in enumerate(meta.shape) if s % self.tp == 0]
        return out

    def _input_strategies(self, node: fx.Node) -> list[OpStrategy]:
        meta = output_meta(node)
        out = [OpStrategy((), R)]
        if self.tp > 1 and meta is not None and meta.shape and (meta.shape[0] // self.batch_div) % self.tp == 0:
            out.append(OpStrategy((), Shard(0)))
        return out

    def _new_group(self, node: fx.Node, strategies: list[OpStrategy]) -> None:
        grp = Group(node.name, strategies, self.graph.layer_count[node.name])
        grp.extra_s = [0.0] * len(strategies)
        self._add_member(
            grp,
            node,
            [s.output for s in strategies],
            [s.inputs for s in strategies],
            [s.grad_placements() for s in strategies],
            [s.divisor for s in strategies],
        )
        self.groups[node.name] = grp

    def _add_member(self, grp, node, out, need, grads, divisor) -> None:
        grp.members.append(node.name)
        grp.out[node.name], grp.need[node.name] = out, need
        grp.grads[node.name], grp.divisor[node.name] = grads, divisor
        self.group_of[node.name] = grp.leader

    def _can_merge(self, node: fx.Node) -> bool:
        (arg,) = tensor_args(node)
        src = self.rep(arg.name)
        return (
            src == arg.name
            and src in self.group_of
            and self.graph.layer_count[src] == self.graph.layer_count[node.name]
            and self.graph.kinds[src] == NodeKind.COMPUTE
        )

    def _merge_follower(self, node: fx.Node) -> None:
        (arg,) = tensor_args(node)
        grp = self.groups[self.group_of[arg.name]]
        nbytes = self.act_bytes(arg)
        out, need, grads, div = [], [], [], []
        for k, src in enumerate(grp.out[arg.name]):
            o = rules.follow(node, src, self.tp)
            if o is None:  # the follower cannot keep this layout: gather first, then run replicated
                gather = self._reshard.time(src, R, nbytes, self.tp) * grp.count * self.mb
                grp.extra_s[k] += gather
                grp.follow_fwd_s.setdefault(node.name, [0.0] * len(grp.strategies))[k] += gather
                o, src = R, R
            out.append(o)
            need.append((src,))
            grads.append((grad_layout(src),))
            div.append(self.tp if isinstance(o, Shard) else 1)
        self._add_member(grp, node, out, need, grads, div)

    def act_bytes(self, node: fx.Node) -> float:
        """Full bytes of a value on one dp rank for one micro-batch (activations are split over dp and
        micro-batches; parameters are not)."""
        meta = output_meta(node)
        if meta is None:
            return 0.0
        kind = self.graph.kinds.get(node.name)
        if kind in (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.CONSTANT):
            return float(meta.nbytes)
        if node.name in self.batch_split:
            return meta.nbytes / self.batch_div
        return float(meta.nbytes)

    def op_times(self, node: fx.Node, divisor: int) -> tuple[float, float]:
        """(forward, backward) seconds of one node per step (all micro-batches)."""
        if node.op != "call_function":
            return 0.0, 0.0
        # every op runs once per micro-batch, on 1 / (dp * micro-batches) of the batch when it carries it
        meta = output_meta(node)
        if self.cp is not None and is_attention(node):  # a rank's queries against the whole sequence
            fwd, bwd = self.cp.times(node, self.batch // self.batch_div, divisor)
            return self.mb * fwd, self.mb * bwd
        d = (self.batch_div if self._carries_batch(node) else 1) * divisor
        key = (node, d)
        times = self._op_times.get(key)
        if times is None:
            fwd = self.estimator.forward_time_s(node, d)
            bwd = self.estimator.backward_time_s(node, d) if meta is not None and meta.dtype.is_floating_point else 0.0
            if bwd and node.name in frozen_weight_matmuls(self.graph):  # a frozen weight: no dW GEMM
                only_dx = getattr(self.estimator, "input_gradient_time_s", None)
                # an estimator that times whole backwards (a profile) halves them: dX is one of two equal GEMMs
                bwd = only_dx(node, d) if only_dx is not None else bwd / 2
            times = self._op_times[key] = (fwd, bwd)
        return self.mb * times[0], self.mb * times[1]

    def _carries_batch(self, node: fx.Node) -> bool:
        return node.name in self.batch_split or any(a.name in self.batch_split for a in tensor_args(node))

    def cp_comm_s(self, name: str, divisor: int) -> tuple[float, float]:
        """(exposed, hidden) seconds per step of a cp attention node's communication, heads split by `divisor`: what
        its algorithm's compute does not hide (in its op time, `_op_times`) and what it does (not in the step)."""
        if self.cp is None or not is_attention(self.graph.node(name)):
            return 0.0, 0.0
        c = self.cp_cost(name, divisor)
        return self.mb * c.exposed_comm_s, self.mb * max(c.comm_s - c.exposed_comm_s, 0.0)

    def cp_cost(self, name: str, divisor: int):
        """The cp attention price of attention node `name` on this mesh, per micro-batch, heads split by `divisor`."""
        key = (name, divisor)
        if key not in self._cp_costs:
            self._cp_costs[key] = self.cp.cost(self.graph.node(name), self.batch // self.batch_div, divisor)
        return self._cp_costs[key]

    def edges(self):
        """(producer group, producer node, consumer group, consumer node, argument index) -> multiplicity.

        The grouping of nodes does not depend on the mesh, so the edges are found once per graph.
        """
        cache = analysis(self.graph)
        if "edges" in cache and cache["edges"][0] == self.group_of:
            return cache["edges"][1]
        edges: dict[tuple[str, str, str, str, int], float] = defaultdict(float)
        for node in self.graph.graph.nodes:
            if node.op != "call_function":
                continue
            c = self.rep(node.name)
            if c not in self.group_of:
                continue
            for i, a in enumerate(tensor_args(node)):
                p = self.rep(a.name)
                if p not in self.group_of:
                    continue
                gp, gc = self.group_of[p], self.group_of[c]
                if gp == gc and self.groups[gc].leader != c and i == 0 and rules.is_follower(self.graph.node(c)):
                    continue  # a follower's own input: priced when it was merged
                edges[(gp, p, gc, c, i)] += self.graph.edge_weight(a.name, node.name)
        cache["edges"] = (dict(self.group_of), edges)
        return edges

    def edge_prices(self, edge: tuple, mult: float, eta: float) -> tuple[list, list, list]:
        """(cost, forward, hidden): per producer strategy k and consumer strategy m, the seconds per step edge
        `edge` (producer group, producer, consumer group, consumer, argument) of multiplicity `mult` adds,
        n_e (Rf + Rb - H); the forward resharding a recompute of the consumer repeats, n_e Rf; and H, what a
        collective launched early hides behind the ops before its consumer at overlap efficiency `eta` (0: none is
        launched early): H = eta min(Rf - Rf_fix, W) (`early_window`), its latency (Rf_fix) never hidden."""
        gp, p, gc, c, i = edge
        gpr, gcr = self.groups[gp], self.groups[gc]
        nbytes = self.act_bytes(self.graph.node(p))
        window = self.early_window(p, c) if eta else 0.0
        cost = [[0.0] * len(gcr.strategies) for _ in gpr.strategies]
        fwd_cost = [[0.0] * len(gcr.strategies) for _ in gpr.strategies]
        hidden = [[0.0] * len(gcr.strategies) for _ in gpr.strategies]
        reshard, tp = self._reshard.time, self.tp
        for k, src in enumerate(gpr.out[p]):
            for m in range(len(gcr.strategies)):
                need, grad = gcr.need[c][m][i], gcr.grads[c][m][i]
                fwd = reshard(src, need, nbytes, tp)
                bwd = reshard(grad, grad_layout(src), nbytes, tp)
                hid = 0.0
                if window and fwd:
                    fix = reshard(src, need, 1.0, tp)
                    hid = eta * min(max(fwd - fix, 0.0), window)
                cost[k][m] = mult * self.mb * (fwd + bwd - hid)
                fwd_cost[k][m] = mult * self.mb * fwd
                hidden[k][m] = mult * self.mb * hid
        return cost, fwd_cost, hidden

    def early_window(self, p: str, c: str) -> float:
        """W: forward seconds of one micro-batch between node `p` and `c`, its only consumer, when the interpreter
        launches the collective of `p`'s value where it is made (`parallelize.launches_early`): the ops in between,
        each at its cheapest strategy (a lower bound of what the plan runs there); 0 where it does not."""
        cache = analysis(self.graph)
        if "order" not in cache:
            nodes = list(self.graph.graph.nodes)
            cache["order"] = ({n: i for i, n in enumerate(nodes)}, nodes, local_op_targets())
        order, nodes, local = cache["order"]
        node = self.graph.node(p)
        user = next(iter(node.users)) if len(node.users) == 1 else None
        if user is None or user.name != c or not launches_early(node, order, local):
            return 0.0
        total = 0.0
        for n in nodes[order[node] + 1 : order[user]]:
            grp = self.groups.get(self.group_of.get(n.name, ""))
            if grp is not None and n.name in grp.divisor:
                total += min(self.op_times(n, d)[0] for d in grp.divisor[n.name]) / self.mb
        return total

    def param_groups(self) -> list[str]:
        return [n for n in self.groups if self.graph.kinds[n] == NodeKind.PARAM]

    def tp_numel(self, name: str, k: int) -> float:
        """Elements of parameter `name` on one rank of the tensor axis under its strategy k (whole, or 1/tp)."""
        pl = self.groups[name].strategies[k].output
        return self.graph.params[name].meta.numel / (self.tp if isinstance(pl, Shard) else 1)

    def member_bytes(self, grp: Group, member: str, k: int) -> float:
        pl = grp.out[member][k]
        return self.act_bytes(self.graph.node(member)) / (self.tp if isinstance(pl, Shard) else 1)

    def splittable_weights(self) -> list[str]:
        """The layer matmul weights (representatives) with a placement split on the tensor axis."""
        if self.tp == 1:
            return []
        return [
            w
            for w in sorted(layer_matmul_weights(self.graph))
            if w in self.groups and any(isinstance(s.output, Shard) for s in self.groups[w].strategies)
        ]

    def pinned_strategies(self, pins: dict[str, str]) -> dict[str, int]:
        """Parameter group -> the strategy its pinned placement (`pins`: parameter name -> placement string, the
        user's `param_placements`) names; ConfigError when a pin names no parameter, a placement it cannot take, or
        two placements for one set of identical layers."""
        if not pins:
            return {}
        names = {}
        for node_name, info in self.graph.params.items():
            for fqn in self.graph.expand_param_name(info.name, info.layer):
                names[fqn] = self.graph.representative[node_name]
        out: dict[str, int] = {}
        for fqn, text in pins.items():
            if fqn not in names:
                raise ConfigError(f"constraints['param_placements'] names {fqn!r}, which is no parameter of the model")
            grp = self.groups[names[fqn]]
            ks = [k for k, st in enumerate(grp.strategies) if rules.placement_str(st.output) == text]
            if not ks:
                shape = self.graph.params[names[fqn]].meta.shape
                raise ConfigError(
                    f"constraints['param_placements'][{fqn!r}]={text!r}: a parameter of shape {shape} "
                    f"takes one of {[rules.placement_str(st.output) for st in grp.strategies]} "
                    f"on a tensor axis of {self.tp}"
                )
            if out.get(names[fqn], ks[0]) != ks[0]:
                raise ConfigError(
                    f"constraints['param_placements'] pins identical layers' {fqn!r} two ways; "
                    f"identical layers share one placement"
                )
            out[names[fqn]] = ks[0]
        return out

"""Bytes a device holds: model states (`StateMemory`), and what the program's communication holds besides them.

    M_state   parameter, gradient and optimizer bytes of a parameter's local shard under ZeRO stage s: weights
              split over the data axis from stage 3, gradients from stage 2, optimizer states from stage 1
    overlap   ZeRO-1 that reduces once a step keeps each split parameter's whole fp32 gradient
              (`overlap_grad_bytes`); ZeRO-2/3 with overlap hold the gradient buckets of one backward in flight
              (`in_flight_grad_bytes`); weights gathered ahead of their use (`prefetch_bytes`)

`StateMemory` takes explicit facts (precision, the data axis's size, the bucket size, a parameter's elements) and no
program, so each figure can be checked by hand.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from autopar.passes.context_parallel import is_attention
from autopar.passes.recompute import recompute_segments, recomputed_nodes
from autopar.passes.sharding.graph import VIEW_OPS, analysis, loss_ancestors, saved_for_backward
from autopar.passes.sharding.groups import MeshGroups
from autopar.passes.sharding.lp_terms import scaled
from autopar.passes.sharding.precision import Precision
from autopar.program_comm import ProgramComm
from autopar.units import BUCKETS_IN_FLIGHT, FP32_BYTES


@dataclass(frozen=True, slots=True)
class StateMemory:
    """Bytes of one parameter's states on a device, and of the gradient buckets and gathered weights a program holds.

    A parameter is given by `numel`, the elements of its local shard on the tensor axis (whole on the data axis).

    Args:
        precision: the bytes of each state.
        data_ranks: ranks on the data axis (dp·cp), over which ZeRO shards the states.
        bucket_bytes: a gradient bucket (`autopar.units.PRICED_BUCKET_BYTES`).
    """

    precision: Precision
    data_ranks: int
    bucket_bytes: float

    def state_bytes(self, numel: float, zero_stage: int, requires_grad: bool = True) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes of one parameter's local shard under `zero_stage`; a frozen
        parameter has weights only."""
        pr, dp = self.precision, self.data_ranks
        params = numel * pr.param_bytes / (dp if zero_stage >= 3 else 1)
        if not requires_grad:
            return params, 0.0, 0.0
        grads = numel * pr.grad_bytes_at(zero_stage) / (dp if zero_stage >= 2 else 1)
        opt = numel * pr.optimizer_bytes / (dp if zero_stage >= 1 else 1)
        return params, grads, opt

    def overlap_grad_bytes(self, comm: ProgramComm, numel: float, requires_grad: bool = True) -> float:
        """Gradient bytes a ZeRO-1 program that reduces once a step (`ProgramComm.accumulates_whole_grads`) holds
        beyond `state_bytes`': it accumulates each split parameter's whole gradient in its master's format (fp32) on
        every rank until the last micro-batch's buckets reduce-scatter it (`runtime.sharded`), where `state_bytes`
        counts the gradient as reduce-scattered in the compute format. ZeRO-2/3 reduce-scatter every micro-batch's
        gradients and hold whole ones only while their bucket fills (`in_flight_grad_bytes`, per step, not per
        parameter). Device memory only: the offload program (ZeRO-3 chunks) keeps `state_bytes`' gradients."""
        if not comm.accumulates_whole_grads or not requires_grad:
            return 0.0
        return max(numel * FP32_BYTES - self.state_bytes(numel, comm.zero_stage)[1], 0.0)

    def bucket_sizes(self, numels: list[float], zero_stage: int) -> list[float]:
        """The gradient buckets in launch order, as bytes in the format they are reduced in at `zero_stage`, of
        parameters of `numels` elements given in the order backward completes their gradients
        (`autopar.program_comm.gradient_order`): a bucket is closed once it holds `bucket_bytes` (so it may exceed
        them by its last member)."""
        sizes: list[float] = []
        for numel in numels:
            if not sizes or sizes[-1] >= self.bucket_bytes:
                sizes.append(0.0)
            sizes[-1] += numel * self.precision.grad_bytes_at(zero_stage)
        return sizes

    def in_flight_grad_bytes(self, comm: ProgramComm, sizes: list[float]) -> float:
        """Gradient bytes ZeRO-2/3 with overlap hold beyond `state_bytes`': the buckets (`sizes`, in launch order) of
        one micro-batch's backward (`runtime.sharded`). A bucket's send buffer (B_j bytes, the compute format) is made
        when its first gradient comes in, backward writing its members' gradients into it (no other whole copy); at
        its launch the oldest bucket in flight is waited for if W = `units.BUCKETS_IN_FLIGHT` are, and this rank's
        piece (B_j / dp) is made; both live until it is waited for. So:

            max_j max( B_j + (1 + 1/dp) (B_{j-1} + ... + B_{j-W}),          bucket j filling
                       (1 + 1/dp) (B_j + B_{j-1} + ... + B_{j-W+1}) )      bucket j launched
        """
        if not (comm.reduces_every_microbatch and comm.overlaps_data_axis):
            return 0.0
        w, both = BUCKETS_IN_FLIGHT, 1.0 + 1.0 / self.data_ranks

        def launched(first: int, last: int) -> float:  # buckets first..last (indices clipped at 0), in flight
            return both * sum(sizes[max(first, 0) : last + 1])

        return max((max(b + launched(j - w, j - 1), launched(j - w + 1, j)) for j, b in enumerate(sizes)), default=0.0)

    def prefetch_bytes(self, prefetch_depth: int, layer_numels: list[float]) -> float:
        """Weights gathered ahead of their use: `prefetch_depth` times the largest layer's (of `layer_numels`, its
        trainable elements), in the compute format."""
        return prefetch_depth * max(layer_numels, default=0.0) * self.precision.param_bytes


class ActivationMemory:
    """Bytes of activations one device holds under each recompute mode r, per micro-batch of activations alive.

        M_saved      bytes of a group's outputs kept for backward under r, split over dp and, where the output is
                     sharded, over tp. A value is kept when a consumer outside R_r saves it, or when it enters a
                     segment from outside (the checkpoint keeps its inputs); values made and used inside one segment
                     are dropped. Under full recompute a layer keeps its input only (Korthikanti et al.'s 2sbh per
                     layer, plus shared masks)
        M_recompute  the values the first segment recomputed in backward holds again: the largest segment's
                     (identical layers share one expression, so it is usually one row)
        M_transient  working memory of the largest op

    Args:
        groups: the mesh's decision groups (their sizes, and cp attention's buffers).
        activation_copies: micro-batches whose saved activations are alive at once (1; a pipeline schedule keeps
            more).
    """

    def __init__(self, groups: MeshGroups, activation_copies: float = 1.0):
        self.mesh_groups, self.graph = groups, groups.graph
        self.activation_copies = activation_copies
        self._bounds: dict[str, tuple[float, float]] = {}

    def transient_bytes(self) -> float:
        """Working memory of the largest op: its output plus its gradient, unsharded on tp (an upper bound).

        Views (an expanded mask, a transposed weight) own no storage and are left out. An op the loss is not
        computed from gets no gradient: logits a model returns beside a fused loss are made in the forward (their
        bytes count) and dropped before backward, which never makes their gradient.
        """
        cache = analysis(self.graph)
        if "storage_nodes" not in cache:  # representatives only: a deduplicated node has its representative's shape
            cache["storage_nodes"] = [
                n
                for n in self.graph.graph.nodes
                if n.op == "call_function" and self.graph.layer_count[n.name] and str(n.target) not in VIEW_OPS
            ]
            cache["loss_ancestors"] = loss_ancestors(self.graph.graph)
        on_loss = cache["loss_ancestors"]
        largest = max(
            ((1 + (node in on_loss)) * self.mesh_groups.act_bytes(node) for node in cache["storage_nodes"]),
            default=0.0,
        )
        if self.mesh_groups.cp is None:
            return largest
        # cp attention's buffers while it runs (upper bound: heads not split on tp)
        attention = [n.name for n in cache["storage_nodes"] if is_attention(n)]
        return max([largest] + [self.mesh_groups.cp_cost(n, 1).peak_extra_bytes for n in attention])

    def saved_bytes(self, name: str, k: int, recompute: str = "none") -> float:
        """M_saved: bytes group `name` keeps for backward under strategy k and `recompute`, on one device, for one
        micro-batch.

        A cp attention member adds what its algorithm keeps besides its inputs and output (the gathered K/V of
        all-gather, the head-split copies of all-to-all), unless `recompute` runs it again in backward.
        """
        grp, saved = self.mesh_groups.groups[name], saved_for_backward(self.graph, recompute)
        total = sum(self.mesh_groups.member_bytes(grp, m, k) for m in grp.members if m in saved)
        if self.mesh_groups.cp is not None:
            again = recomputed_nodes(self.graph.graph, recompute) if recompute != "none" else {}
            total += sum(
                self.mesh_groups.cp_cost(m, grp.divisor[m][k]).saved_bytes
                for m in grp.members
                if m not in again and is_attention(self.graph.node(m))
            )
        return total

    def recomputed_saves(self, recompute: str) -> list[list[tuple[str, str]]]:
        """Per distinct segment: the (group, member) values it makes again in backward, once per micro-batch.

        Those kept with no recompute that `recompute` drops; segments of identical layers share their
        representatives' groups and appear once.
        """
        if recompute == "none":
            return []
        dropped = saved_for_backward(self.graph, "none") - saved_for_backward(self.graph, recompute)
        rep, group_of = self.mesh_groups.rep, self.mesh_groups.group_of
        out, seen = [], set()
        for seg in recompute_segments(self.graph.graph, recompute):
            reps = tuple(
                sorted(
                    {rep(n) for n in seg if rep(n) in dropped and rep(n) in group_of and self.graph.layer_count[rep(n)]}
                )
            )
            if reps and reps not in seen:
                seen.add(reps)
                out.append([(group_of[r], r) for r in reps])
        return out

    def lower_bound(self, recompute: str) -> tuple[float, float]:
        """(saved activations, recomputed segment) at their leanest under `recompute`: every group at its leanest
        strategy, each chosen on its own."""
        if recompute not in self._bounds:
            groups, member_bytes = self.mesh_groups.groups, self.mesh_groups.member_bytes
            acts = self.activation_copies * sum(
                grp.count * min(self.saved_bytes(name, k, recompute) for k in range(len(grp.strategies)))
                for name, grp in groups.items()
            )
            peak = max(
                (
                    sum(min(member_bytes(groups[g], m, k) for k in range(len(groups[g].strategies))) for g, m in seg)
                    for seg in self.recomputed_saves(recompute)
                ),
                default=0.0,
            )
            self._bounds[recompute] = (acts, peak)
        return self._bounds[recompute]

    def fixed(self, choice: dict[str, int], recompute: str) -> tuple[float, float]:
        """(M_saved, M_recompute) of the layout `choice` (strategy per group) under `recompute`, without solving."""
        groups, member_bytes = self.mesh_groups.groups, self.mesh_groups.member_bytes
        acts = self.activation_copies * sum(
            grp.count * self.saved_bytes(name, choice[name], recompute) for name, grp in groups.items()
        )
        peak = max(
            (sum(member_bytes(groups[g], m, choice[g]) for g, m in seg) for seg in self.recomputed_saves(recompute)),
            default=0.0,
        )
        return acts, peak

    def layer_saved_bytes(self, choice: dict[str, int]) -> float:
        """Bytes the repeated layers keep for backward with nothing recomputed, all layers together, for the layout
        `choice`: what offloading their activations moves."""
        saved, nbytes = saved_for_backward(self.graph, "none"), 0.0
        for name, grp in self.mesh_groups.groups.items():
            k = choice[name]
            for m in grp.members:
                if self.graph.node_layer.get(m, (None, None))[0] is None:
                    continue
                if m in saved:
                    nbytes += grp.count * self.mesh_groups.member_bytes(grp, m, k)
        return self.activation_copies * nbytes


class RecomputeTerms:
    """What running forwards again costs under recompute mode r: the forward seconds of every recomputed member
    (`forward_s`, filled as the program prices compute) and of the resharding its arguments need (`edge_forward`,
    filled as it prices edges), and the weights recompute gathers again (`regathered`).

        sum_g n_g sum_{m in g, m in R_r} sum_k x[g,k] T_fwd[m,k]  +  sum_{e into R_r} n_e sum_{k,l} y[e,k,l] Rf[e,k,l]
    """

    def __init__(self, groups: MeshGroups):
        self.mesh_groups, self.graph = groups, groups.graph
        self.forward_s: dict[str, dict[str, list[float]]] = defaultdict(dict)  # group -> member -> n_g * F[k]
        # (consumer, n_e * Rf, y or x, the (group, strategy) pairs the variable stands for)
        self.edge_forward: list[tuple[str, float, object, tuple]] = []

    def forward_terms(self, recompute: str, x: dict) -> list:
        """The objective terms of the forwards and resharding `recompute` runs again, over strategy variables `x`."""
        rec = recomputed_nodes(self.graph.graph, recompute)
        terms = []
        for name, members in self.forward_s.items():
            grp = self.mesh_groups.groups[name]
            for m, fwd in members.items():
                if m not in rec:
                    continue
                gather = grp.follow_fwd_s.get(m)
                for k, t in enumerate(fwd):
                    t += gather[k] if gather else 0.0
                    if t:
                        terms.append(scaled(t, x[name][k]))
        terms += [scaled(coef, var) for c, coef, var, _ in self.edge_forward if c in rec]
        return terms

    def fixed_forward_s(self, choice: dict[str, int], recompute: str) -> float:
        """`forward_terms` evaluated at the layout `choice` (strategy per group), without solving."""
        rec = recomputed_nodes(self.graph.graph, recompute)
        seconds = 0.0
        for name, members in self.forward_s.items():
            gather = self.mesh_groups.groups[name].follow_fwd_s
            for m, fwd in members.items():
                if m in rec:
                    seconds += fwd[choice[name]] + (gather[m][choice[name]] if gather.get(m) else 0.0)
        return seconds + sum(
            coef for c, coef, _, cond in self.edge_forward if c in rec and all(choice[g] == k for g, k in cond)
        )

    def lower_bound(self, recompute: str) -> float:
        """Seconds recompute mode r adds at least: every recomputed group at its cheapest forward."""
        rec = recomputed_nodes(self.graph.graph, recompute)
        total = 0.0
        for name, members in self.forward_s.items():
            per_k = [
                sum(fwd[k] for m, fwd in members.items() if m in rec)
                for k in range(len(self.mesh_groups.groups[name].strategies))
            ]
            total += min(per_k, default=0.0)
        return total

    def regathered(self, recompute: str) -> list[str]:
        """The trainable parameter groups recompute mode r's recomputed nodes read: the weights a program that
        gathers at each use (`ProgramComm.gathers_at_each_use`) gathers again (its overlapping program holds each
        gathered weight for the step; ZeRO-3's recompute takes the place of the backward's gather, in `sync_time`)."""
        if recompute == "none":
            return []
        rec = recomputed_nodes(self.graph.graph, recompute)
        read = {
            a.name for n in self.graph.graph.nodes if n.name in rec for a in n.all_input_nodes if a.op == "placeholder"
        }
        return [g for g in self.mesh_groups.param_groups() if g in read and self.graph.params[g].requires_grad]

    def layer_forward_s(self, choice: dict[str, int]) -> float:
        """Seconds of the repeated layers' forward, all layers together, for the layout `choice`."""
        seconds = 0.0
        for name, grp in self.mesh_groups.groups.items():
            k = choice[name]
            for m in grp.members:
                if self.graph.node_layer.get(m, (None, None))[0] is None:
                    continue
                seconds += self.forward_s.get(name, {}).get(m, [0.0] * (k + 1))[k]
        return seconds

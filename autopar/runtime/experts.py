"""The expert-parallel program: a data-parallel plan whose mixture-of-experts layers split their experts over ep.

A plan with `expert_parallel["degree"] = ep > 1` runs the whole model on every rank, as the data-parallel
program does, except the experts: the data axis's ranks are cut into groups of ep consecutive ranks (Megatron-Core
carves its expert groups from the data-parallel ranks the same way), and rank j of a group holds experts
[j·E/ep, (j+1)·E/ep) of every MoE layer, whole. The router, its top-k and its weights run on each rank's own tokens
exactly as in one process (an auxiliary balancing loss read from the router counts the routed tokens of every rank:
`autopar.runtime.expert_routing`); only the experts' computation moves:

1. dispatch: each (token, chosen expert) pair is sorted by expert and sent, by an all-to-all over the ep group
   with the counts of each pair (dropless: every routed token is computed, however uneven the routing), to the
   rank holding the expert;
2. the experts' own module (Hugging Face's, with its activation and its implementation) runs on the received
   rows with this rank's slice of the weights and each row's local expert index;
3. combine: the outputs go back by the reverse all-to-all, are put back in pair order and summed over each
   token's k experts with the router's weights, as the single-process block sums them.

Backward runs the two all-to-alls in reverse (autograd). An expert's gradient on its rank then holds every
token of the ep group routed to it; the ranks holding the same experts (one per ep group, dp / ep of them) sum
it by an all-reduce of their own, the other gradients are all-reduced over the whole data axis as before.

The rewrite (`expert_parallel_pass`) replaces each experts module's nodes in the traced graph by one
`call_module` of an `ExpertDispatch`: the graph keeps running plain tensors, and the expert weights stay
placeholders (this rank's slices).

In checkpoints (`checkpoint_masters`) an expert weight is the local shard of a DTensor over the (replica, ep) mesh of
the program's groups, sharded on dim 0; Hugging Face weights assemble the blocks whole.

Not yet: a tensor, pipeline or context axis, ZeRO, recompute or offload with ep (the planner refuses them); a
capacity factor; `forward()` outside a step (the experts are split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from autopar.checkpoint.pieces import dtensor_piece
from autopar.cluster import ClusterSpec
from autopar.errors import LoweringError
from autopar.loss import LOSS_SCALE
from autopar.plan import Plan, ProgramKind
from autopar.runtime.collectives import new_group, waiting_for
from autopar.runtime.data_parallel import DataParallelProgram
from autopar.runtime.expert_routing import (
    global_label_count_pass,
    global_routing_counts_pass,
    warn_local_aux_loss,
)
from autopar.trace import TracedModel, module_path_of


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with split sizes on dim 0; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with waiting_for("an all-to-all of routed tokens over the expert-parallel group"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        with waiting_for("the backward all-to-all of routed tokens over the expert-parallel group"):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertDispatch(torch.nn.Module):
    """One MoE layer's experts on this rank: dispatch, its experts' module on its weight slices, combine.

    Called as the experts module is (hidden [T, H], top-k index [T, k], top-k weights [T, k]) followed by this
    rank's slices of the module's expert weights, in `weight_names` order.
    """

    def __init__(self, experts: torch.nn.Module, weight_names: tuple[str, ...], num_experts: int, ep: int, group):
        super().__init__()
        self._experts = (experts,)  # boxed: its (full) parameters are not this graph's
        self.weight_names, self.num_experts, self.ep, self._group = weight_names, num_experts, ep, group
        self.per_rank = num_experts // ep

    def forward(self, hidden, top_k_index, top_k_weights, *weights):
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert, hence by the rank that holds it
        source = hidden[torch.div(order, k, rounding_mode="floor")]
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(per_expert)
        with waiting_for("the all-to-all of routed-token counts over the expert-parallel group"):
            dist.all_to_all_single(received, per_expert, group=self._group)
        send = per_expert.view(self.ep, self.per_rank).sum(1).tolist()
        received = received.view(self.ep, self.per_rank)  # [source rank, local expert]
        recv = received.sum(1).tolist()
        rows = _AllToAll.apply(source, recv, send, self._group)
        local = torch.arange(self.per_rank, device=flat.device).repeat(self.ep)
        local = torch.repeat_interleave(local, received.reshape(-1)).unsqueeze(1)
        ones = torch.ones(local.shape, dtype=top_k_weights.dtype, device=local.device)
        params = dict(zip(self.weight_names, weights, strict=True))
        out = torch.func.functional_call(self._experts[0], params, (rows, local, ones))
        back = _AllToAll.apply(out, send, recv, self._group)
        pairs = back[torch.argsort(order)].view(tokens, k, -1)
        return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1).to(hidden.dtype)


def expert_parallel_pass(
    gm: fx.GraphModule, example_inputs, *, dispatch: dict[str, ExpertDispatch], param_nodes: dict[str, str]
) -> fx.GraphModule:
    """Replace each experts module's nodes by one `call_module` of its `ExpertDispatch`.

    Expects a traced graph in which the nodes of experts module `path` (`module_path_of` at or under it) read the
    module's weight placeholders (`param_nodes`: parameter name -> placeholder name), the hidden states [T, H] and
    the router's top-k index (integer) and weights [T, k] from outside, and give one value to the rest of the graph.
    Guarantees each such module is one node of the same value, its weights still placeholders.
    """
    del example_inputs
    for index, (path, module) in enumerate(dispatch.items()):
        inside = [n for n in gm.graph.nodes if n.op == "call_function" and _within(module_path_of(n), path)]
        if not inside:
            raise LoweringError(f"expert parallelism: no op of the traced graph runs in {path!r}")
        members = set(inside)
        outputs = [n for n in inside if any(u not in members for u in n.users)]
        if len(outputs) != 1:
            raise LoweringError(f"expert parallelism: {path!r} gives {len(outputs)} values to the graph, expected 1")
        weights = [param_nodes[f"{path}.{name}"] for name in module.weight_names]
        outside = {a for n in inside for a in n.all_input_nodes if a not in members and a.name not in weights}
        hidden, top_k_index, top_k_weights = _roles(outside, path)
        name = f"expert_dispatch_{index}"
        gm.add_submodule(name, module)
        by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        with gm.graph.inserting_before(outputs[0]):
            call = gm.graph.call_module(name, (hidden, top_k_index, top_k_weights, *(by_name[w] for w in weights)))
        call.meta = dict(outputs[0].meta)
        outputs[0].replace_all_uses_with(call)
        for node in reversed(inside):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _roles(outside: set, path: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(hidden states, top-k index, top-k weights) among the values an experts module reads, by dtype and shape."""
    metas = {n: n.meta.get("val") for n in outside}
    index = [n for n, v in metas.items() if v is not None and not v.is_floating_point()]
    floats = [n for n, v in metas.items() if v is not None and v.is_floating_point()]
    if len(index) == 1 and len(floats) == 2:
        k = metas[index[0]].shape[-1]
        weights = [n for n in floats if metas[n].shape == metas[index[0]].shape]
        hidden = [n for n in floats if metas[n].shape[-1] != k]
        if len(weights) == 1 and len(hidden) == 1:
            return hidden[0], index[0], weights[0]
    found = ", ".join(f"{n.name} {tuple(v.shape) if v is not None else '?'}" for n, v in metas.items())
    raise LoweringError(
        f"expert parallelism: {path!r} should read hidden states [T, H] and the router's top-k index and weights "
        f"[T, k] (Hugging Face's experts signature); it reads {found}"
    )


class ExpertParallelProgram(DataParallelProgram):
    """A dp x 1 plan with its experts split over ep groups of the data axis (module docstring)."""

    kind = ProgramKind.EXPERT_PARALLEL

    def __init__(
        self, model: torch.nn.Module, plan: Plan, traced: TracedModel, cluster: ClusterSpec, *, optimizer=None
    ):
        info = plan.expert_parallel
        ep, dp, rank = info["degree"], plan.mesh["dp"], dist.get_rank()
        # every rank creates every group, in one order: the ep groups (consecutive ranks), then the replica groups
        ep_groups = [new_group(list(range(g, g + ep))) for g in range(0, dp, ep)]
        replicas = [new_group(list(range(j, dp, ep))) if dp > ep else None for j in range(ep)]
        ep_rank = rank % ep
        modules = {p.rsplit(".", 1)[0] for p in info["params"]}
        named = dict(model.named_parameters(remove_duplicate=False))
        per_rank = info["num_experts"] // ep
        # set before the base builds the masters (`master`): which model tensors this rank keeps a slice of
        object.__setattr__(
            self, "_expert_slice", {id(named[p]): (ep_rank * per_rank, per_rank) for p in info["params"]}
        )
        object.__setattr__(
            self,
            "_dispatch",
            {
                m: ExpertDispatch(
                    model.get_submodule(m),
                    tuple(p.rsplit(".", 1)[1] for p in info["params"] if p.rsplit(".", 1)[0] == m),
                    info["num_experts"],
                    ep,
                    ep_groups[rank // ep],
                )
                for m in sorted(modules)
            },
        )
        object.__setattr__(self, "_replica_group", replicas[ep_rank])
        object.__setattr__(self, "_expert_names", frozenset(info["params"]))
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, ep_groups[rank // ep]
        self.num_experts = info["num_experts"]
        object.__setattr__(
            self, "_expert_mesh", _expert_mesh(self.device_type, dp, ep, self.ep_group, replicas[ep_rank])
        )

    def master(self, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter's master: this rank's experts only, for an expert weight."""
        start, count = self._expert_slice.get(id(tensor), (None, None))
        return super().master(tensor if start is None else tensor.narrow(0, start, count))

    def _bind_trace(self, traced: TracedModel) -> None:
        super()._bind_trace(traced)
        placeholders = [n for n in self._gm.graph.nodes if n.op == "placeholder"]
        params = [n.name for n, kind in zip(placeholders, traced.placeholder_kinds, strict=True) if kind == "param"]
        expert_parallel_pass(
            self._gm, None, dispatch=self._dispatch, param_nodes=dict(zip(traced.param_names, params, strict=True))
        )
        num_experts = next(iter(self._dispatch.values())).num_experts
        global_routing_counts_pass(self._gm, None, num_experts=num_experts, group=self.group, num_ranks=self.dp)
        # a model's loss of more than the cross-entropy, averaged over the ranks (`expert_routing`); a user's loss
        # is weighed by its own token counts (`autopar.loss`)
        user_loss = any(LOSS_SCALE in path for path in traced.user_input_paths)
        if not self._counted and not user_loss:
            global_label_count_pass(self._gm, None, group=self.group, num_ranks=self.dp)
        warn_local_aux_loss(self._model_box[0], self._gm.meta["autopar_routing_counts"], self.plan.num_microbatches)

    def _is_expert(self, tensor: torch.Tensor) -> bool:
        return any(tensor is t for t in self._expert_tensors())

    def _expert_tensors(self) -> list[torch.Tensor]:
        names = self.traced.param_names
        return [t for n, t in zip(names, self._bucketed, strict=True) if n in self._expert_names]

    def reduce_group_of(self, tensor: torch.Tensor):
        """The group a gradient bucket holding `tensor` is all-reduced over: an expert's replicas, else the data
        axis."""
        return self._replica_group if self._is_expert(tensor) else self.group

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        experts = {id(p) for n, p in zip(self.traced.param_names, self.params, strict=True) if n in self._expert_names}
        return [
            (p.grad, self.dp // self.ep if id(p) in experts else self.dp) for p in self.params if p.grad is not None
        ]

    def forward(self, *args, **kwargs):
        raise NotImplementedError(
            "forward() outside a step is not available with expert parallelism yet (each rank holds a share of the "
            "experts); use eval_step"
        )

    # ---------------------------------------------------------------------------------- states

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        out = super()._full_parameters()
        for name in sorted(self._expert_names):
            local = out[name].contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ep)]
            with waiting_for(f"the all-gather of expert weight {name} over the expert-parallel group"):
                dist.all_gather(parts, local, group=self.ep_group)
            out[name] = torch.cat(parts)
        return out

    def checkpoint_masters(self) -> dict:
        """The data-parallel program's pieces, but for an expert weight: this rank's block of experts on dim 0, the
        local shard of a DTensor sharded over ep and replicated over the ranks holding the same experts (so DCP
        writes each block once and reshards it on load, and Hugging Face weights assemble the blocks)."""
        out = super().checkpoint_masters()
        replicated = (Replicate(),) if self._expert_mesh.ndim == 2 else ()
        for name in self._expert_names:
            piece = out[name]
            shape = (self.num_experts, *piece.tensor.shape[1:])
            out[name] = dtensor_piece(
                piece.tensor, shape, self._expert_mesh, (*replicated, Shard(0)), param=piece.param
            )
        return out


def _expert_mesh(device_type: str, dp: int, ep: int, ep_group, replica_group) -> DeviceMesh:
    """The (replica, ep) mesh of the groups the program made (rank g·ep + j: row g, column j), 1-D over ep when
    dp == ep: what the expert weights are DTensors over in a checkpoint. No new process group."""
    if replica_group is None:
        return DeviceMesh.from_group(ep_group, device_type, mesh_dim_names=("ep",))
    layout = torch.arange(dp).view(dp // ep, ep)
    return DeviceMesh.from_group([replica_group, ep_group], device_type, layout, mesh_dim_names=("replica", "ep"))

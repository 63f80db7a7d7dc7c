"""The data-parallel program: what a plan with no tensor axis and replicated states compiles to.

When the plan's mesh is dp x 1 with ZeRO stage 0, every rank holds the whole model and the only
communication is the gradient all-reduce. Running that through DTensor, op by op, buys nothing
and costs host time on every op, so this program runs the exported graph itself, traced at the
shape one rank sees (its share of one micro-batch), on plain tensors, and reduces gradients the
way DDP does: in buckets, one all-reduce per bucket, after the last micro-batch.

Every gradient is a view into its bucket's flat buffer (DDP's `gradient_as_bucket_view`): the
backward accumulates straight into the buckets, so a step neither concatenates the gradients
before the all-reduce nor copies them back after it, and clearing them is one fill per bucket.
Only parameters the graph uses get a view: a parameter that never receives a gradient keeps
`grad=None`, so the optimizer skips it as it would without this program.

The loss stays exact with uneven ignored labels: a graph pass (`sum_loss_pass`) turns a mean
cross-entropy output into its sum and adds the count of kept labels as an output; the step
divides the all-reduced gradient sums by the all-reduced count (the count travels in the last
bucket, so it costs no extra collective). A loss that is not a cross-entropy is taken as a mean
over samples: equal shares, so the mean over ranks and micro-batches is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.errors import LoweringError
from autopar.passes.fused_ops import emit_fused_loss_sum
from autopar.plan import Plan
from autopar.runtime import flat_inputs, micro_batches, placeholder_values
from autopar.trace import TracedModel, trace_model

aten = torch.ops.aten
BUCKET_BYTES = 25 * 2**20  # gradient bucket size (DDP's default)


def sum_loss_pass(gm: fx.GraphModule, example_inputs, *, loss_index: int) -> fx.GraphModule:
    """Turn output `loss_index`, when it is a mean cross-entropy, into its sum; append the kept-label count.

    Leaves the graph unchanged (and `gm.meta["autopar_loss_count"]` False) for any other loss.
    """
    del example_inputs
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    loss = outs[loss_index]
    gm.meta["autopar_loss_count"] = False
    fused = emit_fused_loss_sum(gm.graph, loss) if isinstance(loss, fx.Node) else None
    if fused is not None:  # autopar::linear_cross_entropy (kernel fusion): the same sum and count
        outs[loss_index] = fused[0]
        out.args = (tuple(outs) + (fused[1],),)
        gm.meta["autopar_loss_count"] = True
        gm.graph.lint()
        gm.recompile()
        return gm
    if not isinstance(loss, fx.Node) or loss.target != aten.cross_entropy_loss.default:
        return gm
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    bound = dict(zip(names, loss.args, strict=False)) | dict(loss.kwargs)
    if bound.get("weight") is not None or bound.get("reduction", 1) != 1:
        return gm
    ignore = bound.get("ignore_index", -100)
    with gm.graph.inserting_after(loss):
        total = gm.graph.call_function(aten.cross_entropy_loss.default,
                                       (bound["input"], bound["target"], None, 2, ignore,
                                        bound.get("label_smoothing", 0.0)))  # fmt: skip
    with gm.graph.inserting_after(total):
        kept = gm.graph.call_function(aten.ne.Scalar, (bound["target"], ignore))
    with gm.graph.inserting_after(kept):
        count = gm.graph.call_function(aten.sum.default, (kept,))
    outs[loss_index] = total
    out.args = (tuple(outs) + (count,),)
    if not loss.users:
        gm.graph.erase_node(loss)
    gm.meta["autopar_loss_count"] = True
    gm.graph.lint()
    gm.recompile()
    return gm


def drop_assertions_pass(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """Remove the graph's `_assert_tensor_metadata` checks (export's record of `.to()` calls).

    They check, on every call, the dtype and device the trace already fixed; each costs a dispatch and
    returns nothing, so no other node depends on them.
    """
    del example_inputs
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def fold_constants_pass(gm: fx.GraphModule, example_inputs, *, constant_placeholders: set[str]) -> fx.GraphModule:
    """Compute once what depends only on constants; the graph then reads the results as attributes.

    A node folds when it is an op whose every input is a placeholder named in `constant_placeholders`
    (buffers no step changes, lifted constants) or a folded node, and it is not random. In a Hugging
    Face decoder that is the causal mask and the rotary cos/sin tables: a quarter of the forward's ops,
    the same on every step. `example_inputs` are the placeholder values in order; every folded node
    that an unfolded one uses becomes a buffer of `gm` holding its value (tensors only: a node of
    another value stays, and so do the folded nodes it needs).
    """
    folded: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        inputs = node.all_input_nodes
        if all(a in folded or (a.op == "placeholder" and a.name in constant_placeholders) for a in inputs):
            folded.add(node)
    frontier = [n for n in folded if any(u not in folded for u in n.users)]
    if not frontier:
        return gm
    env = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs, strict=True))
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node in folded:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)
    for i, node in enumerate(frontier):
        value = env[node]
        if not isinstance(value, torch.Tensor):
            continue
        name = f"_autopar_folded_{i}"
        gm.register_buffer(name, value.detach().clone(), persistent=False)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr, delete_user_cb=lambda user: user not in folded)
    for node in reversed(list(gm.graph.nodes)):
        if node in folded and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


class DataParallelProgram(torch.nn.Module):
    """A dp x 1 plan on this rank: the whole model, the exported graph run directly, bucketed all-reduce.

    Same surface as `ParallelModule`: `train_step`, `forward`, `state_dict`, `parameters`, `plan`,
    `optimizer`.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, example_inputs, example_kwargs, *, optimizer=None,
                 device: str = "cpu"):  # fmt: skip
        super().__init__()
        self.device = device
        dp, m = plan.mesh["dp"], plan.num_microbatches
        if plan.mesh.get("tp", 1) != 1 or dp != dist.get_world_size():
            raise LoweringError(f"the data-parallel program needs a dp x 1 mesh over all ranks, got {plan.mesh}")
        self.plan, self.dp, self.rank = plan, dp, dist.get_rank()
        self._model_box = (model,)  # for forward(); boxed so that its parameters are not this module's
        args, kwargs = micro_batches(example_inputs, example_kwargs, plan.global_batch_size, dp * m)[0]
        self.traced: TracedModel = trace_model(model, args, kwargs)
        if plan.fusion.get("enabled"):
            from autopar.passes.fused_ops import fuse_traced

            self.traced = fuse_traced(self.traced)
        self._num_mutated = self.traced.num_mutated_outputs
        self._gm = sum_loss_pass(drop_assertions_pass(self.traced.graph_module, None), None,
                                 loss_index=self._num_mutated)  # fmt: skip
        self._counted = self._gm.meta["autopar_loss_count"]
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(named[n].detach().to(device, copy=True), requires_grad=named[n].requires_grad)
            for n in self.traced.param_names
        )
        self._buffers_list = [buffers[n].detach().to(device, copy=True) for n in self.traced.buffer_names]
        self._constants = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                           for k, v in self.traced.exported.constants.items()}  # fmt: skip
        self._aliases = dict(self.traced.param_aliases)
        self._state_names = list(model.state_dict().keys())
        make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.optimizer = make_opt(list(self.params))
        self._buckets = self._gradient_buckets()
        # Placeholder values but the user inputs, fixed for the program's life (parameters are updated in place):
        # a step fills in the inputs instead of walking the signature again.
        kinds = self.traced.placeholder_kinds
        self._input_slots = [i for i, kind in enumerate(kinds) if kind == "input"]
        self._placeholders = placeholder_values(self.traced, list(self.params), self._buffers_list, self._constants.get,
                                                [None] * len(self._input_slots))  # fmt: skip
        # Buffers no step writes (this program does not write mutated ones back either) and lifted constants.
        placeholders = [n.name for n in self._gm.graph.nodes if n.op == "placeholder"]
        constant = {name for name, kind in zip(placeholders, kinds, strict=True) if kind in ("buffer", "constant")}
        if self._num_mutated == 0:
            self._gm = fold_constants_pass(self._gm, self._placeholders, constant_placeholders=constant)

    def _gradient_buckets(self) -> list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, torch.Tensor]]]]:
        """(flat buffer, [(parameter, its gradient view)]) per bucket of about BUCKET_BYTES, in parameter order.

        Parameters of one dtype share buckets. The last bucket of a fp32/fp64 model has two more
        elements, where the loss sum and the label count ride (see `_all_reduce_grads`).
        """
        placeholders = [n for n in self._gm.graph.nodes if n.op == "placeholder"]
        used = [bool(n.users) for n, kind in zip(placeholders, self.traced.placeholder_kinds, strict=True)
                if kind == "param"]  # fmt: skip
        trainable = [p for p, u in zip(self.params, used, strict=True) if p.requires_grad and u]
        groups: list[list[torch.nn.Parameter]] = []
        size = BUCKET_BYTES
        for p in trainable:
            if size >= BUCKET_BYTES or p.dtype != groups[-1][0].dtype:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        self._ride = bool(groups) and all(g[0].dtype in (torch.float32, torch.float64) for g in groups)
        buckets = []
        for i, group in enumerate(groups):
            extra = 2 if self._ride and i == len(groups) - 1 else 0
            flat = torch.zeros(sum(p.numel() for p in group) + extra, dtype=group[0].dtype, device=self.device)
            views, offset = [], 0
            for p in group:
                views.append((p, flat[offset:offset + p.numel()].view_as(p)))
                offset += p.numel()
            buckets.append((flat, views))
        return buckets

    def _zero_grads(self) -> None:
        """Clear the buckets and (re)attach every gradient view; an optimizer's zero_grad may have dropped them."""
        for flat, views in self._buckets:
            flat.zero_()
            for p, view in views:
                if p.grad is not view:
                    p.grad = view

    # ------------------------------------------------------------------------------------ running

    def _local_micro_batches(self, args, kwargs) -> list[list]:
        """This rank's share of each micro-batch, as flat input lists in placeholder order."""
        out = []
        for mb_args, mb_kwargs in micro_batches(args, kwargs, self.plan.global_batch_size, self.plan.num_microbatches):
            local = []
            for t in flat_inputs(self.traced, mb_args, mb_kwargs):
                if isinstance(t, torch.Tensor):
                    t = (t.chunk(self.dp, dim=0)[self.rank] if t.ndim else t).to(self.device).contiguous()
                local.append(t)
            out.append(local)
        return out

    def train_step(self, *args, **kwargs) -> float:
        """One optimizer step on a global batch (every rank passes the same batch); returns the loss."""
        self._zero_grads()
        losses, counts = [], []
        for flat in self._local_micro_batches(args, kwargs):
            values = list(self._placeholders)
            for slot, value in zip(self._input_slots, flat, strict=False):
                values[slot] = value
            outs = self._gm(*values)
            loss = outs[self._num_mutated]
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                raise LoweringError("the model's first output is not a scalar loss: pass labels so the model "
                                    "computes one")  # fmt: skip
            loss.backward()
            losses.append(loss.detach())
            counts.append(outs[-1] if self._counted else None)
        self._all_reduce_grads(losses, counts)
        self.optimizer.step()
        return float(self._last_loss)

    def _totals(self, losses: list[torch.Tensor], counts: list) -> torch.Tensor:
        """[loss sum, label count] of this rank's micro-batches, in fp64 (a count of None stands for 1)."""
        loss = losses[0].double() if len(losses) == 1 else torch.stack(losses).double().sum()
        if all(c is None for c in counts):
            count = torch.tensor(float(len(counts)), dtype=torch.float64, device=self.device)
        else:
            count = torch.stack([c if c is not None else torch.ones((), device=self.device) for c in counts])
            count = count.double().sum()
        return torch.stack([loss, count])

    def _all_reduce_grads(self, losses: list[torch.Tensor], counts: list) -> None:
        """Sum the gradient buckets over the ranks, the loss and the count riding in the last one; divide by the count.

        They ride in the gradients' own format when it holds integers exactly up to 2^24 (fp32, fp64); a
        16-bit bucket would round the count, so then they travel alone in fp64.
        """
        totals = self._totals(losses, counts)
        for i, (flat, _) in enumerate(self._buckets):
            ride = self._ride and i == len(self._buckets) - 1
            if ride:
                flat[-2:].copy_(totals)
            if self.dp > 1:
                dist.all_reduce(flat)
            if ride:
                totals = flat[-2:].double()
        if not self._ride and self.dp > 1:
            dist.all_reduce(totals)
        loss_sum, count = totals.tolist()
        self._last_loss = loss_sum / count
        for flat, _ in self._buckets:
            flat.mul_(1.0 / count)

    def forward(self, *args, **kwargs):
        """Run the model on any batch with this program's parameters (every rank computes the whole batch)."""
        names = self.traced.param_names
        state = {n: p for n, p in zip(names, self.params, strict=True)}
        state.update({other: state[graph] for other, graph in self._aliases.items() if graph in state})
        state.update(dict(zip(self.traced.buffer_names, self._buffers_list, strict=True)))
        return torch.func.functional_call(self._model_box[0], state, args, kwargs)

    # ---------------------------------------------------------------------------------- states

    def state_dict(self, *args, **kwargs) -> dict:  # noqa: ARG002 - the nn.Module signature
        """Full tensors under the original names (every rank holds them whole)."""
        params = dict(zip(self.traced.param_names, self.params, strict=True))
        buffers = dict(zip(self.traced.buffer_names, self._buffers_list, strict=True))
        out = {}
        for name in self._state_names:
            key = self._aliases.get(name, name)
            if key in params:
                out[name] = params[key].detach().cpu().clone()
            elif name in buffers:
                out[name] = buffers[name].cpu().clone()
        return out

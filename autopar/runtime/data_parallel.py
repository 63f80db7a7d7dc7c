"""The data-parallel program: what a plan with no tensor axis and replicated states compiles to.

When the plan's mesh is dp x 1 with ZeRO stage 0, every rank holds the whole model and the only
communication is the gradient all-reduce. Running that through DTensor, op by op, buys nothing
and costs host time on every op, so this program runs the exported graph itself, traced at the
shape one rank sees (its share of one micro-batch), on plain tensors, and reduces gradients the
way DDP does: in buckets, one all-reduce per bucket, launched (asynchronously) from the last
micro-batch's backward as soon as a bucket's gradients are all in, so communication overlaps the rest
of backward; the step waits for them before the optimizer runs.

Every gradient is a view into its bucket's flat buffer (DDP's `gradient_as_bucket_view`): the
backward accumulates straight into the buckets, so a step neither concatenates the gradients
before the all-reduce nor copies them back after it. A step starts with no gradients attached:
the first gradient of a parameter (which autograd hands over as a tensor of its own) is copied
into its view and the view attached, later micro-batches add into it, and a bucket's members that
got no gradient are zeroed when it is launched; so no step fills the buckets with zeros only to
add the gradients into them. Only parameters the graph uses get a view: a parameter that never
receives a gradient keeps `grad=None`, so the optimizer skips it as it would without this program.

The loss stays exact with uneven ignored labels: a graph pass (`sum_loss_pass`) turns a mean
cross-entropy output into its sum and adds the count of kept labels as an output; the count (with the
loss sum) is all-reduced on its own before the last micro-batch's backward, which hides it, and each
bucket is divided by it before its all-reduce, as DDP divides before it reduces, so that no pass over
the gradients is left after the last wait. A loss that is not a cross-entropy is taken as a mean
over samples: equal shares, so the mean over ranks and micro-batches is exact.

Under mixed precision the graph computes with compute-format copies of the masters (made again from
the masters before each forward). With fp32 reduction (the default) the buckets are the masters' fp32
gradients: each copy's gradient is added into its master's bucket view as soon as autograd has
accumulated it (and then dropped), so micro-batches accumulate in fp32 and the all-reduce is fp32. With
the compute format pinned (`plan.grad_reduce`), the buckets hold the copies' gradients, are reduced in
that format, and are cast into the masters' gradients after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.checkpoint.pieces import Piece
from autopar.cluster import ClusterSpec
from autopar.passes.program_graph import (
    copy_graph_module,
    drop_assertions_pass,
    eval_pass,
    fold_constants_pass,
    sum_loss_pass,
)
from autopar.plan import Plan, ProgramKind
from autopar.program_comm import ProgramComm, gradient_order
from autopar.runtime.base import Program, check_scalar_loss, compiled, flat_inputs, placeholder_values, rank_rows
from autopar.runtime.collectives import new_group, waiting_for
from autopar.trace import TracedModel
from autopar.units import BUCKET_BYTES


class DataParallelProgram(Program):
    """A dp x 1 plan on this rank: the whole model, the exported graph run directly, bucketed all-reduce."""

    kind = ProgramKind.DATA_PARALLEL

    @classmethod
    def trace_parts(cls, plan: Plan) -> int:
        return plan.mesh["dp"] * plan.num_microbatches  # one rank's share of one micro-batch

    def __init__(
        self, model: torch.nn.Module, plan: Plan, traced: TracedModel, cluster: ClusterSpec, *, optimizer=None
    ):
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        self.dp, self.rank = plan.mesh["dp"], dist.get_rank()
        # the data axis is every rank (dp x 1): a group of its own, whose waits time out (`collectives`)
        self.group = new_group(list(range(self.dp))) if self.dp > 1 else None
        self.comm = ProgramComm.of_plan(plan, self.kind)
        device = self.device = self.device_type
        self._model_box = (model,)  # for forward(); boxed so that its parameters are not this module's
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(self.master(named[n]), requires_grad=named[n].requires_grad) for n in traced.param_names
        )
        # what the graph computes with: the masters themselves, or their compute-format copies
        mixed = self.compute_dtype is not None
        self._compute = [
            p.detach().to(self.compute_dtype).requires_grad_(p.requires_grad) if mixed else p for p in self.params
        ]
        # what the buckets hold: the copies' gradients when reduced in the compute format, else the masters'
        self._bucketed = self._compute if self.reduce_in_compute else list(self.params)
        self._buffers_list = [buffers[n].detach().to(device, copy=True) for n in traced.buffer_names]
        self._compile_mode: str | None = None  # `compile_graphs`
        self._bind_trace(traced)
        self._buckets = self._gradient_buckets()
        self._pending: list[int] | None = None  # gradients each bucket still awaits on the last micro-batch
        self._totals_now, self._totals_work, self._divisor = None, None, None
        self._launched: list[int] = []
        self._works: list = []
        self._build_optimizer(self.params)

    # what depends on the trace: kept per sequence length (`autopar.runtime.shapes`)
    _per_length = (
        "traced",
        "_gm",
        "_run_gm",
        "_eval_gm",
        "_placeholders",
        "_input_slots",
        "_counted",
        "_num_mutated",
        "_constants",
    )

    def _bind_trace(self, traced: TracedModel) -> None:
        """Run the model as `traced` (the planned length, or another: `autopar.runtime.shapes`): its graph passes,
        and the placeholder values but the user inputs, fixed for the program's life (parameters are updated in
        place): a step fills in the inputs instead of walking the signature again."""
        self.traced = traced
        self._num_mutated = traced.num_mutated_outputs
        self._gm = sum_loss_pass(drop_assertions_pass(traced.graph_module, None), None, loss_index=self._num_mutated)
        self._counted = self._gm.meta["autopar_loss_count"]
        self._constants = {
            k: self.in_compute_format(v.to(self.device)) if isinstance(v, torch.Tensor) else v
            for k, v in traced.exported.constants.items()
        }
        kinds = traced.placeholder_kinds
        self._input_slots = [i for i, kind in enumerate(kinds) if kind == "input"]
        run_buffers = [self.in_compute_format(b) for b in self._buffers_list]
        self._placeholders = placeholder_values(
            traced, self._compute, run_buffers, self._constants.get, [None] * len(self._input_slots)
        )
        # Buffers no step writes (this program does not write mutated ones back either) and lifted constants.
        placeholders = [n.name for n in self._gm.graph.nodes if n.op == "placeholder"]
        constant = {name for name, kind in zip(placeholders, kinds, strict=True) if kind in ("buffer", "constant")}
        if self._num_mutated == 0:
            self._gm = fold_constants_pass(self._gm, self._placeholders, constant_placeholders=constant)
        self._eval_gm = None  # built on the first eval_step
        # what a training step calls: once `compile_graphs` ran, what torch.compile made of it (a new length too)
        self._run_gm = self._gm if self._compile_mode is None else compiled(self._gm, self._compile_mode)

    def _gradient_buckets(self) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """(flat buffer, [(bucketed tensor, its gradient view)]) per bucket of about BUCKET_BYTES.

        Parameters of one dtype share buckets, filled in the order backward completes their gradients, so each
        bucket is ready, and its all-reduce launched, while backward goes on (`_grad_ready`). That order is read
        from the graph (`gradient_order`, as the sharded program's buckets are): a parameter's gradient is
        complete once the backward of its first use in forward has run, so the parameters go in decreasing order of
        their first use (ties, one op reading several, in reverse parameter order). DDP gets the same order by rebuilding its buckets after the first step from the order
        gradients arrived; reverse parameter order alone would put a layer's norm weights, read first and listed
        last, in a bucket that then waits for the whole layer's backward.
        """
        placeholders = [n for n in self._gm.graph.nodes if n.op == "placeholder"]
        params = [
            n.name for n, kind in zip(placeholders, self.traced.placeholder_kinds, strict=True) if kind == "param"
        ]
        index = {name: i for i, name in enumerate(params)}
        used = {n.name for n in placeholders if n.users}
        order = [index[name] for name in gradient_order(self._gm.graph, params) if name in used]
        groups: list[list[torch.Tensor]] = []
        size = BUCKET_BYTES
        for p in (self._bucketed[i] for i in order if self._bucketed[i].requires_grad):
            if size >= BUCKET_BYTES or p.dtype != groups[-1][0].dtype or self._group_changes(p, groups[-1][0]):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        buckets = []
        for group in groups:
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=self.device)
            views, offset = [], 0
            for p in group:
                views.append((p, flat[offset : offset + p.numel()].view_as(p)))
                offset += p.numel()
            buckets.append((flat, views))
        self._bucket_groups = [self.reduce_group_of(group[0]) for group in groups]
        bucket_of = {id(p): (i, view) for i, (_, views) in enumerate(buckets) for p, view in views}
        for bucketed, master, copy in zip(self._bucketed, self.params, self._compute, strict=True):
            if id(bucketed) in bucket_of:
                # the leaf autograd accumulates into: the compute copy under mixed precision, else the bucketed tensor
                leaf = copy if self.compute_dtype is not None else master
                index, view = bucket_of[id(bucketed)]
                leaf.register_post_accumulate_grad_hook(self._grad_ready(bucketed, view, index))
        return buckets

    def reduce_group_of(self, tensor: torch.Tensor):  # noqa: ARG002 - the expert-parallel program's hook
        """The group the bucket holding `tensor` is all-reduced over (None: no other rank holds it)."""
        return self.group

    def _group_changes(self, tensor: torch.Tensor, other: torch.Tensor) -> bool:
        return self.reduce_group_of(tensor) is not self.reduce_group_of(other)

    def _grad_ready(self, bucketed: torch.Tensor, view: torch.Tensor, index: int):
        """A post-accumulate hook: the step's first gradient goes into the bucket view, which becomes the
        gradient (later ones autograd adds into it); a compute copy's gradient goes into its master's fp32
        bucket view (and is dropped, so copies hold no gradient between layers); on the last micro-batch, the
        bucket whose last gradient this was starts its all-reduce."""

        def hook(leaf: torch.Tensor) -> None:
            if leaf is not bucketed:  # fp32 reduction under mixed precision
                if bucketed.grad is view:
                    view.add_(leaf.grad)
                else:
                    view.copy_(leaf.grad)
                    bucketed.grad = view
                leaf.grad = None
            elif leaf.grad is not view:  # the step's first gradient (or a sum autograd made out of place)
                view.copy_(leaf.grad)
                leaf.grad = view
            if self._pending is not None:
                self._pending[index] -= 1
                if self._pending[index] == 0:
                    self._launch(index)

        return hook

    def _launch(self, index: int) -> None:
        """Divide the bucket by the step's divisor, then start its all-reduce (a sum of pre-divided gradients, as
        DDP divides before it reduces): nothing is left to scale after the last wait."""
        self._launched.append(index)
        flat, views = self._buckets[index]
        for p, view in views:
            if p.grad is not view:  # no gradient this step: it reduces zeros, as DDP's buckets do
                view.zero_()
                p.grad = view
        flat.mul_(1.0 / self._step_divisor())
        group = self._bucket_groups[index]
        if self.dp > 1 and group is not None:
            self._works.append((index, dist.all_reduce(flat, group=group, async_op=True)))

    def _step_divisor(self) -> float:
        """The global label count times the loss scale, from the totals all-reduce `_arm` launched (done by now:
        it went out before the last backward)."""
        if self._divisor is None:
            if self._totals_work is not None:
                with waiting_for("the all-reduce of the loss and label count over the data axis (the step's divisor)"):
                    self._totals_work.wait()
                self._totals_work = None
            weight = float(self._totals_now[1])
            self._divisor = (weight if weight > 0 else 1.0) * (self.scaler.scale if self.scaler is not None else 1.0)
        return self._divisor

    def _zero_grads(self) -> None:
        """Detach every gradient: the step's first gradient of each bucketed tensor is copied into its view
        (`_grad_ready`), so the buckets need no clearing."""
        for _, views in self._buckets:
            for p, _ in views:
                p.grad = None

    # ------------------------------------------------------------------------------------ running

    def _refresh_compute(self) -> None:
        """Cast the masters into the compute-format copies the graph reads (mixed precision only)."""
        if self.compute_dtype is not None:
            with torch.no_grad():
                for master, copy in zip(self.params, self._compute, strict=True):
                    copy.copy_(master)

    def _local_micro_batches(self, micro: list[tuple]) -> list[list]:
        """This rank's share of each micro-batch, as flat input lists in placeholder order."""
        out = []
        for mb_args, mb_kwargs in micro:
            local = []
            for t in flat_inputs(self.traced, mb_args, mb_kwargs):
                if isinstance(t, torch.Tensor):
                    t = rank_rows(t, self.dp, self.rank).to(self.device).contiguous()
                local.append(t)
            out.append(local)
        return out

    def _run_one(self, gm, flat: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `gm` on one micro-batch's local inputs; (loss, kept-label count or None)."""
        values = list(self._placeholders)
        for slot, value in zip(self._input_slots, flat, strict=False):
            values[slot] = value
        outs = gm(*values)
        loss = outs[self._num_mutated]
        check_scalar_loss(loss)
        return loss, outs[-1] if self._counted else None

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        """Forward and backward over this rank's micro-batches; the last one's backward launches each bucket's
        all-reduce as soon as the bucket is full, and the step waits for them all here."""
        self._refresh_compute()
        local = self._local_micro_batches(micro)
        losses, counts = [], []
        for i, flat in enumerate(local):
            loss, count = self._run_one(self._run_gm, flat)
            losses.append(loss.detach())
            counts.append(count)
            if i == len(local) - 1:
                self._arm(self._totals(losses, counts))
            self.scaled(loss).backward()
        return self._finish_reduction()

    def _evaluate(self, micro: list[tuple]) -> float:
        if self._eval_gm is None:
            self._eval_gm = eval_pass(copy_graph_module(self._gm), None)
            if self._compile_mode is not None:
                self._eval_gm = compiled(self._eval_gm, self._compile_mode)
        self._refresh_compute()
        results = [self._run_one(self._eval_gm, flat) for flat in self._local_micro_batches(micro)]
        totals = self._totals([loss for loss, _ in results], [count for _, count in results])
        if self.dp > 1:
            with waiting_for("the all-reduce of the eval loss and label count over the data axis"):
                dist.all_reduce(totals, group=self.group)
        loss_sum, count = totals.tolist()
        return loss_sum / count

    def compile_graphs(self, mode: str) -> None:
        self._run_gm = compiled(self._gm, mode)
        self._compile_mode = mode
        if self._eval_gm is not None:
            self._eval_gm = compiled(self._eval_gm, mode)

    def _totals(self, losses: list[torch.Tensor], counts: list) -> torch.Tensor:
        """[loss sum, label count] of this rank's micro-batches, in fp64 (a count of None stands for 1)."""
        loss = losses[0].double() if len(losses) == 1 else torch.stack(losses).double().sum()
        if all(c is None for c in counts):
            count = torch.tensor(float(len(counts)), dtype=torch.float64, device=self.device)
        else:
            count = torch.stack([c if c is not None else torch.ones((), device=self.device) for c in counts])
            count = count.double().sum()
        return torch.stack([loss, count])

    def _arm(self, totals: torch.Tensor) -> None:
        """Before the last backward: the loss sum and label count (fp64) go out in an all-reduce of their own,
        which the last backward hides, so that each bucket can be divided by the global count before it is
        launched, when its last gradient arrives."""
        self._totals_now, self._divisor = totals, None
        self._totals_work = dist.all_reduce(totals, group=self.group, async_op=True) if self.dp > 1 else None
        # without overlap every bucket goes out after backward, in `_finish_reduction`
        self._pending = [len(views) for _, views in self._buckets] if self.comm.overlaps_all_reduce else None
        self._launched, self._works = [], []

    def _finish_reduction(self) -> tuple[float, float]:
        """Launch the buckets backward left unfilled (a parameter without a gradient this step), in bucket order;
        wait for every all-reduce; (loss sum, label count) over the ranks."""
        self._pending = None
        for index in range(len(self._buckets)):
            if index not in self._launched:
                self._launch(index)
        for index, work in self._works:
            with waiting_for(f"the all-reduce of gradient bucket {index} of {len(self._buckets)} over the data axis"):
                work.wait()
        self._works = []  # waited: no handle outlives its step
        self._step_divisor()  # the totals, when no bucket was launched
        loss_sum, count = self._totals_now.tolist()
        return loss_sum, count

    def _scale_gradients(self, weight: float, scale: float) -> None:  # noqa: ARG002 - divided before reduction
        """Hand the gradients, divided by the label count and the loss scale before their all-reduce (`_launch`),
        to the masters."""
        if self.reduce_in_compute:
            for master, copy in zip(self.params, self._compute, strict=True):
                if copy.grad is None:
                    continue
                if master.grad is None:
                    master.grad = copy.grad.to(master.dtype)
                else:
                    master.grad.copy_(copy.grad)

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        return [(g, self.dp) for g in self._gradients()]  # every rank holds every reduced gradient

    def _loss_shards(self) -> int:
        return self.dp * self.plan.num_microbatches  # each rank runs plain tensors on its rows

    def forward(self, *args, **kwargs):
        """Run the model on any batch with this program's parameters (every rank computes the whole batch)."""
        names = self.traced.param_names
        state = {n: p for n, p in zip(names, self.params, strict=True)}
        state.update({other: state[graph] for other, graph in self._aliases.items() if graph in state})
        state.update(dict(zip(self.traced.buffer_names, self._buffers_list, strict=True)))
        return torch.func.functional_call(self._model_box[0], state, args, kwargs)

    # ---------------------------------------------------------------------------------- states

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in zip(self.traced.param_names, self.params, strict=True)}

    def checkpoint_masters(self) -> dict:
        return {
            n: Piece(p.detach(), tuple(p.shape), offsets=(0,) * p.ndim, param=p)
            for n, p in zip(self.traced.param_names, self.params, strict=True)
        }

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.traced.buffer_names, self._buffers_list, strict=True))

    def after_checkpoint_load(self) -> None:
        """The graph's buffer inputs are the buffers just read (in the compute format under mixed precision)."""
        slots = [i for i, kind in enumerate(self.traced.placeholder_kinds) if kind == "buffer"]
        for i, b in zip(slots, self._buffers_list, strict=True):
            self._placeholders[i] = self.in_compute_format(b)

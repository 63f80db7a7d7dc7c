"""The sharded program: the plan's (dp, tp) layout run as a graph of plain local tensors and explicit collectives.

It holds this rank's local shards of the parameters (the masters: what `parameters()` returns and the optimizer
updates). `compile` traces the model at the shape one rank of the data axis runs (its rows of one micro-batch,
`trace_parts`), so no activation carries the data axis; the lowering pass (`passes.lower`) turns that graph and the
plan's tensor-axis placements into a graph of local ATen ops and functional collectives over the tensor-axis group,
once, at construction (with the plan's activation recompute, its layers or attention blocks run as checkpointed
regions). Each step runs that graph on this rank's rows of each micro-batch and backward from its loss. Under mixed
precision each master is cast to the compute format where the graph first reads it, so parameter gathers and
gradient reductions run in that format and gradients reach the masters in fp32.

The loss is exact whatever labels are ignored: the graph's mean cross-entropy becomes its sum with the count of
kept labels (`program_graph.sum_loss_pass`); backward runs from each micro-batch's local sum, the gradients are
summed over the data axis, and the step divides them by the global count (the loss sums and counts go out in one
all-reduce). Another loss is taken as a mean over samples: equal shares of every rank and micro-batch.

With a cp axis the mesh is (dp, cp, tp) and the graph is the one traced for cp
(`autopar.context_parallel.inputs.traced_batch`), cut to one rank's rows: its dp rows' cp chunk, positions and
pre-shifted labels included (`context_parallel.inputs.local_batch`). The data axis is (dp·cp, tp): every per-token
op is unchanged, gradients (and ZeRO shards) are reduced over dp·cp, and attention runs by `cp_attention` over the
cp group with the plan's algorithm.

Overlap (`plan.overlap`, with more than one rank on the data axis) and its prefetch of gathers:
`autopar.runtime.sharded_overlap`. Gathered weights (ZeRO >= 1), kept for the step or released after the forward
(ZeRO-3): `autopar.runtime.sharded_release`; a layer's split weights are gathered in one all-gather
(`autopar.runtime.layer_gather`). `plan.overlap` False keeps the synchronous path: a split weight
gathered at each use (its gradient reduce-scattered by that gather's backward), a replicated one's gradient
all-reduced in the backward of its first read, and one bucketed all-reduce after backward when micro-batches are
accumulated.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar import compat
from autopar.checkpoint.pieces import contiguous_stride, dtensor_piece
from autopar.cluster import ClusterSpec
from autopar.context_parallel.inputs import is_causal_lm, local_batch
from autopar.errors import LoweringError
from autopar.memory.activations import ActivationOffload
from autopar.passes.lower import TensorAxis, convert, lower_pass
from autopar.passes.parallelize import dp_placement, local_shard
from autopar.passes.program_graph import copy_graph_module, drop_assertions_pass, eval_pass, sum_loss_pass
from autopar.passes.recompute import offloaded_nodes
from autopar.passes.sharding_rules import parse_placement, placement_str
from autopar.plan import Plan, ProgramKind
from autopar.program_comm import ProgramComm
from autopar.runtime import overlap
from autopar.runtime.base import (
    Program,
    call_spec,
    check_scalar_loss,
    compiled,
    flat_inputs,
    placeholder_values,
    rank_rows,
    sum_in_buckets,
)
from autopar.runtime.collectives import device_mesh, waiting_for
from autopar.runtime.layer_gather import LayerGathers
from autopar.runtime.sharded_overlap import GradientOverlap
from autopar.runtime.sharded_release import ReleasedWeights
from autopar.trace import TracedModel

R = Replicate()


class _SummedOverData(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient over the data axis (a replicated parameter's gradient
    without overlap or accumulation: reduced where the backward reaches its first read)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = compat.funcol_all_reduce(grad.contiguous(), ctx.group)
        return (out.wait() if hasattr(out, "wait") else out), None


class LoweredRun:
    """The lowered graph of a program and what its lowering recorded (`passes.lower.Lowering`): its recompute
    segments, how many times their bodies ran, the activation-offload hooks, the ops run replicated by the
    fallback rule."""

    def __init__(self, gm: torch.fx.GraphModule, activation_offload: ActivationOffload | None, *, counted: bool):
        self.gm = gm
        self.record = gm.meta["autopar_lowering"]
        self.activation_offload = activation_offload
        self.counted = counted  # the graph's last output is the loss's kept-label count

    @property
    def segments(self) -> tuple[tuple[str, ...], ...]:
        return self.record.segments

    @property
    def segment_calls(self) -> int:
        return self.record.segment_calls

    @property
    def fallback_ops(self) -> set[str]:
        return self.record.fallback_ops

    def __call__(self, *values):
        from autopar.passes import lower

        return lower.run_graph(self.runs, *values)

    @property
    def runs(self):
        """What a step calls: the lowered graph module, or what `torch.compile` made of it (`compile`)."""
        found = getattr(self, "_compiled", None)
        return self.gm if found is None else found

    def compile(self, mode: str) -> None:
        """Run the lowered graph through `torch.compile` in `mode` from now on."""
        self._compiled = compiled(self.gm, mode)


class ShardedProgram(GradientOverlap, ReleasedWeights, LayerGathers, Program):
    """The sharded program of one plan on this rank (see the module docstring)."""

    kind = ProgramKind.SHARDED

    @classmethod
    def runs(cls, plan: Plan) -> bool:
        # a data-parallel layout runs here too (what recompute does to it)
        return plan.program in (ProgramKind.SHARDED, ProgramKind.DATA_PARALLEL)

    @classmethod
    def trace_parts(cls, plan: Plan) -> int:
        # one rank's sequences of one micro-batch; with a cp axis the rank traces its share of them
        # (`tracing.program_trace`), so a batch of fewer sequences than dp·cp ranks still cuts
        return plan.num_microbatches * plan.mesh["dp"]

    def __init__(
        self, model: torch.nn.Module, plan: Plan, traced: TracedModel, cluster: ClusterSpec, *, optimizer=None
    ):
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        dp, tp, cp = plan.mesh["dp"], plan.mesh["tp"], plan.mesh.get("cp", 1)
        self.cp, self.data_ranks = cp, dp * cp  # the data axis: dp·cp ranks
        self._causal_lm = is_causal_lm(model)
        self.cp_mesh: DeviceMesh | None = None
        if cp > 1:
            self.cp_mesh = device_mesh(self.device_type, (dp, cp, tp), ("dp", "cp", "tp"))
        self.mesh: DeviceMesh = device_mesh(self.device_type, (dp * cp, tp), ("dp", "tp"))
        self._dp_group = self.mesh.get_group("dp")
        self._check_plan_matches(traced)
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self._param_names = list(traced.param_names)
        self._placements: list[tuple] = []
        shards = []
        for fqn in self._param_names:
            p = named[fqn]
            tp_pl = parse_placement(plan.param_placements.get(fqn, "R"))
            pl = (dp_placement(tuple(p.shape), self.data_ranks, plan.zero_stage >= 1, tp_pl), tp_pl)
            self._placements.append(pl)
            local = local_shard(self.master(p), self.mesh, pl)
            shards.append(torch.nn.Parameter(local, requires_grad=p.requires_grad))
        self.shards = torch.nn.ParameterList(shards)
        self._shapes = [tuple(named[n].shape) for n in self._param_names]
        self._split_dim = [pl[0].dim if isinstance(pl[0], Shard) else None for pl in self._placements]
        self._buffer_values = [buffers[n].detach().to(self.device_type) for n in traced.buffer_names]
        self._run_buffers = [self.in_compute_format(b) for b in self._buffer_values]
        self.comm = ProgramComm.of_plan(plan, self.kind)  # what it does over the data axis (and how it is priced)
        placeholders = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        names = [p for p, kind in zip(placeholders, traced.placeholder_kinds, strict=True) if kind == "param"]
        self._index_of = {name: i for i, name in enumerate(names)}
        # gradient reductions issued from backward, in buckets (see the module docstring)
        self.overlap = self.comm.overlaps_data_axis
        self._in_backward = False
        self._param_ptrs: set[int] = set()  # storages activation offload keeps where they are
        self._setup_release()
        self._setup_layer_gathers(placeholders, traced.placeholder_kinds)
        if self.overlap:
            self._setup_overlap(placeholders, traced.placeholder_kinds)
        self._compile_mode: str | None = None  # `compile_graphs`
        self._bind_trace(traced)
        self._build_optimizer(self.shards)

    # what depends on the trace: kept per sequence length (`autopar.runtime.shapes`)
    _per_length = ("traced", "_interp", "_eval_interp", "_constants", "_counted", "_recomputed")

    def _bind_trace(self, traced: TracedModel) -> None:
        """Run the model as `traced` (the planned length, or another: `autopar.runtime.shapes`), lowered to local ops
        and collectives with the plan's placements; the parameters, buckets and prefetch groups are the program's
        and stay."""
        self._check_plan_matches(traced)
        placeholders = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        params = [n for n, kind in zip(placeholders, traced.placeholder_kinds, strict=True) if kind == "param"]
        if params != list(self._index_of):
            raise LoweringError(
                "the model traced at this sequence length has other parameter inputs than at the planned one; "
                "compile with an example batch of this length"
            )
        self.traced = traced
        self._constants = {
            k: self.in_compute_format(v.to(self.device_type)) if isinstance(v, torch.Tensor) else v
            for k, v in traced.exported.constants.items()
        }
        self._interp = self._lower(traced.graph_module, train=True)
        if self._compile_mode is not None:
            self._interp.compile(self._compile_mode)
        # split parameters read inside a recompute segment: gathered again in backward
        self._recomputed = {self._index_of[n] for n in self._interp.record.params_in_segments}
        self._eval_interp = None  # built on the first eval_step

    def _check_plan_matches(self, traced: TracedModel) -> None:
        names = {n.name for n in traced.exported.graph.nodes}
        missing = [n for n in self.plan.node_output if n not in names]
        if missing:
            raise LoweringError(
                f"the plan does not belong to this graph: {len(missing)} of its nodes "
                f"(e.g. {missing[:3]}) are not in the traced graph; plan this model again (at this sequence "
                f"length, if it is not the planned one)"
            )

    # ---------------------------------------------------------------------------------------------- lowering

    def _lower(self, gm: torch.fx.GraphModule, *, train: bool) -> LoweredRun:
        """The traced graph (for evaluation: dropout off) lowered to local ops and collectives (`passes.lower`)."""
        gm = drop_assertions_pass(copy_graph_module(gm), None)
        if not train:
            gm = eval_pass(gm, None)
        loss_index = self.traced.num_mutated_outputs
        gm = sum_loss_pass(gm, None, loss_index=loss_index)
        self._counted = gm.meta["autopar_loss_count"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        replicated = (loss_index, len(outputs) - 1) if self._counted else (loss_index,)
        plan = self.plan
        offload = None
        if train and offloaded_nodes(gm.graph, plan.layer_modes):
            offload = ActivationOffload(keep=lambda t: t.untyped_storage().data_ptr() in self._param_ptrs)
        tp = plan.mesh["tp"]
        cp_knobs = {}
        if self.cp > 1:
            cp_knobs = dict(cp_group=self.cp_mesh.get_group("cp"), cp_algorithm=plan.context_parallel["algorithm"])
        lowered = lower_pass(
            gm,
            None,
            axis=TensorAxis(self.mesh.get_group("tp") if tp > 1 else None, tp, self.mesh.get_local_rank("tp")),
            node_inputs=plan.node_inputs,
            node_output=plan.node_output,
            param_placements={name: placement_str(self._placements[i][1]) for name, i in self._index_of.items()},
            params=self._index_of,
            split_params=frozenset(name for name, i in self._index_of.items() if self._split_dim[i] is not None),
            hooks=self,
            replicated_outputs=replicated,
            recompute=plan.recompute if train else "none",
            layer_modes=plan.layer_modes if train else None,
            activation_offload=offload,
            launch_early=self.comm.launches_early,
            **cp_knobs,
        )
        run = LoweredRun(lowered, offload, counted=self._counted)
        if run.record.replicated:
            import warnings

            warnings.warn(
                f"{len(run.record.replicated)} ops of the plan run replicated on the tensor axis: their planned "
                f"split does not divide the shapes one rank runs (e.g. {list(run.record.replicated[:3])}); plan "
                f"with a batch that divides over the data and tensor axes",
                stacklevel=3,
            )
        return run

    # the parameter hooks the lowered graph calls (`passes.lower.ParamHooks`)

    def enter(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Parameter i as the graph computes with it, made where the graph first reads it: made before the run, its
        cast's autograd node would run only at the very end of the backward (the engine runs the latest-made ready
        node first), and with it the hook that launches its bucket. A split parameter comes in cast already."""
        if self._split_dim[i] is None:
            reduce_here = self.data_ranks > 1 and not (self.plan.num_microbatches > 1 or self.overlap)
            if self.reduce_in_compute:  # the dp reduction in the compute format
                x = self.in_compute_format(x)
            if reduce_here and x.requires_grad and torch.is_grad_enabled():
                x = _SummedOverData.apply(x, self._dp_group)
            x = self.in_compute_format(x)
        if self._interp_offloads():
            self._param_ptrs.add(x.untyped_storage().data_ptr())
        return x

    def gather(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Parameter i, split over the data axis, whole for one op that reads it."""
        if self.overlap:
            return self._gather(i, local)
        return self._gather_plain(i, local)

    def _interp_offloads(self) -> bool:
        interp = getattr(self, "_interp", None)
        return interp is not None and interp.activation_offload is not None

    # -------------------------------------------------------------------------------- execution

    def _param_values(self) -> list[torch.Tensor]:
        """The parameters as the graph takes them: the masters (the graph's `enter` casts them where first read),
        those split over the data axis cast to the compute format already (gathered in that format)."""
        out = []
        for i, shard in enumerate(self.shards):
            out.append(self.in_compute_format(shard) if self._split_dim[i] is not None else shard)
        # what a layer's gather (or one issued ahead) sends: the pieces the graph's own gathers would
        self._sources = [v.detach() if d is not None else None for v, d in zip(out, self._split_dim, strict=True)]
        if self._interp.activation_offload is not None:
            self._param_ptrs = {v.untyped_storage().data_ptr() for v in out} | {
                s.untyped_storage().data_ptr() for s in self.shards
            }
        return out

    def _inputs(self, args, kwargs) -> list:
        """This rank's rows of a micro-batch's inputs, flattened in placeholder order."""
        if self.cp > 1:  # this dp rank's rows, then this cp rank's chunk of each: the data axis's rows
            dp_rank = self.cp_mesh.get_local_rank("dp")
            rows = [pytree.tree_map(lambda t: rank_rows(t, self.plan.mesh["dp"], dp_rank), x) for x in (args, kwargs)]
            args, kwargs = local_batch(*rows, self.cp, self.cp_mesh.get_local_rank("cp"), causal_lm=self._causal_lm)
            flat, parts, rank = flat_inputs(self.traced, args, kwargs), 1, 0
        else:
            flat = flat_inputs(self.traced, args, kwargs)
            parts, rank = self.data_ranks, self.mesh.get_local_rank("dp")
        return [
            rank_rows(t.to(self.device_type), parts, rank).contiguous() if isinstance(t, torch.Tensor) else t
            for t in flat
        ]

    def _run(self, args, kwargs, interp: LoweredRun) -> list:
        self._new_pass()
        values = placeholder_values(
            self.traced, self._param_values(), self._run_buffers, self._constants.get, self._inputs(args, kwargs)
        )
        return list(interp(*values))[self.traced.num_mutated_outputs :]

    def forward(self, *args, **kwargs):
        """Run the model on one micro-batch of the global batch; tensors in the output are whole (gathered), the loss
        the exact mean over the batch."""
        local = self._inputs(args, kwargs)
        rows = next((t.shape[0] for t in local if isinstance(t, torch.Tensor) and t.ndim), None)
        outs = self._run(args, kwargs, self._interp)
        placed = self._interp.record.outputs[self.traced.num_mutated_outputs :]
        tp = self.mesh.size(1)
        axis = TensorAxis(self.mesh.get_group("tp") if tp > 1 else None, tp, self.mesh.get_local_rank("tp"))
        full = []
        for o, pl in zip(outs, placed, strict=True):
            if isinstance(o, torch.Tensor) and pl is not None:
                o = convert(o.detach(), pl, R, axis)
                if self.data_ranks > 1 and o.ndim and o.shape[0] == rows:
                    o = overlap.split_gather(o.contiguous(), 0, rows * self.data_ranks, self._dp_group)
            full.append(o)
        totals = torch.stack(
            [full[0].double(), full[-1].double() if self._counted else torch.ones((), dtype=torch.float64)]
        )
        if self.data_ranks > 1:
            totals = compat.funcol_all_reduce(totals, self._dp_group)
            totals = totals.wait() if hasattr(totals, "wait") else totals
        full[0] = (totals[0] / totals[1]).to(full[0].dtype)
        if self._counted:
            full = full[:-1]
        return pytree.tree_unflatten(full, call_spec(self.traced.exported).out_spec)

    def _losses(self, micro, interp: LoweredRun, backward: bool, arm=None, finish=None) -> tuple[float, float]:
        """(loss sum, weight) over the micro-batches and the data axis: the sum of the losses and the count of kept
        labels (another loss: its means, and one per rank and micro-batch), running backward from each if asked
        (calling `arm(last)` before each one's and `finish(last)` after it, `last` telling the last micro-batch)."""
        sums, counts = [], []
        for j, (mb_args, mb_kwargs) in enumerate(micro):
            outs = self._run(mb_args, mb_kwargs, interp)
            loss = outs[0]
            check_scalar_loss(loss)
            sums.append(loss.detach().double())
            counts.append(outs[-1].detach().double() if self._counted else torch.ones((), dtype=torch.float64))
            if backward:
                last = j == len(micro) - 1
                if arm is not None:
                    arm(last)
                self._in_backward = True
                try:
                    self.scaled(loss).backward()
                finally:
                    self._in_backward = False
                if finish is not None:
                    finish(last)
        totals = torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()]).to(self.device_type)
        if self.data_ranks > 1:
            with waiting_for("the all-reduce of the loss and its label count over the data axis"):
                totals = compat.funcol_all_reduce(totals, self._dp_group)
                totals = totals.wait() if hasattr(totals, "wait") else totals
        loss_sum, weight = totals.tolist()
        return loss_sum, weight

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        if self.overlap:
            self._uses = [0] * len(self.shards)  # a forward run outside a step leaves counts no backward took back
            with waiting_for("a parameter's all-gather prefetched by a forward run outside a step"):
                self._drop_prefetched()
            self._forget_gathers()
            with (
                waiting_for("a collective of the sharded forward or backward, or a gradient bucket's reduction"),
                self._releasing(),
            ):
                return self._losses(micro, self._interp, True, arm=self._arm, finish=self._finish_micro_batch)
        self._forget_gathers()
        with waiting_for("a collective of the sharded forward or backward on the (dp, tp) mesh"), self._releasing():
            loss_sum, total = self._losses(micro, self._interp, True)
        self._forget_gathers()
        if len(micro) > 1 and self.data_ranks > 1:
            deferred = [p.grad for p, pl in zip(self.shards, self._placements, strict=True) if pl[0] == R]
            with waiting_for("the all-reduce of the dp-replicated gradients over the data axis"):
                sum_in_buckets(
                    [g for g in deferred if g is not None],
                    self._dp_group,
                    dtype=self.compute_dtype if self.reduce_in_compute else None,
                )
        return loss_sum, total

    def _scale_gradients(self, weight: float, scale: float) -> None:
        """Divide the gradients (of the loss summed over ranks and micro-batches) by the weight and the loss scale."""
        divisor = (weight if weight > 0 else 1.0) * scale
        if divisor != 1.0:
            for g in self._gradients():
                g.div_(divisor)

    def compile_graphs(self, mode: str) -> None:
        self._interp.compile(mode)
        self._compile_mode = mode
        if self._eval_interp is not None:
            self._eval_interp.compile(mode)

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        tp = self.plan.mesh["tp"]
        return [
            (p.grad, (self.data_ranks if pl[0] == R else 1) * (tp if pl[1] == R else 1))
            for p, pl in zip(self.shards, self._placements, strict=True)
            if p.grad is not None
        ]

    def _loss_shards(self) -> int:
        return self.data_ranks * self.plan.num_microbatches  # each rank runs its rows on local tensors

    def _evaluate(self, micro: list[tuple]) -> float:
        if self._eval_interp is None:
            self._eval_interp = self._lower(self.traced.graph_module, train=False)
            if self._compile_mode is not None:
                self._eval_interp.compile(self._compile_mode)
        with waiting_for("a collective of the sharded eval forward on the (dp, tp) mesh"):
            loss_sum, total = self._losses(micro, self._eval_interp, backward=False)
            self._drop_prefetched()  # gathers issued ahead for layers after the last: none is left in flight
        return loss_sum / total

    def release_pending_work(self) -> None:
        with waiting_for("a parameter's all-gather prefetched by a forward run outside a step"):
            self._drop_prefetched()

    # ---------------------------------------------------------------------------------- states

    def full_parameter(self, fqn: str) -> torch.Tensor:
        fqn = self._aliases.get(fqn, fqn)
        i = self._param_names.index(fqn)
        shape = self._shapes[i]
        dt = DTensor.from_local(
            self.shards[i].detach(),
            self.mesh,
            self._placements[i],
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
        return dt.full_tensor()

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        with waiting_for("the all-gathers of every parameter's shards for state_dict"):
            return {fqn: self.full_parameter(fqn).cpu() for fqn in self._param_names}

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.traced.buffer_names, self._buffer_values, strict=True))

    def after_checkpoint_load(self) -> None:
        self._run_buffers = [self.in_compute_format(b) for b in self._buffer_values]  # buffers just read

    def checkpoint_masters(self) -> dict:
        return {
            n: dtensor_piece(p.detach(), shape, self.mesh, pl, param=p)
            for n, p, pl, shape in zip(self._param_names, self.shards, self._placements, self._shapes, strict=True)
        }


__all__ = ["LoweredRun", "ShardedProgram"]

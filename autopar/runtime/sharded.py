"""The sharded program: the traced graph run on DTensors over a (dp, tp) mesh.

It holds this rank's local shards of the parameters (the masters: what `parameters()` returns and the
optimizer updates), binds the traced graph to the plan through the rewrite pass
(`passes.parallelize`; with the plan's activation recompute, its layers or attention blocks run under
checkpointing), and runs forward on this rank's share of each micro-batch and backward (gradient
reductions over the data axis happen in the backward of the parameters' `from_local`). Under mixed
precision each master DTensor is cast to the compute format where the graph reads it, so parameter
gathers and gradient reductions run in that format and gradients reach the masters in fp32.

With a cp axis the mesh is (dp, cp, tp) and the graph is the one traced for cp
(`autopar.context_parallel.inputs.traced_batch`): each sequence's zig-zag chunks are rows of the batch. The
interpreter runs it on the 2-D mesh (dp·cp, tp), the cp ranks being more rows of the data axis: every
per-token op is unchanged, the loss is the global sum over dp·cp ranks divided by the global count of kept
labels, and gradients (and ZeRO shards) are reduced over dp·cp. Attention runs by `cp_attention` over the
cp group with the plan's algorithm (`passes.parallelize`). Each rank feeds its dp rows' cp chunk, positions
and pre-shifted labels included (`context_parallel.inputs.local_batch`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.cluster import ClusterSpec
from autopar.context_parallel.inputs import is_causal_lm, local_batch
from autopar.errors import LoweringError
from autopar.passes.parallelize import dp_placement, local_shard, shard_pass
from autopar.passes.program_graph import copy_graph_module, eval_pass
from autopar.passes.sharding_rules import parse_placement
from autopar.plan import Plan, ProgramKind
from autopar.runtime.base import (
    Program,
    call_spec,
    check_scalar_loss,
    contiguous_stride,
    flat_inputs,
    placeholder_values,
    rank_rows,
    sum_in_buckets,
)
from autopar.runtime.collectives import device_mesh, waiting_for
from autopar.trace import TracedModel

R = Replicate()


class ShardedProgram(Program):
    """The sharded program of one plan on this rank (see the module docstring)."""

    kind = ProgramKind.SHARDED

    @classmethod
    def runs(cls, plan: Plan) -> bool:
        # a data-parallel layout runs here too, on DTensors (what recompute does to it)
        return plan.program in (ProgramKind.SHARDED, ProgramKind.DATA_PARALLEL)

    def __init__(self, model: torch.nn.Module, plan: Plan, traced: TracedModel, cluster: ClusterSpec, *,
                 optimizer=None):  # fmt: skip
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        dp, tp, cp = plan.mesh["dp"], plan.mesh["tp"], plan.mesh.get("cp", 1)
        self.cp, self.data_ranks = cp, dp * cp  # the data axis: dp·cp ranks
        self._causal_lm = is_causal_lm(model)
        self.cp_mesh: DeviceMesh | None = None
        cp_knobs = {}
        if cp > 1:
            self.cp_mesh = device_mesh(self.device_type, (dp, cp, tp), ("dp", "cp", "tp"))
            cp_knobs = dict(cp_group=self.cp_mesh.get_group("cp"), cp_algorithm=plan.context_parallel["algorithm"])
        self.mesh: DeviceMesh = device_mesh(self.device_type, (dp * cp, tp), ("dp", "tp"))
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
        self._buffers = [buffers[n].detach().to(self.device_type) for n in traced.buffer_names]
        self._run_buffers = [self.in_compute_format(b) for b in self._buffers]
        self._constants = {k: self.in_compute_format(v.to(self.device_type)) if isinstance(v, torch.Tensor) else v
                           for k, v in traced.exported.constants.items()}  # fmt: skip
        placeholders = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        params = frozenset(n for n, kind in zip(placeholders, traced.placeholder_kinds, strict=True) if kind == "param")
        knobs = dict(mesh=self.mesh, node_inputs=plan.node_inputs, node_output=plan.node_output,
                     batch_size=plan.global_batch_size * cp // plan.num_microbatches, params=params,
                     **cp_knobs)  # fmt: skip
        self._interp = shard_pass(traced.graph_module, None, recompute=plan.recompute, layer_modes=plan.layer_modes,
                                  **knobs)  # fmt: skip
        self._eval_knobs = knobs
        self._eval_interp = None  # built on the first eval_step
        self._build_optimizer(self.shards)

    def _check_plan_matches(self, traced: TracedModel) -> None:
        names = {n.name for n in traced.exported.graph.nodes}
        missing = [n for n in self.plan.node_output if n not in names]
        if missing:
            raise LoweringError(f"the plan does not belong to this model: {len(missing)} of its nodes "
                                f"(e.g. {missing[:3]}) are not in the traced graph; plan this model again")  # fmt: skip

    # -------------------------------------------------------------------------------- execution

    def _param_dtensors(self) -> list[DTensor]:
        # With several micro-batches, gradients of dp-replicated parameters stay partial (no collective per
        # micro-batch) and `_forward_backward` sums them over dp once, as the plan prices it.
        defer = self.plan.num_microbatches > 1 and self.data_ranks > 1
        out = []
        for local, pl, shape in zip(self.shards, self._placements, self._shapes, strict=True):
            grad_pl = (Partial(), pl[1]) if defer and pl[0] == R else pl
            # cast before from_local: its backward (the dp reduction) runs in the compute format; after it, in fp32
            early = self.reduce_in_compute and pl[0] == R
            dt = DTensor.from_local(
                self.in_compute_format(local) if early else local,
                self.mesh,
                pl,
                run_check=False,
                shape=torch.Size(shape),
                stride=contiguous_stride(shape),
                grad_placements=grad_pl,
            )
            out.append(self.in_compute_format(dt))
        return out

    def _inputs(self, args, kwargs) -> list:
        if self.cp > 1:  # this dp rank's rows, then this cp rank's chunk of each: the data axis's rows
            dp_rank = self.cp_mesh.get_local_rank("dp")
            rows = [pytree.tree_map(lambda t: rank_rows(t, self.plan.mesh["dp"], dp_rank), x) for x in (args, kwargs)]
            args, kwargs = local_batch(*rows, self.cp, self.cp_mesh.get_local_rank("cp"), causal_lm=self._causal_lm)
            flat, dp, rank = flat_inputs(self.traced, args, kwargs), 1, 0
        else:
            flat, dp, rank = flat_inputs(self.traced, args, kwargs), self.data_ranks, self.mesh.get_local_rank("dp")
        out = []
        for t in flat:
            if not isinstance(t, torch.Tensor):
                out.append(t)
                continue
            local = rank_rows(t.to(self.device_type), dp, rank)
            pl = (Shard(0) if t.ndim and self.data_ranks > 1 else R, R)
            out.append(DTensor.from_local(local.contiguous(), self.mesh, pl, run_check=False))
        return out

    def _placeholders(self, args, kwargs) -> list:
        buffers = [DTensor.from_local(b, self.mesh, (R, R), run_check=False) for b in self._run_buffers]

        def constant(name):
            c = self._constants[name]
            return DTensor.from_local(c, self.mesh, (R, R), run_check=False) if isinstance(c, torch.Tensor) else c

        return placeholder_values(self.traced, self._param_dtensors(), buffers, constant, self._inputs(args, kwargs))

    def _run(self, args, kwargs, interp=None):
        outs = (interp or self._interp).run(*self._placeholders(args, kwargs))
        return list(outs)[self.traced.num_mutated_outputs :]

    def forward(self, *args, **kwargs):
        """Run the model on one micro-batch of the global batch; tensors in the output are whole (gathered)."""
        outs = self._run(args, kwargs)
        full = [o.full_tensor() if isinstance(o, DTensor) else o for o in outs]
        return pytree.tree_unflatten(full, call_spec(self.traced.exported).out_spec)

    def _weighted_losses(self, micro, interp, backward: bool) -> tuple[float, float]:
        """(sum of w_i * loss_i, sum of w_i) over the micro-batches, running backward from each if asked."""
        loss_sum, total = 0.0, 0.0
        for mb_args, mb_kwargs in micro:
            loss = self._run(mb_args, mb_kwargs, interp)[0]
            check_scalar_loss(loss)
            loss = loss.redistribute(self.mesh, (R, R))
            counts = interp.loss_counts
            w = counts[0] if len(micro) > 1 and len(counts) == 1 else 1.0
            if backward:
                self.scaled(loss * w if w != 1.0 else loss).backward()
            loss_sum += float(loss.to_local().detach()) * w
            total += w
        return loss_sum, total

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        with waiting_for("a collective of the sharded forward or backward on the (dp, tp) mesh"):
            loss_sum, total = self._weighted_losses(micro, self._interp, backward=True)
        if len(micro) > 1 and self.data_ranks > 1:
            deferred = [p.grad for p, pl in zip(self.shards, self._placements, strict=True) if pl[0] == R]
            with waiting_for("the all-reduce of the dp-replicated gradients over the data axis"):
                sum_in_buckets(
                    [g for g in deferred if g is not None],
                    self.mesh.get_group("dp"),
                    dtype=self.compute_dtype if self.reduce_in_compute else None,
                )
        return loss_sum, total

    def _evaluate(self, micro: list[tuple]) -> float:
        if self._eval_interp is None:
            gm = eval_pass(copy_graph_module(self.traced.graph_module), None)
            self._eval_interp = shard_pass(gm, None, **self._eval_knobs)
        loss_sum, total = self._weighted_losses(micro, self._eval_interp, backward=False)
        return loss_sum / total

    # ---------------------------------------------------------------------------------- states

    def full_parameter(self, fqn: str) -> torch.Tensor:
        fqn = self._aliases.get(fqn, fqn)
        i = self._param_names.index(fqn)
        shape = self._shapes[i]
        dt = DTensor.from_local(self.shards[i].detach(), self.mesh, self._placements[i], run_check=False,
                                shape=torch.Size(shape), stride=contiguous_stride(shape))  # fmt: skip
        return dt.full_tensor()

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        return {fqn: self.full_parameter(fqn).cpu() for fqn in self._param_names}

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.traced.buffer_names, self._buffers, strict=True))

    def _after_checkpoint_load(self) -> None:
        self._run_buffers = [self.in_compute_format(b) for b in self._buffers]  # buffers just read

    def _local_masters(self) -> dict:
        from autopar.checkpoint.pieces import dtensor_piece

        return {n: dtensor_piece(p.detach(), shape, self.mesh, pl, param=p)
                for n, p, pl, shape in zip(self._param_names, self.shards, self._placements, self._shapes,
                                           strict=True)}  # fmt: skip

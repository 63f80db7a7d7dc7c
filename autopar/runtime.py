"""ParallelModule: the emitted parallel program and its training step.

It holds this rank's local shards of the parameters (what `parameters()` returns and the
optimizer updates), binds the traced graph to the plan through the rewrite pass
(`passes.parallelize`; with the plan's activation recompute, its layers or attention blocks run
under checkpointing), and runs `train_step`: forward on this rank's share of the global
batch, backward (gradient reductions over the data axis happen in the backward of the
parameters' `from_local`), and the optimizer step on the local shards.

`state_dict()` gathers full tensors under the original (Hugging Face) names, tied names included.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError, LoweringError
from autopar.passes.parallelize import dp_placement, local_shard, shard_pass
from autopar.passes.sharding_rules import parse_placement
from autopar.plan import Plan
from autopar.trace import TracedModel

R = Replicate()


def ensure_process_group(cluster: ClusterSpec) -> None:
    """Join the process group torchrun set up (or a one-rank group), and check its size against the cluster."""
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "nccl" if cluster.device.kind == "gpu" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(minutes=5))
        elif cluster.world_size == 1:
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        else:
            raise LoweringError(f"the cluster has {cluster.world_size} devices but no process group is running: "
                                f"launch with `torchrun --nproc_per_node {cluster.world_size} ...`")  # fmt: skip
    if dist.get_world_size() != cluster.world_size:
        raise LoweringError(f"the process group has {dist.get_world_size()} ranks but the cluster "
                            f"{cluster.describe()} has {cluster.world_size}; launch one rank per device")  # fmt: skip


def _device_type(cluster: ClusterSpec) -> str:
    if cluster.device.kind == "gpu":
        if not torch.cuda.is_available():
            raise LoweringError(f"the cluster is {cluster.describe()} but this machine has no CUDA device; "
                                f"plan for GPUs here, run on GPUs there, or compile for 'cpu:N'")  # fmt: skip
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return "cuda"
    return "cpu"


class ParallelModule(torch.nn.Module):
    """The parallel program of one plan on this rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, traced: TracedModel, plan: Plan, cluster: ClusterSpec, *,
                 optimizer=None):  # fmt: skip
        super().__init__()
        dp, tp = plan.mesh["dp"], plan.mesh["tp"]
        if dp * tp != cluster.world_size:
            raise LoweringError(f"plan mesh {plan.mesh} does not match the cluster's {cluster.world_size} devices")
        if plan.fusion.get("enabled"):  # the plan names the nodes of the fused graph
            from autopar.passes.fused_ops import fuse_traced

            traced = fuse_traced(traced)
        self.plan, self.traced = plan, traced
        self.device_type = _device_type(cluster)
        self.mesh: DeviceMesh = init_device_mesh(self.device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        self._check_plan_matches(traced)
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self._param_names = list(traced.param_names)
        self._placements: list[tuple] = []
        shards = []
        for fqn in self._param_names:
            p = named[fqn]
            tp_pl = parse_placement(plan.param_placements.get(fqn, "R"))
            pl = (dp_placement(tuple(p.shape), dp, plan.zero_stage >= 1), tp_pl)
            self._placements.append(pl)
            local = local_shard(p.detach().to(self.device_type), self.mesh, pl)
            shards.append(torch.nn.Parameter(local, requires_grad=p.requires_grad))
        self.shards = torch.nn.ParameterList(shards)
        self._shapes = [tuple(named[n].shape) for n in self._param_names]
        self._buffers = [buffers[n].detach().to(self.device_type) for n in traced.buffer_names]
        self._constants = self._graph_constants(traced)
        self._aliases = dict(traced.param_aliases)
        self._state_names = list(model.state_dict().keys())
        self._interp = shard_pass(traced.graph_module, None, mesh=self.mesh, node_inputs=plan.node_inputs,
                                  node_output=plan.node_output,
                                  batch_size=plan.global_batch_size // plan.num_microbatches,
                                  recompute=plan.recompute, layer_modes=plan.layer_modes)  # fmt: skip
        make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.optimizer = make_opt(list(self.shards))

    def _check_plan_matches(self, traced: TracedModel) -> None:
        names = {n.name for n in traced.exported.graph.nodes}
        missing = [n for n in self.plan.node_output if n not in names]
        if missing:
            raise LoweringError(f"the plan does not belong to this model: {len(missing)} of its nodes "
                                f"(e.g. {missing[:3]}) are not in the traced graph; plan this model again")  # fmt: skip

    def _graph_constants(self, traced: TracedModel) -> dict:
        ep = traced.exported
        return {k: v.to(self.device_type) if isinstance(v, torch.Tensor) else v for k, v in ep.constants.items()}

    # -------------------------------------------------------------------------------- execution

    def _param_dtensors(self) -> list[DTensor]:
        # With several micro-batches, gradients of dp-replicated parameters stay partial (no collective per
        # micro-batch) and `train_step` sums them over dp once, as the plan prices it.
        defer = self.plan.num_microbatches > 1 and self.plan.mesh["dp"] > 1
        out = []
        for local, pl, shape in zip(self.shards, self._placements, self._shapes, strict=True):
            grad_pl = (Partial(), pl[1]) if defer and pl[0] == R else pl
            out.append(DTensor.from_local(local, self.mesh, pl, run_check=False, shape=torch.Size(shape),
                                          stride=_contiguous_stride(shape), grad_placements=grad_pl))  # fmt: skip
        return out

    def _inputs(self, args, kwargs) -> list:
        flat = flat_inputs(self.traced, args, kwargs)
        dp = self.plan.mesh["dp"]
        out = []
        for t in flat:
            if not isinstance(t, torch.Tensor):
                out.append(t)
                continue
            t = t.to(self.device_type)
            if t.ndim and t.shape[0] % dp:
                raise ConfigError(f"the batch of {t.shape[0]} does not divide over the data axis (dp={dp}); "
                                  f"pass a global batch that is a multiple of {dp}")  # fmt: skip
            pl = (Shard(0) if t.ndim and dp > 1 else R, R)
            rank = self.mesh.get_local_rank("dp")
            local = t.chunk(dp, dim=0)[rank] if t.ndim and dp > 1 else t
            out.append(DTensor.from_local(local.contiguous(), self.mesh, pl, run_check=False))
        return out

    def _placeholders(self, args, kwargs) -> list:
        buffers = [DTensor.from_local(b, self.mesh, (R, R), run_check=False) for b in self._buffers]

        def constant(name):
            c = self._constants[name]
            return DTensor.from_local(c, self.mesh, (R, R), run_check=False) if isinstance(c, torch.Tensor) else c

        return placeholder_values(self.traced, self._param_dtensors(), buffers, constant, self._inputs(args, kwargs))

    def _run(self, args, kwargs):
        outs = self._interp.run(*self._placeholders(args, kwargs))
        return list(outs)[self.traced.num_mutated_outputs:]

    def forward(self, *args, **kwargs):
        """Run the model on a global batch; tensors in the output are whole (gathered) tensors."""
        outs = self._run(args, kwargs)
        full = [o.full_tensor() if isinstance(o, DTensor) else o for o in outs]
        return pytree.tree_unflatten(full, call_spec(self.traced.exported).out_spec)

    def train_step(self, *args, **kwargs) -> float:
        """One optimizer step on a global batch (every rank passes the same batch); returns the loss.

        With several micro-batches the gradients accumulate: micro-batch i contributes its loss times
        its weight w_i (the labels its mean cross-entropy kept, or 1 for other losses), and the sum is
        divided by sum w_i before the optimizer step, so the step equals one over the whole batch.
        """
        self.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(args, kwargs, self.plan.global_batch_size, self.plan.num_microbatches)
        losses, weights = [], []
        for mb_args, mb_kwargs in micro:
            outs = self._run(mb_args, mb_kwargs)
            loss = outs[0]
            if not isinstance(loss, DTensor) or loss.ndim != 0:
                raise LoweringError("the model's first output is not a scalar loss: pass labels so the model "
                                    "computes one")  # fmt: skip
            loss = loss.redistribute(self.mesh, (R, R))
            counts = self._interp.loss_counts
            w = counts[0] if len(micro) > 1 and len(counts) == 1 else 1.0
            (loss * w if w != 1.0 else loss).backward()
            losses.append(float(loss.to_local().detach()))
            weights.append(w)
        total = sum(weights)
        if len(micro) > 1 and self.plan.mesh["dp"] > 1:
            deferred = [p.grad for p, pl in zip(self.shards, self._placements, strict=True) if pl[0] == R]
            sum_in_buckets([g for g in deferred if g is not None], self.mesh.get_group("dp"))
        if len(micro) > 1 and total > 0:
            for p in self.shards:
                if p.grad is not None:
                    p.grad.div_(total)
        self.optimizer.step()
        if total <= 0:
            return sum(losses) / len(losses)
        return sum(loss * w for loss, w in zip(losses, weights, strict=True)) / total

    # ---------------------------------------------------------------------------------- states

    def full_parameter(self, fqn: str) -> torch.Tensor:
        fqn = self._aliases.get(fqn, fqn)
        i = self._param_names.index(fqn)
        local = self.shards[i].detach()
        dt = DTensor.from_local(local, self.mesh, self._placements[i], run_check=False,
                                shape=torch.Size(self._shapes[i]), stride=_contiguous_stride(self._shapes[i]))  # fmt: skip
        return dt.full_tensor()

    def state_dict(self, *args, **kwargs) -> dict:  # noqa: ARG002 - the nn.Module signature
        """Full tensors under the original names (parameters gathered from every rank; buffers as they are)."""
        out = {}
        buffers = dict(zip(self.traced.buffer_names, self._buffers, strict=True))
        for name in self._state_names:
            key = self._aliases.get(name, name)
            if key in self._param_names:
                out[name] = self.full_parameter(key).cpu()
            elif name in buffers:
                out[name] = buffers[name].cpu()
        return out


def sum_in_buckets(grads: list[torch.Tensor], group, bucket_bytes: int = 25 * 2**20) -> None:
    """All-reduce (sum) `grads` in place over `group`, packed into flat buckets of one dtype."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if bucket and (g is None or g.dtype != bucket[0].dtype or size >= bucket_bytes):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            for b, piece in zip(bucket, flat.split([b.numel() for b in bucket]), strict=True):
                b.copy_(piece.view_as(b))
            bucket, size = [], 0
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()


def micro_batches(args, kwargs, batch: int, m: int) -> list[tuple]:
    """Cut a batch of `batch` rows into `m` micro-batches along dim 0 (every batch input alike), as (args, kwargs)."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    for t in flat:
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] != batch:
            raise ConfigError(f"the plan is for a global batch of {batch} but an input has {t.shape[0]} rows; "
                              f"pass the batch the model was compiled for")  # fmt: skip
    if m == 1:
        return [(tuple(args), dict(kwargs))]
    pieces = [t.chunk(m, dim=0) if isinstance(t, torch.Tensor) and t.ndim else [t] * m for t in flat]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(m)]


def call_spec(exported):
    """`exported.call_spec`, kept per program: torch builds a new NamedTuple class on every access (about a
    quarter of a millisecond, paid on every step of a small model otherwise)."""
    found = _CALL_SPECS.get(exported)
    if found is None:
        found = _CALL_SPECS[exported] = exported.call_spec
    return found


_CALL_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flat_inputs(traced: TracedModel, args, kwargs) -> list:
    """The call's inputs flattened in placeholder order, checked against the structure the model was traced with."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    expected = call_spec(traced.exported).in_spec
    if expected is not None and spec != expected:
        raise ConfigError(f"the inputs do not have the structure the model was compiled with: expected "
                          f"{expected}, got {spec}")  # fmt: skip
    return flat


def placeholder_values(traced: TracedModel, params, buffers, constant, inputs) -> list:
    """Values for the graph's placeholders in order, from parameters, buffers, `constant(name)` and user inputs."""
    params, buffers, inputs = iter(params), iter(buffers), iter(inputs)
    sig = traced.exported.graph_signature
    names = iter(spec.target for spec in sig.input_specs if spec.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ"))
    source = {"param": params, "buffer": buffers, "input": inputs}
    return [constant(next(names)) if kind == "constant" else next(source[kind]) for kind in traced.placeholder_kinds]


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))

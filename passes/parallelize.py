"""Rewrite: run the traced graph as a parallel program, following the plan's placements.

`ShardedInterpreter` is an `fx.Interpreter` over the exported (ATen training IR) graph whose
values are DTensors on the 2-D mesh (dp, tp). For every op it

1. brings each tensor argument to the placement the plan chose for it on the tensor axis
   (`redistribute`, which is autograd-aware: the backward runs the transposed collective),
2. runs the op: DTensor's own ATen rules for most ops; attention locally on each rank's
   heads or batch rows (it is independent across both), the flash-attention kernel included;
   autopar's fused norms on each rank's rows and its fused LM-head loss on each rank's tokens
   (weights whole, their gradients partial sums; the loss an exact global mean);
   ops DTensor has no rule for run on gathered full tensors (correct, and reported),
3. brings the output to the plan's placement. Where the output's first consumer is not the very next op,
   that collective is launched without waiting (`redistribute(async_op=True)`), and so is the one step 1
   would run at the consumers when they all ask the same placement of it (moved to where the value is
   made): the ops in between run while it is in flight and the first op that reads the value waits for it
   (its backward's transposed collective likewise). Tensor-axis communication launches early and is waited
   on late; which collectives run, and how many, does not change.

The graph's shape constants are global (it was traced on the global batch), and DTensor works
in global shapes, so no shape in the graph needs rewriting. Values created inside the graph
from nothing (`arange`, masks) are plain tensors, identical on every rank: they enter the mesh
replicated.

With activation recompute (`passes.recompute`), each segment of the plan's mode (a whole layer,
or a layer's attention internals) runs as one `torch.utils.checkpoint.checkpoint` region
(non-reentrant) when the interpreter reaches its last node: DTensors go in and come out, the
forward keeps only the segment's inputs, and the backward runs the segment again, collectives
included, before it differentiates it.

With a cp axis (`cp_group` given) the graph is the one traced for cp, each sequence's zig-zag chunks being
rows of the batch, and the mesh's data axis holds dp·cp ranks; every op but attention is per token and runs
as above. Attention (SDPA and autopar::flash_attention) runs by `context_parallel.cp_attention` on each
rank's rows over the cp group: causal by global position when the graph asked for causality or built a mask
(the model's causal mask, built from the chunk's shape: a cp plan takes no padding mask), else unmasked.

Input: an exported program's graph module, the plan's per-node placements, the mesh.
Output: the graph's outputs as DTensors; gradients reach each parameter's local shard through
`DTensor.from_local`, with the data-axis reduction done by the backward of that call.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.errors import LoweringError
from autopar.ir import is_tensor_node
from autopar.memory.activations import ActivationOffload, local_tensor
from autopar.passes.recompute import offloaded_nodes, plan_segments
from autopar.passes.sharding_rules import is_masked_partial, parse_placement

aten = torch.ops.aten
R = Replicate()
P = Partial()

# Ops that only check metadata of global tensors; DTensor cannot run them and they compute nothing.
_SKIPPED = {aten._assert_tensor_metadata.default}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    The backward of a view views the gradient; a gradient that arrives transposed (as after a
    transpose or a redistribution) cannot be viewed, so views get their gradients contiguous.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):  # DTensor judges contiguity by the global strides; the local piece matters
            local = grad.to_local()
            if local.is_contiguous():
                return grad
            return DTensor.from_local(
                local.contiguous(),
                grad.device_mesh,
                grad.placements,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )
        return grad.contiguous()


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


class Deferred:
    """A placeholder value the interpreter makes where an op first reads it, not before the run.

    A parameter entering the mesh (`DTensor.from_local`, a cast to the compute format) makes autograd nodes
    whose backward carries its gradient to the leaf, and so fires the hooks that launch its reduction. The
    autograd engine runs ready nodes latest-made first: nodes made before the whole forward run only after
    every other node of the backward, so all reductions would start at its very end. Made at its first use,
    a parameter's nodes run as soon as the backward of that use has given its gradient."""

    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class ShardedInterpreter(fx.Interpreter):
    """Interpret `gm` on DTensors, enforcing the tensor-axis placements of the plan.

    Args:
        gm: the exported graph module (parameters and buffers as placeholders).
        mesh: a 2-D DeviceMesh with axes ("dp", "tp").
        node_inputs: node name -> placement string per tensor argument on the tp axis.
        node_output: node name -> placement string of the output on the tp axis.
        local_ops: op overload -> callable run on local tensors for ops executed per rank.
        batch_size: the batch the graph was traced with; a tensor the graph makes with it as its leading
            dimension enters the mesh split over dp (each rank keeps its rows).
        recompute: the plan's activation recompute mode ("none", "selective", "full").
        layer_modes: the plan's per-layer treatment ("offload"/"full"/"selective" -> layer indices);
            when given, it says which layers `recompute` applies to, and which layers' saved
            activations are kept on the host (`autopar.memory.activations.ActivationOffload`).
        cp_group, cp_algorithm: a cp plan's cp process group and attention algorithm (None: no cp axis).
        params: names of the placeholders that hold parameters. One split over the data axis (ZeRO-3) is
            gathered there for each op that reads it, as ZeRO-3 gathers a weight before its use (its
            gradient is reduce-scattered back by the gather's backward). Left split, DTensor picks its own
            strategy on the data axis: a vocabulary-parallel lookup whose masked partial sum fails after the
            first view (T5's relative position bias), or a linear whose output is split on its features,
            which a later view cannot unflatten (a fused qkv projection).
        gather: how such a parameter is gathered, `gather(placeholder name, value) -> value` (None: a DTensor
            redistribution, whose backward reduce-scatters the gradient at once); the sharded program hands its
            own to defer the reduce-scatter to a bucket (`autopar.runtime.sharded`).
        launch_early: launch a value's tensor-axis collective where the value is made when its first consumer is
            not the next op (`launches_early`; the plan's `overlap`, which prices it so).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: DeviceMesh,
        node_inputs: dict,
        node_output: dict,
        local_ops: dict | None = None,
        batch_size: int | None = None,
        recompute: str = "none",
        layer_modes: dict | None = None,
        cp_group=None,
        cp_algorithm: str | None = None,
        *,
        params: frozenset[str] = frozenset(),
        gather=None,
        launch_early: bool = True,
    ):
        super().__init__(gm, garbage_collect_values=True)
        self.params = params
        self.gather = gather or (lambda name, value: gathered_over_dp(value))
        self.cp_group, self.cp_algorithm = cp_group, cp_algorithm
        self.mesh = mesh
        self.batch_size = batch_size
        self.need = {k: tuple(parse_placement(p) for p in v) for k, v in node_inputs.items()}
        self.out = {k: parse_placement(v) for k, v in node_output.items()}
        # attention runs across the cp group on a cp plan
        attention = "_cp_attention" if cp_group is not None else "_run_local"
        self.local_ops = {
            op: getattr(self, attention if method == "_run_local" else method)
            for op, method in _local_op_methods().items()
        }
        self.local_ops.update(local_ops or {})
        self.fallback_ops: set[str] = set()
        # DTensor's mse_loss over rows split on dp gives a wrong backward (its loss is right): run it on
        # gathered tensors, whose backward slices the gradient back to each rank's rows
        self.fallback_ops.add(str(aten.mse_loss.default))
        # Kept labels counted by every mean cross-entropy of the last run: the weight of its loss when
        # micro-batches are accumulated (a mean over kept labels is exact only with this weighting).
        self.loss_counts: list[float] = []
        self.segments = [_Segment.of(self.graph, names) for names in plan_segments(self.graph, recompute, layer_modes)]
        self._offloaded = offloaded_nodes(self.graph, layer_modes)
        self.activation_offload = ActivationOffload(keep=self._is_parameter) if self._offloaded else None
        self._param_ptrs: set[int] = set()
        self._segment_at = {seg.nodes[-1]: seg for seg in self.segments}
        self._in_segment = {n for seg in self.segments for n in seg.nodes[:-1]}
        # runs of segment bodies: once in forward and once more for each recompute in backward
        self.segment_calls = 0
        if self.segments:
            self._keep_segment_inputs()
        # nodes launched early, and node -> the placement all its consumers ask of it (applied where it is produced)
        self.launched_early, self.consumed_as = self._launch_early() if launch_early else (frozenset(), {})

    def _launch_early(self) -> tuple[frozenset[str], dict[str, Placement]]:
        """(nodes whose output's tensor-axis collective is launched without waiting for it (see `_run_op`), the
        placement all the consumers of such a node ask of it, where they agree).

        Launched early: the nodes whose first consumer is not the very next node, so that ops between them run
        while the collective is in flight, and whose consumers are all ATen ops DTensor runs (none of
        `local_ops`, which hand local tensors to kernels): the waiting is then done by the first op that reads
        the value. Where every consumer asks the same placement, the reshard they would each do is launched
        early too, where the value is made."""
        nodes = list(self.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        early, consumed_as = set(), {}
        for n in nodes:
            if launches_early(n, order, self.local_ops):
                users = list(n.users)
                early.add(n.name)
                wanted = {self._needed_by(u, n) for u in users}
                if len(wanted) == 1 and (want := wanted.pop()) is not None and not want.is_partial():
                    consumed_as[n.name] = want
        return frozenset(early), consumed_as

    def _needed_by(self, user: fx.Node, value: fx.Node) -> Placement | None:
        """The tensor-axis placement `user` asks of `value` (None: none, or different ones at two positions)."""
        need = self.need.get(user.name, ())
        tensors = []
        fx.node.map_arg((user.args, user.kwargs), lambda a: tensors.append(a) if is_tensor_node(a) else None)
        asked = {need[j] if j < len(need) else None for j, a in enumerate(tensors) if a is value}
        return asked.pop() if len(asked) == 1 else None

    def run(self, *args, **kwargs):
        self.loss_counts = []
        if self.activation_offload is not None:  # parameters stay where they are, whoever saves them
            self._param_ptrs = set()
            for a in args:
                self._note_parameter(a)
        return super().run(*args, **kwargs)

    def _note_parameter(self, value) -> None:
        """Remember `value`'s storage as a parameter's (activation offload keeps those where they are), if it is a
        tensor that needs a gradient: a placeholder value given to `run` or made from a `Deferred` one."""
        if isinstance(value, torch.Tensor) and value.requires_grad:
            self._param_ptrs.add(_storage(value))

    def _is_parameter(self, t: torch.Tensor) -> bool:
        return _storage(t) in self._param_ptrs

    def _to(self, value, tp_placement: Placement, *, early: bool = False):
        if not isinstance(value, DTensor) or (tp_placement.is_partial() and not value.placements[1].is_partial()):
            return value
        if is_masked_partial(tp_placement) and value.placements[1].is_partial():
            return value  # DTensor's own masked partial sum: only it holds the mask its reduction needs
        dp_pl = value.placements[0]
        want = (dp_pl, tp_placement)
        if tuple(value.placements) == want:
            return value
        return value.redistribute(self.mesh, want, async_op=early)

    def _replicated(self, t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, self.mesh, (R, R), run_check=False)

    def _entering(self, t: torch.Tensor) -> DTensor:
        """A tensor made inside the graph (the same on every rank) as a DTensor: batch rows split over dp."""
        dp = self.mesh.size(0)
        if dp > 1 and self.batch_size and t.ndim >= 2 and t.shape[0] == self.batch_size and t.shape[0] % dp == 0:
            rows = t.chunk(dp, dim=0)[self.mesh.get_local_rank(0)]
            return DTensor.from_local(rows, self.mesh, (Shard(0), R), run_check=False)
        return self._replicated(t)

    def _keep_segment_inputs(self) -> None:
        """Free values after their last use, a segment's uses counting at the segment's last node (where it runs)."""
        last = {n: seg.nodes[-1] for seg in self.segments for n in seg.nodes}
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        last_use: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            at = last.get(node, node)
            for value in node.all_input_nodes:
                if value not in last_use or order[at] >= order[last_use[value]]:
                    last_use[value] = at
        self.user_to_last_uses = {}
        for value, user in last_use.items():
            self.user_to_last_uses.setdefault(user, []).append(value)

    def run_node(self, n: fx.Node):
        if n in self._in_segment:
            return None  # runs with its segment, at the segment's last node
        seg = self._segment_at.get(n)
        self._make_deferred(seg.inputs if seg is not None else n.all_input_nodes)
        if seg is not None:
            return self._run_segment(seg)
        if n.name in self._offloaded:
            with self.activation_offload:
                return self._run_op(n)
        return self._run_op(n)

    def _make_deferred(self, nodes) -> None:
        """Make the `Deferred` placeholder values among `nodes`, once a run (env keeps what they make)."""
        for a in nodes:
            v = self.env.get(a)
            if isinstance(v, Deferred):
                v = self.env[a] = v.make()
                if self.activation_offload is not None:
                    self._note_parameter(v)

    def _run_segment(self, seg: _Segment):
        """Run a segment under non-reentrant checkpointing; its outputs other than the last go straight to env."""
        inputs = [self.env[v] for v in seg.inputs]
        outs = torch.utils.checkpoint.checkpoint(self._segment_body, seg, *inputs, use_reentrant=False)
        for node, value in zip(seg.outputs, outs, strict=True):
            self.env[node] = value
        return outs[seg.outputs.index(seg.nodes[-1])] if seg.nodes[-1] in seg.outputs else None

    def _segment_body(self, seg: _Segment, *inputs):
        self.segment_calls += 1
        outer = self.env
        self.env = dict(zip(seg.inputs, inputs, strict=True))
        try:
            for node in seg.nodes:
                self.env[node] = self._run_op(node)
            return tuple(self.env[node] for node in seg.outputs)
        finally:
            self.env = outer

    def _run_op(self, n: fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        need = self.need.get(n.name, ())
        distributed = any(isinstance(v, DTensor) for a in n.all_input_nodes for v in pytree.tree_leaves(self.env[a]))
        position = itertools.count()

        def load(arg: fx.Node):
            v = self.env[arg]
            if distributed and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                v = self._entering(v)  # made inside the graph from nothing: the same on every rank
            if arg.name in self.params:
                v = self.gather(arg.name, v)
            if is_tensor_node(arg):
                j = next(position)
                if j < len(need):
                    v = self._to(v, need[j])
            return v

        args = fx.node.map_arg(n.args, load)
        kwargs = fx.node.map_arg(n.kwargs, load)
        out = self._call(n.target, args, kwargs, distributed=distributed)
        early = n.name in self.launched_early
        for want in (self.out.get(n.name), self.consumed_as.get(n.name)):
            if want is not None:
                out = pytree.tree_map(
                    lambda v, w=want: self._to(v, w, early=early) if isinstance(v, DTensor) else v, out
                )
        return out

    def _call(self, target, args, kwargs, *, distributed: bool):
        if target in _SKIPPED:
            return None
        if not distributed:
            return target(*args, **kwargs)
        if target in _VIEWS:
            # after a redistribution the local piece may be laid out differently than the traced tensor was
            out = aten.reshape.default(*args, **kwargs)
            return _ContiguousGrad.apply(out) if out.requires_grad else out
        if target in self.local_ops:
            return self.local_ops[target](target, args, kwargs)
        if str(target) in self.fallback_ops:
            return self._run_gathered(target, args, kwargs)
        try:
            return target(*args, **kwargs)
        except NotImplementedError:
            self.fallback_ops.add(str(target))
            return self._run_gathered(target, args, kwargs)

    def _run_local(self, target, args, kwargs):
        """Run an op independently on each rank's slice (valid for attention split on batch or heads).

        The data axis is put back on the batch dimension first: DTensor's view rules may have moved
        it to another dimension on the way.
        """
        q = args[0]
        batch, dp = q.shape[0], self.mesh.size(0)

        def placements(v: DTensor):
            dp_pl = Shard(0) if dp > 1 and v.ndim and v.shape[0] == batch and batch % dp == 0 else R
            return (dp_pl, v.placements[1])

        out_pl = placements(q)
        la, lk = pytree.tree_map(
            lambda v: v.redistribute(self.mesh, placements(v)).to_local() if isinstance(v, DTensor) else v,
            (args, kwargs),
        )
        # flash attention also returns its LSE (batch, heads, seq_q): split on batch and heads like the output
        local = target(*la, **lk)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: DTensor.from_local(t, self.mesh, out_pl, run_check=False), local
        )

    def _cp_attention(self, target, args, kwargs):
        """Attention of each rank's rows (its sequences' cp chunk) against the whole sequence, over the cp group.

        SDPA ``(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`` or flash attention
        ``(q, k, v, causal, scale)``, which also returns an LSE: nothing in the graph reads it, so it comes back
        as None. Causal when asked, or when the graph built a mask (see the module docstring).
        """
        from autopar.context_parallel import cp_attention

        flash = target is not aten.scaled_dot_product_attention.default
        names = (
            ("q", "k", "v", "causal", "scale")
            if flash
            else ("q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        )
        bound = dict(zip(names, args, strict=False)) | kwargs
        causal = (
            bool(bound.get("causal")) if flash else bool(bound.get("is_causal")) or bound.get("attn_mask") is not None
        )
        if not flash and bound.get("dropout_p", 0.0):
            raise LoweringError(
                "context-parallel attention runs without dropout; set the model's attention dropout to 0 for a cp plan"
            )
        q = bound["q"]
        batch, data = q.shape[0], self.mesh.size(0)

        def rows(v: DTensor) -> tuple:
            return (Shard(0) if data > 1 and v.shape[0] == batch and batch % data == 0 else R, v.placements[1])

        out_pl = rows(q)
        lq, lk, lv = (bound[n].redistribute(self.mesh, rows(bound[n])).to_local() for n in ("q", "k", "v"))
        out = cp_attention(
            lq, lk, lv, group=self.cp_group, causal=causal, algorithm=self.cp_algorithm, scale=bound.get("scale")
        )
        out = DTensor.from_local(out, self.mesh, out_pl, run_check=False)
        return (out, None) if flash else out

    def _cross_entropy(self, target, args, kwargs):
        """Mean cross-entropy over rows split on the data axis: global sum / global count of kept labels.

        DTensor would average the per-rank means, which is wrong once ranks hold different numbers
        of ignored labels; summing both parts over the ranks is exact.
        """
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        bound = dict(zip(names, args, strict=False)) | kwargs
        logits, labels = bound["input"], bound["target"]
        reduction = bound.get("reduction", 1)
        dp = self.mesh.size(0)
        ignore = bound.get("ignore_index", -100)
        if bound.get("weight") is not None or reduction != 1 or dp == 1 or logits.shape[0] % dp:
            if bound.get("weight") is None and reduction == 1:
                full = labels.full_tensor() if isinstance(labels, DTensor) else labels
                self.loss_counts.append(float((full != ignore).sum()))
            return self._run_gathered(target, args, kwargs) if dp > 1 else target(*args, **kwargs)
        rows = (Shard(0), R)
        local_logits = logits.redistribute(self.mesh, rows).to_local()
        local_labels = labels.redistribute(self.mesh, rows).to_local()
        total = target(local_logits, local_labels, None, 2, ignore, bound.get("label_smoothing", 0.0))
        count = (local_labels != ignore).sum().to(total.dtype)
        partial = (Partial(), R)
        total = DTensor.from_local(total, self.mesh, partial, run_check=False).redistribute(self.mesh, (R, R))
        count = DTensor.from_local(count, self.mesh, partial, run_check=False).redistribute(self.mesh, (R, R))
        self.loss_counts.append(float(count.to_local()))
        return total / count

    def _norm(self, target, args, kwargs):
        """A fused norm (autopar::rms_norm / layer_norm) on each rank's rows; weight and bias whole.

        Rows stay split where the input is split on a dim other than the last (batch over dp, the plan's
        strategy over tp); the weight's gradient from each rank's rows is a partial sum on those axes.
        The row statistics the kernel also returns are its own business (nothing in a fused graph reads
        them): they come back as None.
        """
        x, *rest = args
        rows = tuple(p if isinstance(p, Shard) and p.dim < x.ndim - 1 else R for p in x.placements)
        grads = tuple(P if isinstance(p, Shard) else R for p in rows)
        local = [x.redistribute(self.mesh, rows).to_local()]
        for a in rest:
            local.append(
                a.redistribute(self.mesh, (R, R)).to_local(grad_placements=grads) if isinstance(a, DTensor) else a
            )
        y, *stats = target(*local, **kwargs)
        y = DTensor.from_local(y, self.mesh, rows, run_check=False, shape=x.shape, stride=x.stride())
        return (y, *(None for _ in stats))

    def _linear_cross_entropy(self, target, args, kwargs):
        """autopar::linear_cross_entropy on each rank's tokens: global loss sum / global count of kept labels.

        Tokens are split over dp (when there are enough) and over tp where the plan's strategy splits them;
        the LM-head weight is whole on every rank and its gradient is a partial sum. A rank whose labels are
        all ignored contributes 0 (its own mean would be 0 / 0) and a zero gradient.
        """
        hidden, weight, labels, ignore, *rest = args
        tp_pl = hidden.placements[1]
        d = tp_pl.dim if isinstance(tp_pl, Shard) and tp_pl.dim < hidden.ndim - 1 else None
        dp_pl = Shard(0) if self.mesh.size(0) > 1 and hidden.shape[0] >= self.mesh.size(0) else R
        rows = (dp_pl, Shard(d) if d is not None else R)
        grads = tuple(P if isinstance(p, Shard) else R for p in rows)
        local_labels = labels.redistribute(self.mesh, rows).to_local()
        mean = target(
            hidden.redistribute(self.mesh, rows).to_local(),
            weight.redistribute(self.mesh, (R, R)).to_local(grad_placements=grads),
            local_labels,
            ignore,
            *rest,
            **kwargs,
        )[0]
        count = (local_labels != ignore).sum()
        total = torch.where(count > 0, mean, torch.zeros_like(mean)) * count.to(mean.dtype)
        total = DTensor.from_local(total, self.mesh, grads, run_check=False).redistribute(self.mesh, (R, R))
        count = DTensor.from_local(count.to(torch.float64), self.mesh, grads, run_check=False)
        count = float(count.redistribute(self.mesh, (R, R)).to_local())
        self.loss_counts.append(count)
        return (total / count, None, None)

    def _run_gathered(self, target, args, kwargs):
        fa, fk = pytree.tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, (args, kwargs))
        out = target(*fa, **fk)
        return pytree.tree_map(lambda v: self._replicated(v) if isinstance(v, torch.Tensor) else v, out)


class _Segment:
    """A recompute segment of the graph: its nodes in order, the values it reads and the values read after it."""

    __slots__ = ("nodes", "inputs", "outputs")

    def __init__(self, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]):
        self.nodes, self.inputs, self.outputs = nodes, inputs, outputs

    @classmethod
    def of(cls, graph: fx.Graph, names: tuple[str, ...]) -> _Segment:
        by_name = {n.name: n for n in graph.nodes}
        nodes = [by_name[name] for name in names]
        members = set(nodes)
        inputs = list(dict.fromkeys(v for n in nodes for v in n.all_input_nodes if v not in members))
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        return cls(nodes, inputs, outputs)


# the ops the interpreter runs on local tensors, by the method that runs them (attention: `_run_local`, which a
# cp plan replaces by `_cp_attention`); autopar's fused ops where autopar.triton_kernels registered them
_LOCAL_ATEN = {
    aten.scaled_dot_product_attention.default: "_run_local",
    aten.cross_entropy_loss.default: "_cross_entropy",
}
_LOCAL_FUSED = {
    "flash_attention": "_run_local",
    "rms_norm": "_norm",
    "layer_norm": "_norm",
    "linear_cross_entropy": "_linear_cross_entropy",
}


def _local_op_methods() -> dict:
    """Op overload -> the name of the `ShardedInterpreter` method that runs it on local tensors."""
    out = dict(_LOCAL_ATEN)
    for name, method in _LOCAL_FUSED.items():
        op = getattr(torch.ops.autopar, name, None)
        if op is not None:
            out[op.default] = method
    return out


def local_op_targets() -> frozenset:
    """The ops the interpreter runs on local tensors (`ShardedInterpreter.local_ops`, without a caller's own): no
    collective of an argument of theirs is launched early, as they hand local tensors to kernels."""
    return frozenset(_local_op_methods())


def launches_early(node: fx.Node, order: dict, local_targets) -> bool:
    """Whether the interpreter launches the tensor-axis collective of `node`'s output where it is made (the rule of
    `ShardedInterpreter._launch_early`, which the sharding program prices): its first consumer is not the very next
    node (`order`: node -> position), and every consumer is an ATen op DTensor runs (none of `local_targets`)."""
    users = list(node.users)
    if node.op != "call_function" or not users:
        return False
    if any(u.op != "call_function" or u.target in local_targets for u in users):
        return False
    return min(order[u] for u in users) > order[node] + 1


def shard_pass(
    gm: fx.GraphModule,
    example_inputs,
    *,
    mesh: DeviceMesh,
    node_inputs: dict,
    node_output: dict,
    local_ops: dict | None = None,
    batch_size: int | None = None,
    recompute: str = "none",
    layer_modes: dict | None = None,
    cp_group=None,
    cp_algorithm: str | None = None,
    params: frozenset[str] = frozenset(),
    gather=None,
    launch_early: bool = True,
) -> ShardedInterpreter:
    """The rewrite pass: bind `gm` to the plan and mesh; the result runs the parallel program.

    `recompute` is the plan's activation recompute mode: its segments run under checkpointing. `params` names
    the placeholders that hold parameters, `gather` how one split over the data axis is gathered (see
    `ShardedInterpreter`).
    """
    del example_inputs  # placements come from the plan; shapes from the graph
    return ShardedInterpreter(
        gm,
        mesh,
        node_inputs,
        node_output,
        local_ops,
        batch_size,
        recompute,
        layer_modes,
        cp_group,
        cp_algorithm,
        params=params,
        gather=gather,
        launch_early=launch_early,
    )


def gathered_over_dp(value):
    """A parameter split over the data axis (ZeRO-3), whole there (its tensor-axis placement kept)."""
    if not isinstance(value, DTensor) or not value.placements[0].is_shard():
        return value
    return value.redistribute(value.device_mesh, (R, *value.placements[1:]))


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of `full` under `placements`, cut locally (every rank holds the same full tensor)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), mesh, placements, src_data_rank=None).to_local().clone()


def dp_placement(shape: tuple[int, ...], dp: int, sharded: bool, tp_placement: Placement = R) -> Placement:
    """Placement of a parameter on the data axis: under ZeRO, Shard of its first dim that splits over dp and is
    not the one the tensor axis splits (DTensor's redistributions of a dim sharded over both mesh axes, e.g.
    (Shard(0), Shard(0)) to (Replicate, Shard(0)) for a column-parallel weight, give wrong local shapes); else
    replicated."""
    if not sharded or dp <= 1:
        return R
    taken = tp_placement.dim if isinstance(tp_placement, Shard) else None
    for d, size in enumerate(shape):
        if d != taken and size >= dp:
            return Shard(d)
    return R

"""Lowering: the traced graph and the plan's tensor-axis placements become a graph of local ops and collectives.

`lower_pass` runs once, when a program is built. Its input is an exported training-IR graph traced at the shape one
rank of the data axis sees (its rows of one micro-batch, `Program.trace_parts`), so that no activation carries the
data axis any more: what is left is the tensor axis, which the plan places op by op (`sharding_rules`), and the
parameters, which the program hands in as this rank's pieces. For every op the plan's strategy fixes the placement
each tensor argument must have and the placement of the output; the pass emits

1. for every argument whose producer's placement is not the one the strategy takes, or whose gradient the op hands
   back in another layout than the producer's: a conversion (`Convert`, an autograd Function over the tensor-axis
   group: forward the producer's placement -> the argument's, backward the op's gradient layout -> the producer's);
   a parameter first passes the program's hooks (`ParamHooks`: made where the graph first reads it, and gathered
   over the data axis for each use where ZeRO splits it);
2. the op itself on local tensors, the shape arguments of views and expands being those of its output's local
   piece; the ops a rank runs its own way: the vocabulary-parallel embedding (a masked lookup: a partial sum), the
   fused LM-head loss on split tokens (its sum and kept-label count summed over the axis), attention across the cp
   group (`context_parallel.cp_attention`);
3. nothing after it: the local output is in the strategy's output placement by construction.

So what runs each step is straight-line Python over plain tensors (`recompile()`), one explicit collective per
placement change the plan prices, and `torch.compile` can take it over.

Gradient layouts. Autograd accumulates a value's gradient locally, so every consumer must hand it back in one
layout: the value's own when it is split on a dim, replicated when it is replicated or a partial sum (the gradient
of a sum is the same for each summand). An op hands back, for an argument split on dim d, the gradient split on d;
for a partial argument, a replicated one; for a replicated argument a replicated one when its output is replicated,
else a partial sum (each rank differentiates its piece of the output only). Where that differs from the producer's
layout the conversion's backward changes it (all-reduce, reduce-scatter or a local slice). A replicated argument of
an op whose output is a partial sum (a row-parallel linear's bias) is divided by the axis size first (DTensor's
Replicate -> Partial), so that the sum over ranks adds it once.

Early launch (`launch_early`, the plan's `overlap`): where every consumer of a value asks the same placement of it
and the first consumer is not the very next op (`parallelize.launches_early`, the rule the plan prices), the
conversion is emitted where the value is made and not waited for: the first op that reads it waits
(an `AsyncCollectiveTensor`).

Recompute and activation offload: each segment of the plan's recompute mode (`passes.recompute`), and each run of
consecutive nodes of a layer whose saved activations live on the host, is lowered into a region of its own
(a submodule): a segment runs under non-reentrant checkpointing (its collectives and gathers run again when the
backward recomputes it), an offloaded run under the program's saved-tensor hooks.

Fallback, by one rule: an op whose planned strategy is not one of its strategies on the graph lowered (its local
shapes do not split over the tensor axis, e.g. a batch of one row) runs replicated; such nodes are listed in
`Lowering.replicated`, and the program warns.

Input: the graph (after `program_graph`'s passes), knobs naming the plan's placements and the program's hooks.
Output: an `fx.GraphModule` of ATen ops on local tensors, `Convert` modules and hook calls;
`gm.meta["autopar_lowering"]` is the `Lowering` record (regions, fallbacks, collectives emitted).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar import compat
from autopar.ir import is_tensor_node
from autopar.passes.parallelize import launches_early, local_op_targets
from autopar.passes.recompute import offloaded_nodes, plan_segments
from autopar.passes.sharding_rules import is_masked_partial, parse_placement, placement_str, strategies_for

aten = torch.ops.aten
R = Replicate()
P = Partial()

# view-like ops whose size argument (args[1]) is the output's shape: the local piece's shape replaces it
_SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
# ops with a bias a partial output must add once (Replicate -> Partial divides it by the axis size)
_LOSS_FUSED = "autopar.linear_cross_entropy.default"
_ATTENTION = {"aten.scaled_dot_product_attention.default", "autopar.flash_attention.default"}


class ParamHooks(Protocol):
    """What the program does to a parameter placeholder's value in the graph (this rank's local piece)."""

    def enter(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """The parameter as the graph computes with it (its compute-format copy, ...), made at its first read."""

    def gather(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """The parameter whole on the data axis, for one op that reads it (ZeRO's split parameters only)."""


# ---------------------------------------------------------------------------------------------- the tensor axis


@dataclass(frozen=True, slots=True)
class TensorAxis:
    """The tensor-parallel group of this rank: its process group (None for one rank), size and rank in it."""

    group: object
    size: int
    rank: int


def _same(a: Placement, b: Placement) -> bool:
    if a.is_partial() or is_masked_partial(a):
        return b.is_partial() or is_masked_partial(b)
    return a == b


def _partial(p: Placement) -> bool:
    return p.is_partial() or is_masked_partial(p)


def grad_layout(p: Placement) -> Placement:
    """The layout a value of placement `p` keeps its gradient in: its own, replicated for a partial sum."""
    return R if _partial(p) else p


def op_grad_layout(arg: Placement, out: Placement) -> Placement:
    """The layout an op hands back the gradient of an argument placed `arg` in, its output placed `out`."""
    if isinstance(arg, Shard):
        return arg
    if _partial(arg):
        return R
    return R if out == R else P


def convert(t: torch.Tensor, src: Placement, dst: Placement, axis: TensorAxis, *, wait: bool = True) -> torch.Tensor:
    """`t`, this rank's piece of a value placed `src` on the tensor axis, as its piece under `dst`.

    A collective is issued through the functional collectives (so a step's collectives are those DTensor would
    run); with `wait` False the result is an `AsyncCollectiveTensor` the first op that reads it waits for.
    """
    if _same(src, dst) or axis.size == 1:
        return t
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):
            return t.chunk(axis.size, dst.dim)[axis.rank].contiguous()
        return t / axis.size  # -> Partial: the sum over ranks is t
    if _partial(src):
        if isinstance(dst, Replicate):
            out = compat.funcol_all_reduce(t.contiguous(), axis.group)
        else:
            out = compat.funcol_reduce_scatter(t.contiguous(), dst.dim, axis.group)
        return _waited(out) if wait else out
    # src is Shard(d): gather it whole first
    whole = compat.funcol_all_gather(t.contiguous(), src.dim, axis.group)
    if isinstance(dst, Replicate):
        return _waited(whole) if wait else whole
    whole = _waited(whole)
    if isinstance(dst, Shard):
        return whole.chunk(axis.size, dst.dim)[axis.rank].contiguous()
    return whole / axis.size


def _waited(t: torch.Tensor) -> torch.Tensor:
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


class _Convert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec):
        ctx.spec = spec
        return convert(x, spec.src, spec.dst, spec.axis, wait=not spec.early)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if grad is None:
            return None, None
        return convert(grad, spec.grad_src, spec.grad_dst, spec.axis), None


class Convert(torch.nn.Module):
    """One placement change on the tensor axis: forward `src` -> `dst`; backward the gradient's layout as the
    consumer hands it back (`grad_src`) -> the producer's (`grad_dst`). `early`: not waited for (see the module
    docstring). A value that needs no gradient skips the autograd Function."""

    def __init__(self, src, dst, grad_src, grad_dst, axis: TensorAxis, *, early: bool = False):
        super().__init__()
        self.src, self.dst, self.grad_src, self.grad_dst = src, dst, grad_src, grad_dst
        self.axis, self.early = axis, early

    def forward(self, x):
        if not x.requires_grad or not torch.is_grad_enabled():
            return convert(x, self.src, self.dst, self.axis, wait=not self.early)
        return _Convert.apply(x, self)

    def extra_repr(self) -> str:
        words = f"{placement_str(self.src)} -> {placement_str(self.dst)}"
        words += f", grad {placement_str(self.grad_src)} -> {placement_str(self.grad_dst)}"
        return words + (", early" if self.early else "")

    @property
    def collectives(self) -> tuple[bool, bool]:
        """Whether the forward and the backward each issue a collective."""
        return _communicates(self.src, self.dst), _communicates(self.grad_src, self.grad_dst)


def _communicates(src: Placement, dst: Placement) -> bool:
    """Whether `convert` issues a collective (replicated to split or partial is local)."""
    return not _same(src, dst) and not isinstance(src, Replicate)


# ---------------------------------------------------------------------------------------- local ops of their own


class VocabEmbedding(torch.nn.Module):
    """`aten.embedding` on this rank's rows of a vocabulary split over the tensor axis: ids outside them look up
    row 0 and are zeroed, so the output is a partial sum over the axis (DTensor's masked partial)."""

    def __init__(self, vocab: int, axis: TensorAxis):
        super().__init__()
        self.rows = vocab // axis.size
        self.start = axis.rank * self.rows

    def forward(self, weight, ids, padding_idx=-1, *rest):
        outside = (ids < self.start) | (ids >= self.start + self.rows)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        local_pad = padding_idx - self.start if self.start <= padding_idx < self.start + self.rows else -1
        out = aten.embedding.default(weight, local_ids, local_pad, *rest)
        return out.masked_fill(outside.unsqueeze(-1), 0)


class _SumOverAxis(torch.autograd.Function):
    """A partial sum over the tensor axis made whole; the gradient of the sum is each summand's (identity)."""

    @staticmethod
    def forward(ctx, x, axis):
        return _waited(compat.funcol_all_reduce(x.contiguous(), axis.group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TokenSplitLoss(torch.nn.Module):
    """autopar::linear_cross_entropy on this rank's tokens (split over the tensor axis on `dim`): the loss sum and
    the kept-label count summed over the axis, their ratio the exact mean; the LM-head weight's gradient is this
    rank's partial sum (a rank whose labels are all ignored adds 0)."""

    def __init__(self, target, axis: TensorAxis):
        super().__init__()
        self.target, self.axis = target, axis

    def forward(self, hidden, weight, labels, ignore, *rest):
        mean = self.target(hidden, weight, labels, ignore, *rest)[0]
        count = (labels != ignore).sum()
        total = torch.where(count > 0, mean, torch.zeros_like(mean)) * count.to(mean.dtype)
        total = _SumOverAxis.apply(total, self.axis)
        count = _waited(compat.funcol_all_reduce(count.to(torch.float64), self.axis.group))
        return (total / count.to(total.dtype), None, None)


class CPAttention(torch.nn.Module):
    """Attention of this rank's rows (its sequences' cp chunk) against the whole sequence over the cp group:
    SDPA `(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)` or flash `(q, k, v, causal, scale)` (whose
    LSE nothing reads: None). Causal when asked, or when the graph built a mask (a cp plan takes no padding mask)."""

    def __init__(self, flash: bool, group, algorithm: str):
        super().__init__()
        self.flash, self.group, self.algorithm = flash, group, algorithm

    def forward(self, *args, **kwargs):
        from autopar.context_parallel import cp_attention
        from autopar.errors import LoweringError

        names = ("q", "k", "v", "causal", "scale") if self.flash else ("q", "k", "v", "attn_mask", "dropout_p")
        names += () if self.flash else ("is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args, strict=False)) | kwargs
        if self.flash:
            causal = bool(bound.get("causal"))
        else:
            causal = bool(bound.get("is_causal")) or bound.get("attn_mask") is not None
            if bound.get("dropout_p", 0.0):
                raise LoweringError(
                    "context-parallel attention runs without dropout; set the model's attention dropout to 0 for a "
                    "cp plan"
                )
        out = cp_attention(
            bound["q"],
            bound["k"],
            bound["v"],
            group=self.group,
            causal=causal,
            algorithm=self.algorithm,
            scale=bound.get("scale"),
        )
        return (out, None) if self.flash else out


# ----------------------------------------------------------------------------------------------------- regions


def run_graph(gm: fx.GraphModule, *args):
    """Run a lowered graph (or a region's): every run goes through here, so that a test can watch its nodes."""
    return gm(*args)


class SegmentBody(torch.nn.Module):
    """A region's graph; counts its runs (forward, and each recompute in backward) in `record.segment_calls`."""

    def __init__(self, gm: fx.GraphModule, record: Lowering):
        super().__init__()
        self.gm = gm
        self._record = (record,)  # boxed: not a submodule

    def forward(self, *args):
        self._record[0].segment_calls += 1
        return run_graph(self.gm, *args)


class Checkpointed(torch.nn.Module):
    """A recompute segment: its body under non-reentrant checkpointing (the forward keeps only its inputs)."""

    def __init__(self, body: SegmentBody):
        super().__init__()
        self.body = body

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False)


class Offloaded(torch.nn.Module):
    """A run of nodes whose saved activations live on the host: run under the program's saved-tensor hooks."""

    def __init__(self, gm: fx.GraphModule, hooks):
        super().__init__()
        self.gm = gm
        self._hooks = (hooks,)

    def forward(self, *args):
        with self._hooks[0]:
            return run_graph(self.gm, *args)


class HookCall(torch.nn.Module):
    """A parameter hook of the program, `hooks.<kind>(index, x)`, as a node of the graph."""

    def __init__(self, hooks: ParamHooks, kind: str, index: int):
        super().__init__()
        self._fn = getattr(hooks, kind)
        self.kind, self.index = kind, index

    def forward(self, x):
        return self._fn(self.index, x)

    def extra_repr(self) -> str:
        return f"{self.kind} {self.index}"


@dataclass
class Lowering:
    """What `lower_pass` did: the regions it made (segments: node names), the nodes it ran replicated instead of as
    planned (the fallback rule), the parameters read inside a recompute segment, the output placements, and the
    tensor-axis collectives it emitted (forward, backward); `segment_calls` counts region bodies run."""

    segments: tuple[tuple[str, ...], ...] = ()
    replicated: tuple[str, ...] = ()
    params_in_segments: frozenset[str] = frozenset()
    outputs: tuple = ()
    forward_collectives: int = 0
    backward_collectives: int = 0
    early: tuple[str, ...] = ()
    segment_calls: int = 0
    fallback_ops: set = field(default_factory=set)


# ----------------------------------------------------------------------------------------------------- the pass


def local_shape(shape, placement: Placement, tp: int) -> list[int]:
    """The shape of one rank's piece of a value of `shape` placed `placement` on a tensor axis of `tp` ranks."""
    out = list(shape)
    if isinstance(placement, Shard):
        out[placement.dim] //= tp
    return out


def lower_pass(
    gm: fx.GraphModule,
    example_inputs,
    *,
    axis: TensorAxis,
    node_inputs: dict,
    node_output: dict,
    param_placements: dict[str, str],
    params: dict[str, int],
    split_params: frozenset[str] = frozenset(),
    hooks: ParamHooks,
    replicated_outputs: tuple[int, ...] = (),
    recompute: str = "none",
    layer_modes: dict | None = None,
    activation_offload=None,
    launch_early: bool = True,
    cp_group=None,
    cp_algorithm: str | None = None,
) -> fx.GraphModule:
    """Lower `gm` to local ops and explicit collectives (see the module docstring); a new graph module.

    Args:
        axis: this rank's tensor-axis group.
        node_inputs, node_output: the plan's placements per node (strings, as `Plan` holds them).
        param_placements: parameter placeholder name -> its tensor-axis placement (string).
        params: parameter placeholder name -> its index in the program's lists (what the hooks take).
        split_params: the parameter placeholders split over the data axis: `hooks.gather` runs at each use.
        hooks: the program's parameter hooks (`ParamHooks`).
        replicated_outputs: indices of the graph's outputs made replicated on the axis (the loss, its count).
        recompute, layer_modes: the plan's activation recompute mode and per-layer treatments.
        activation_offload: the saved-tensor hooks offloaded layers run under (None: none offloaded).
        launch_early: launch a conversion where its value is made (see the module docstring).
        cp_group, cp_algorithm: a cp plan's cp process group and attention algorithm (None: no cp axis).
    """
    del example_inputs  # shapes come from the graph
    lowering = _Lowerer(
        gm,
        axis=axis,
        need={k: tuple(parse_placement(p) for p in v) for k, v in node_inputs.items()},
        out={k: parse_placement(v) for k, v in node_output.items()},
        param_placements={k: parse_placement(v) for k, v in param_placements.items()},
        params=params,
        split_params=split_params,
        hooks=hooks,
        launch_early=launch_early,
        cp=(cp_group, cp_algorithm) if cp_group is not None else None,
    )
    return lowering.run(replicated_outputs, recompute, layer_modes, activation_offload)


class _Lowerer:
    """The state of one lowering: placements decided per node, the modules made, the record."""

    def __init__(self, gm, *, axis, need, out, param_placements, params, split_params, hooks, launch_early, cp):
        self.src_gm, self.graph = gm, gm.graph
        self.axis, self.need_of, self.out_of = axis, need, out
        self.param_placements, self.params, self.split = param_placements, params, split_params
        self.hooks, self.cp = hooks, cp
        self.root = torch.nn.Module()
        self.names = itertools.count()
        self.record = Lowering()
        self.region_of: dict[fx.Node, int] = {}
        self.placement: dict[fx.Node, Placement] = {}
        self.strategy: dict[fx.Node, tuple[tuple[Placement, ...], Placement]] = {}
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        local_targets = local_op_targets()
        self.early: dict[fx.Node, Placement] = {}
        if launch_early and axis.size > 1:
            for n in self.graph.nodes:
                if launches_early(n, self.order, local_targets):
                    wanted = {self._asked(u, n) for u in n.users}
                    if len(wanted) == 1 and (want := wanted.pop()) is not None and not _partial(want):
                        self.early[n] = want
        self._decide_strategies()

    # ---------------------------------------------------------------------------------------- placements

    def _decide_strategies(self) -> None:
        """Each op's (argument placements, output placement): the plan's where it is one of the op's strategies on
        this graph, else replicated (the fallback rule); placeholders: parameters as placed, others replicated."""
        tp, replicated = self.axis.size, []
        for n in self.graph.nodes:
            if n.op == "placeholder":
                self.placement[n] = self.param_placements.get(n.name, R) if n.name in self.params else R
            elif n.op == "get_attr":
                self.placement[n] = R
            elif n.op == "call_function":
                self.strategy[n] = self._strategy(n, tp, replicated)
                self.placement[n] = self.strategy[n][1]
        self.record.replicated = tuple(replicated)

    def _strategy(self, n: fx.Node, tp: int, replicated: list) -> tuple[tuple[Placement, ...], Placement]:
        args = [a for a in _tensor_leaves(n)]
        if n.target is operator.getitem:
            src = self.placement.get(n.args[0], R)
            return (src,), src
        if tp == 1 or n.name not in self.out_of:
            return (R,) * len(args), R
        need, out = self.need_of.get(n.name, (R,) * len(args)), self.out_of[n.name]
        if len(need) < len(args):
            need = need + (R,) * (len(args) - len(need))
        if all(p == R for p in need) and out == R:
            return need, out
        key = tuple(placement_str(p) for p in need) + (placement_str(out),)
        for s in strategies_for(n, tp):
            if tuple(placement_str(p) for p in s.inputs) + (placement_str(s.output),) == key:
                return need, out
        replicated.append(n.name)
        self.record.fallback_ops.add(str(n.target))
        return (R,) * len(args), R

    def _asked(self, user: fx.Node, value: fx.Node) -> Placement | None:
        """The placement `user` asks of `value` (None: none, or different ones at two positions)."""
        need = self.need_of.get(user.name, ())
        asked = {need[j] if j < len(need) else R for j, a in enumerate(_tensor_leaves(user)) if a is value}
        return asked.pop() if len(asked) == 1 else None

    # ------------------------------------------------------------------------------------------- running

    def run(self, replicated_outputs, recompute, layer_modes, activation_offload) -> fx.GraphModule:
        segments = plan_segments(self.graph, recompute, layer_modes)
        by_name = {n.name: n for n in self.graph.nodes}
        regions = [("checkpoint", [by_name[x] for x in seg]) for seg in segments]
        in_segment = {n for _, nodes in regions for n in nodes}
        offloaded = offloaded_nodes(self.graph, layer_modes) if activation_offload is not None else frozenset()
        run: list[fx.Node] = []
        for n in [*self.graph.nodes, None]:
            if n is not None and n.name in offloaded and n not in in_segment:
                run.append(n)
                continue
            if run:
                regions.append(("offload", run))
                run = []
        self.record.segments = tuple(segments)
        self.record.params_in_segments = frozenset(
            a.name
            for _, nodes in regions[: len(segments)]
            for m in nodes
            for a in m.all_input_nodes
            if a.name in self.params
        )
        self.region_of = {n: k for k, (_, nodes) in enumerate(regions) for n in nodes}
        outer = _Builder(self, fx.Graph())
        last = {nodes[-1]: (kind, nodes) for kind, nodes in regions}
        inside = {n for _, nodes in regions for n in nodes}
        for n in self.graph.nodes:
            if n in last:
                kind, nodes = last[n]
                outer.region(kind, nodes, activation_offload)
            elif n in inside:
                continue
            elif n.op == "output":
                outer.output(n, replicated_outputs)
            else:
                outer.node(n)
        gm = fx.GraphModule(self.root, outer.graph)
        gm.meta["autopar_lowering"] = self.record
        gm.graph.lint()
        gm.recompile()
        return gm

    def module(self, prefix: str, module: torch.nn.Module) -> str:
        name = f"{prefix}_{next(self.names)}"
        self.root.add_module(name, module)
        return name


class _Builder:
    """Emits the lowered nodes of one graph (the outer one or a region's)."""

    def __init__(self, low: _Lowerer, graph: fx.Graph):
        self.low, self.graph = low, graph
        self.env: dict[fx.Node, fx.Node] = {}
        self.entered: dict[fx.Node, fx.Node] = {}  # parameter placeholder -> its value as the graph reads it
        self.hoisted: dict[fx.Node, tuple[fx.Node, Placement]] = {}  # value -> (converted early, its placement)

    # values

    def _enter(self, p: fx.Node) -> fx.Node:
        """Parameter placeholder `p` as the graph computes with it, made where it is first read (in this graph)."""
        if p not in self.entered:
            low = self.low
            hook = HookCall(low.hooks, "enter", low.params[p.name])
            self.entered[p] = self.graph.call_module(low.module("enter", hook), (self.env[p],))
        return self.entered[p]

    def _load(self, a: fx.Node, need: Placement, grad: Placement | None) -> fx.Node:
        """Argument `a` in placement `need`, its gradient coming back in layout `grad` (None: it has none)."""
        low = self.low
        if a.op == "placeholder" and a.name in low.params:
            value = self._enter(a)
            if a.name in low.split:
                hook = HookCall(low.hooks, "gather", low.params[a.name])
                value = self.graph.call_module(low.module("gather", hook), (value,))
            src = low.placement[a]
        elif a in self.hoisted:
            value, src = self.hoisted[a]
        else:
            value, src = self.env[a], low.placement[a]
        return self._convert(value, src, need, grad or grad_layout(src), grad_layout(src))

    def _convert(self, value, src, dst, grad_src, grad_dst, *, early: bool = False) -> fx.Node:
        low = self.low
        if (_same(src, dst) and _same(grad_src, grad_dst)) or low.axis.size == 1:
            return value
        module = Convert(src, dst, grad_src, grad_dst, low.axis, early=early)
        fwd, bwd = module.collectives
        low.record.forward_collectives += fwd
        low.record.backward_collectives += bwd
        return self.graph.call_module(low.module("convert", module), (value,))

    # nodes

    def node(self, n: fx.Node) -> None:
        if n.op == "placeholder":
            self.env[n] = self.graph.placeholder(n.name)
            self.env[n].meta = dict(n.meta)
            return
        if n.op == "get_attr":
            self.env[n] = self.graph.get_attr(n.target)
            _copy_attr(self.low, n.target)
            return
        self.env[n] = self._op(n)
        self.env[n].meta = dict(n.meta) | {"autopar_origin": n.name}
        self._maybe_hoist(n)

    def _op(self, n: fx.Node) -> fx.Node:
        low = self.low
        need, out = low.strategy[n]
        if n.target is operator.getitem:
            return self.graph.call_function(operator.getitem, (self._plain(n.args[0]), n.args[1]))
        out_eff = P if is_masked_partial(out) else out
        position = itertools.count()

        def load(a):
            if not is_tensor_node(a):
                return self._plain(a) if isinstance(a, fx.Node) else a
            j = next(position)
            want = need[j] if j < len(need) else R
            if _partial(out_eff) and want == R and _floating(a):
                want = P  # a bias added to a partial sum: once over the ranks
            return self._load(a, want, self._grad_of(n, want, out_eff) if _floating(a) else None)

        args = fx.node.map_arg(n.args, load)
        kwargs = fx.node.map_arg(n.kwargs, load)
        args = self._localize(n, args, out)
        special = self._special(n, need, out)
        if special is not None:
            name = low.module(type(special).__name__.lower(), special)
            return self.graph.call_module(name, tuple(args), dict(kwargs))
        return self.graph.call_function(n.target, tuple(args), dict(kwargs))

    def _plain(self, a: fx.Node) -> fx.Node:
        """A non-tensor value (or a tensor read as it is) in this graph."""
        if a.op == "placeholder" and a.name in self.low.params and a in self.env:
            return self._enter(a)
        return self.env[a]

    def _grad_of(self, n: fx.Node, arg: Placement, out: Placement) -> Placement:
        if str(n.target) == _LOSS_FUSED and isinstance(arg, Replicate) and self.low.axis.size > 1:
            need = self.low.strategy[n][0]
            if need and isinstance(need[0], Shard):
                return P  # the LM-head weight on split tokens: a partial sum (TokenSplitLoss)
        return op_grad_layout(arg, out)

    def _localize(self, n: fx.Node, args: tuple, out: Placement) -> tuple:
        if n.target not in _SIZED or not isinstance(out, Shard) or self.low.axis.size == 1:
            return args
        shape = n.meta["val"].shape
        return (args[0], local_shape(shape, out, self.low.axis.size), *args[2:])

    def _special(self, n: fx.Node, need, out) -> torch.nn.Module | None:
        """The module that runs `n` its own way on this rank (see the module docstring), or None."""
        low, target = self.low, str(n.target)
        if low.cp is not None and target in _ATTENTION:
            return CPAttention(target != "aten.scaled_dot_product_attention.default", *low.cp)
        if low.axis.size == 1:
            return None
        if n.target == aten.embedding.default and is_masked_partial(out):
            return VocabEmbedding(n.args[0].meta["val"].shape[0], low.axis)
        if target == _LOSS_FUSED and need and isinstance(need[0], Shard):
            return TokenSplitLoss(n.target, low.axis)
        return None

    def _maybe_hoist(self, n: fx.Node) -> None:
        """Launch the conversion every consumer asks of `n` where `n` is made (see the module docstring), when they
        all run in the graph `n` is made in."""
        low = self.low
        want = low.early.get(n)
        if want is None or not isinstance(n.meta.get("val"), torch.Tensor):
            return
        if any(low.region_of.get(u) != low.region_of.get(n) for u in n.users):
            return
        src = low.placement[n]
        if _same(src, want):
            return
        self.hoisted[n] = (self._convert(self.env[n], src, want, grad_layout(want), grad_layout(src), early=True), want)
        low.record.early += (n.name,)

    # regions and the output

    def region(self, kind: str, nodes: list[fx.Node], activation_offload) -> None:
        """Lower `nodes` into a submodule run as a checkpointed segment or under the offload hooks."""
        low = self.low
        members = set(nodes)
        inputs = list(dict.fromkeys(a for m in nodes for a in m.all_input_nodes if a not in members))
        outputs = [m for m in nodes if any(u not in members for u in m.users)]
        sub = _Builder(low, fx.Graph())
        for a in inputs:  # parameters enter out here (made where first read) and are gathered inside
            sub.env[a] = sub.graph.placeholder(a.name)
            sub.env[a].meta = dict(a.meta)
            if a.op == "placeholder" and a.name in low.params:
                sub.entered[a] = sub.env[a]
        for m in nodes:
            sub.node(m)
        sub.graph.output(tuple(sub.env[m] for m in outputs))
        body = fx.GraphModule(low.root, sub.graph)
        if kind == "checkpoint":
            module = Checkpointed(SegmentBody(body, low.record))
        else:
            module = Offloaded(body, activation_offload)
        args = tuple(self._enter(a) if a.op == "placeholder" and a.name in low.params else self.env[a] for a in inputs)
        call = self.graph.call_module(low.module(kind, module), args)
        for k, m in enumerate(outputs):
            self.env[m] = self.graph.call_function(operator.getitem, (call, k))
            self.env[m].meta = dict(m.meta)

    def output(self, n: fx.Node, replicated_outputs: tuple[int, ...]) -> None:
        low = self.low
        outs = list(n.args[0])
        placed = []
        for i, o in enumerate(outs):
            if not isinstance(o, fx.Node):
                placed.append(None)
                continue
            src = low.placement.get(o, R)
            value = self._plain(o)
            if i in replicated_outputs and is_tensor_node(o):
                value = self._convert(value, src, R, R, grad_layout(src))
                src = R
            outs[i] = value
            placed.append(src)
        self.graph.output(tuple(outs))
        low.record.outputs = tuple(placed)


def _tensor_leaves(n: fx.Node) -> list[fx.Node]:
    out = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a) if is_tensor_node(a) else None)
    return out


def _floating(a: fx.Node) -> bool:
    val = a.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _copy_attr(low: _Lowerer, target: str) -> None:
    """A `get_attr` target of the source graph (a folded constant) on the lowered module's root."""
    if hasattr(low.root, target):
        return
    value = getattr(low.src_gm, target)
    if isinstance(value, torch.Tensor):
        low.root.register_buffer(target, value, persistent=False)
    else:
        setattr(low.root, target, value)

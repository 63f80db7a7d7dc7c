"""Mesh-independent facts about a traced graph that every mesh's sharding program reads, computed once per graph.

Which values are split over the data axis (`batch_split_nodes`), which ones the loss is computed from and so get a
gradient (`loss_ancestors`), which parameters are matmul weights a tensor axis
must split (`matmul_weights`, `layer_matmul_weights`, the rule `TensorSplit`), which values backward keeps under each
recompute mode (`saved_for_backward`), and the recompute modes a program considers (`recompute_choices`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.fx as fx

from autopar.errors import ConfigError
from autopar.ir import NodeKind, OpGraph, output_meta, tensor_args
from autopar.passes.recompute import RECOMPUTE_MODES, recompute_segments, recomputed_nodes

# Ops whose output is a view of (or a name for) their input: no work of their own, no value kept.
VIEW_OPS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.expand.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.split.Tensor",
    "aten.alias.default",
    "aten.t.default",
    "<built-in function getitem>",
    "aten._assert_tensor_metadata.default",
    "aten.detach.default",
    "aten._unsafe_view.default",
}

# Ops that keep none of their inputs for the backward pass (the gradient does not need them): the views, and
# these.
NO_SAVE = VIEW_OPS | {
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.neg.default",
    "aten.cat.default",
    "aten.clone.default",
    "aten.contiguous.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy.default",
    "aten.dropout.default",
    "aten.add.Scalar",
    "aten.sub.Scalar",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.to.device",
}


_ANALYSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def analysis(graph: OpGraph) -> dict:
    """Mesh-independent facts about `graph` (per view of it), computed once and shared by every mesh's program."""
    found = _ANALYSES.get(graph.graph)
    if found is None:
        found = _ANALYSES[graph.graph] = {}
    return found.setdefault(graph.view, {})


def loss_ancestors(graph: fx.Graph) -> frozenset[fx.Node]:
    """The nodes the loss (the graph's first output) is computed from, itself included: the only ones backward
    gives a gradient. Every node where the first output is not a node."""
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    first = out.args[0] if out is not None else None
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    if not isinstance(first, fx.Node):
        return frozenset(graph.nodes)
    seen, todo = {first}, [first]
    while todo:
        for inp in todo.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return frozenset(seen)


def batch_split_nodes(graph: OpGraph, batch: int) -> frozenset[str]:
    """Nodes whose values are split over the data axis: those computed from the batch inputs.

    A value derived from a batch-split value stays split while it still holds at least one
    element per sample (views that flatten batch and sequence into tokens included); a loss
    reduced to a scalar does not. A value the graph makes from no input at all (a causal mask
    expanded to the batch) with the batch as its leading dimension is split too: it is the same
    on every rank, so each rank keeps its rows (the rewrite does the same).
    """
    cache = analysis(graph)
    if ("batch_split", batch) in cache:
        return cache[("batch_split", batch)]
    split: set[str] = set()
    made: set[str] = set()  # computed from no placeholder
    for node in graph.graph.nodes:
        args = tensor_args(node)
        if node.op == "call_function" and all(a.name in made for a in args):
            made.add(node.name)
        meta = output_meta(node)
        if meta is None or not meta.shape or meta.numel % batch:
            continue
        if graph.kinds.get(node.name) == NodeKind.INPUT:
            if meta.shape[0] == batch:
                split.add(node.name)
        elif node.op == "call_function" and any(a.name in split for a in args):
            split.add(node.name)
        elif node.name in made and len(meta.shape) >= 2 and meta.shape[0] == batch:
            split.add(node.name)
    out = cache[("batch_split", batch)] = frozenset(split)
    return out


# Matrix products and the argument holding the weight (None: whichever argument a parameter reaches)
_MATMUL_WEIGHT_ARG = {
    "aten.linear.default": 1,
    "aten.addmm.default": 2,
    "aten.mm.default": 1,
    "aten.bmm.default": None,
    "aten.matmul.default": None,
}


# Ops a weight passes through on its way to a matmul: views, casts, and the selection of experts
_WEIGHT_PATH_OPS = VIEW_OPS | {
    "aten.index.Tensor",
    "aten._to_copy.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.clone.default",
    "aten.contiguous.default",
    "aten.chunk.default",
    "aten.narrow.default",
    "aten.numpy_T.default",
}


def matmul_weights(graph: OpGraph) -> frozenset[str]:
    """Parameter nodes (representatives) that are the weight of a matrix product: attention and MLP projections,
    experts (reached through their selection by index), the LM head. Embedding tables are not: a lookup is no
    product."""
    cache = analysis(graph)
    if "matmul_weights" in cache:
        return cache["matmul_weights"]
    found = {graph.representative[p] for _, params in _matmul_params(graph) for p in params}
    out = cache["matmul_weights"] = frozenset(found)
    return out


def _matmul_params(graph: OpGraph):
    """(matrix product node, the parameter nodes it reads as its weight), for every product of the graph; a weight
    is followed back through the ops that only select or reshape it (an expert by index, a transpose)."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or str(node.target) not in _MATMUL_WEIGHT_ARG:
            continue
        args = tensor_args(node)
        idx = _MATMUL_WEIGHT_ARG[str(node.target)]
        params = []
        for a in args if idx is None else args[idx : idx + 1]:
            while a.op == "call_function" and str(a.target) in _WEIGHT_PATH_OPS and tensor_args(a):
                a = tensor_args(a)[0]
            if graph.kinds.get(a.name) == NodeKind.PARAM:
                params.append(a.name)
        yield node, params


def frozen_weight_matmuls(graph: OpGraph) -> frozenset[str]:
    """Matrix products (node names) whose weight is a frozen parameter (`requires_grad=False`): their backward
    computes the input's gradient only, no weight gradient. A product of two parameters counts when both are
    frozen; of two activations (attention's scores), never."""
    cache = analysis(graph)
    if "frozen_weight_matmuls" in cache:
        return cache["frozen_weight_matmuls"]
    found = {
        node.name
        for node, params in _matmul_params(graph)
        if params and not any(graph.params[p].requires_grad for p in params)
    }
    out = cache["frozen_weight_matmuls"] = frozenset(found)
    return out


def layer_matmul_weights(graph: OpGraph) -> frozenset[str]:
    """The matmul weights a pinned tensor axis must split: those of the repeated layers (all of them in a model
    without layers). The LM head is left to the solver: splitting it pays only where the vocabulary is large."""
    weights = matmul_weights(graph)
    inside = frozenset(w for w in weights if graph.params[w].layer[0] is not None)
    return inside or weights


@dataclass(frozen=True, slots=True)
class TensorSplit:
    """What a tensor axis must split: at least `min_fraction` of the layer matmul weights' elements."""

    min_fraction: float = 0.0

    @classmethod
    def from_constraints(cls, constraints: dict, tp: int) -> TensorSplit:
        """The rule for a tensor axis of size `tp` under the user's `constraints` (validated here): every layer
        matmul weight by default, pinned or searched alike (so that `compile`, which plans again with the
        plan's tp pinned, builds what was priced), or the fraction `tp_min_split` says."""
        f = constraints.get("tp_min_split")
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1):
            raise ConfigError(
                f"constraints['tp_min_split']={f!r}: expected a fraction between 0 and 1 (0 lets the "
                f"tensor axis split nothing, 1 splits every layer matmul weight)"
            )
        if tp == 1:
            return cls()
        return cls(1.0 if f is None else float(f))


ANY_SPLIT = TensorSplit()  # the rule that asks nothing of a tensor axis (min_fraction 0)


def storage_base(a: fx.Node) -> fx.Node:
    """The node whose storage a value lives in: views resolved to their base.

    Reshaping an expanded tensor (the repeat of grouped key/value heads) copies it, so that
    reshape owns its storage.
    """
    while a.op == "call_function" and str(a.target) in VIEW_OPS and tensor_args(a):
        src = tensor_args(a)[0]
        if str(a.target) == "aten.reshape.default" and str(src.target) == "aten.expand.default":
            before, after = output_meta(tensor_args(src)[0]) if tensor_args(src) else None, output_meta(src)
            if before is not None and after is not None and after.numel > before.numel:
                break
        a = src
    return a


def recompute_choices(graph: OpGraph, pinned: str | None) -> list[str]:
    """The recompute modes a program considers, cheapest first: the pinned one, or every mode that has segments."""
    if pinned is not None:
        if pinned not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute={pinned!r}: expected one of {', '.join(RECOMPUTE_MODES)}")
        return [pinned]
    return ["none"] + [m for m in ("selective", "full") if recompute_segments(graph.graph, m)]


def saved_for_backward(graph: OpGraph, recompute: str = "none") -> set[str]:
    """Producers (view chains resolved to their base) whose output is kept for backward under `recompute`.

    A value is kept when a consumer that is not recomputed saves it, or when it enters a recomputed
    segment from outside (the checkpoint keeps its inputs, whatever the ops inside save). A value
    made and used inside one segment is dropped: the backward makes it again.
    """
    cache = analysis(graph)
    if ("saved", recompute) in cache:
        return cache[("saved", recompute)]
    segment = recomputed_nodes(graph.graph, recompute)
    saved = set()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        seg = segment.get(node.name)
        if seg is None and str(node.target) in NO_SAVE:
            continue
        for a in tensor_args(node):
            a = storage_base(a)
            if seg is not None and segment.get(a.name) == seg:
                continue
            if graph.kinds.get(a.name) in (NodeKind.COMPUTE, NodeKind.INPUT):
                meta = output_meta(a)
                if meta is not None and meta.dtype.is_floating_point or a.op == "placeholder":
                    saved.add(a.name)
    cache[("saved", recompute)] = saved
    return saved

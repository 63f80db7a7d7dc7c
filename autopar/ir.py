"""OpGraph: a typed view over the traced fx graph.

The fx graph of the exported program stays the source of truth; `OpGraph` adds what the
solvers need and fx does not say directly: which placeholder is a parameter, buffer or user
input (and under which original name), the tensor arguments of every op in a fixed order, the
repeated layer each node belongs to, and the mapping of every node of a repeated layer to the
node at the same position of the first layer (so identical layers are solved once).

Terms:
- *tensor argument*: an argument leaf of a node (in `args`, then `kwargs`, flattened in pytree
  order) that is another node producing a tensor. A node using the same producer twice has two
  tensor arguments; strategies give one placement per tensor argument.
- *representative*: for a node of layer i, the node of the first isomorphic layer at the same
  position; nodes outside repeated layers are their own representative.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.trace import TracedModel, layer_of, layer_of_param


class NodeKind(StrEnum):
    PARAM = "param"
    BUFFER = "buffer"
    CONSTANT = "constant"
    INPUT = "input"
    COMPUTE = "compute"
    OUTPUT = "output"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A trainable parameter of the traced model, under its original (Hugging Face) name."""

    name: str
    node_name: str
    meta: TensorMeta
    requires_grad: bool
    layer: tuple[str | None, int | None]  # `autopar.trace.layer_of_param` of its name


def tensor_meta_of(value) -> TensorMeta | None:
    """The TensorMeta of a meta/fake tensor value, or None for non-tensors."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    return None


# Memo tables for the two questions the planner asks of every node many times over. An entry holds
# the objects it was computed from (the node's args/kwargs tuples, its meta value) and is used only
# while the node still holds those very objects, so a pass that rewrites a node invalidates it.
_ARGS_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_META_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def output_meta(node: fx.Node) -> TensorMeta | None:
    """The meta of a node's output when it is one tensor (the first tensor of a tuple otherwise)."""
    val = node.meta.get("val")
    hit = _META_MEMO.get(node)
    if hit is not None and hit[0] is val:
        return hit[1]
    out = _output_meta(val)
    _META_MEMO[node] = (val, out)
    return out


def _output_meta(val) -> TensorMeta | None:
    if isinstance(val, (tuple, list)):
        for v in val:
            if isinstance(v, torch.Tensor):
                return tensor_meta_of(v)
        return None
    return tensor_meta_of(val)


def is_tensor_node(node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The tensor arguments of `node`, in pytree order of (args, kwargs), duplicates kept (a fresh list)."""
    args, kwargs = node.args, node.kwargs
    hit = _ARGS_MEMO.get(node)
    if hit is not None and hit[0] is args and hit[1] is kwargs:
        return list(hit[2])
    out = tuple(a for a in pytree.tree_leaves((args, kwargs)) if is_tensor_node(a))
    _ARGS_MEMO[node] = (args, kwargs, out)
    return list(out)


@dataclass(frozen=True)
class OpGraph:
    """The traced model as the planner sees it.

    Attributes:
        traced: the TracedModel it was built from (fx graph, signature).
        kinds: node name -> NodeKind.
        params: every parameter placeholder, keyed by node name.
        input_nodes: names of the user-input placeholders, in order.
        representative: node name -> name of its representative node.
        layer_count: representative node name -> how many nodes it stands for.
    """

    traced: TracedModel
    kinds: dict[str, NodeKind]
    params: dict[str, ParamInfo]
    input_nodes: tuple[str, ...]
    representative: dict[str, str]
    layer_count: dict[str, int]
    num_layers: int
    deduplicated_layers: int
    _nodes: dict[str, fx.Node] = field(repr=False)
    node_layer: dict[str, tuple[str | None, int | None]] = field(default_factory=dict, repr=False)
    # container -> (layers traced, layers of the model) where a shortened trace stands for a deeper model
    repeats: dict[str, tuple[int, int]] = field(default_factory=dict)
    # A view prices part of the model (a pipeline stage): `view` names it (analyses are cached per view),
    # `layer_count` holds its own multiplicities and `edge_scale` multiplies the uses read by a node.
    view: str = ""
    edge_scale: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def graph(self) -> fx.Graph:
        return self.traced.exported.graph

    def node(self, name: str) -> fx.Node:
        return self._nodes[name]

    def nodes(self) -> list[fx.Node]:
        return list(self.graph.nodes)

    def num_parameters(self) -> int:
        """Trainable parameters of the model (each deduplicated layer counted as often as it occurs)."""
        return sum(p.meta.numel * self.layer_count[n] for n, p in self.params.items() if p.requires_grad)

    def edge_weight(self, producer: str, consumer: str) -> float:
        """How many uses in the model one use of `producer` by `consumer` in the traced graph stands for.

        1 for a full trace. For a shortened trace of k identical layers standing for n: a use inside a
        layer, or of a value from outside the layers that every layer reads (a mask), occurs once per
        layer (n/k per traced use); a use of the previous layer's output occurs n-1 times (k-1 traced);
        anything else (the embedding into the first layer, the last layer into the head) once.
        """
        return self.edge_scale.get(consumer, 1.0) * self._edge_weight(producer, consumer)

    def _edge_weight(self, producer: str, consumer: str) -> float:
        lc = self.node_layer.get(consumer, (None, None))
        if lc[0] not in self.repeats:
            return 1.0
        k, n = self.repeats[lc[0]]
        lp = self.node_layer.get(producer, (None, None))
        if lp == lc:
            return n / k
        if lp[0] != lc[0]:
            # from outside the layers: once per layer if every traced layer reads it (a mask), else
            # once (the embedding that only the first layer reads)
            readers = {self.node_layer.get(u.name) for u in self._nodes[producer].users}
            return n / k if all((lc[0], i) in readers for i in range(k)) else 1.0
        if lp[1] is not None and lc[1] is not None and lp[1] == lc[1] - 1:
            return (n - 1) / (k - 1)
        return 1.0

    def expand_param_name(self, fqn: str, layer: tuple[str | None, int | None]) -> list[str]:
        """The names a traced parameter stands for: itself, or one per layer of a shortened trace."""
        container, idx = layer
        if container not in self.repeats or idx != 0:
            return [fqn]
        prefix = f"{container}.{idx}."
        rest = fqn[len(prefix) :] if fqn.startswith(prefix) else None
        if rest is None:
            return [fqn]
        return [f"{container}.{i}.{rest}" for i in range(self.repeats[container][1])]

    @classmethod
    def from_traced(
        cls,
        traced: TracedModel,
        *,
        frozen_params: frozenset[str] = frozenset(),
        layer_repeats: dict[str, int] | None = None,
    ) -> OpGraph:
        """Build the view; `frozen_params` names parameters with requires_grad=False.

        `layer_repeats` (container -> number of layers of the model) says the trace is shortened: it
        holds fewer, identical layers of that container, each standing for n/k of the model's. Raises
        ValueError when the traced layers are not all identical (the shortening is then not valid).
        """
        nodes = {n.name: n for n in traced.exported.graph.nodes}
        placeholders = [n for n in traced.exported.graph.nodes if n.op == "placeholder"]
        kinds: dict[str, NodeKind] = {}
        params: dict[str, ParamInfo] = {}
        inputs: list[str] = []
        param_iter = iter(traced.param_names)
        for ph, kind in zip(placeholders, traced.placeholder_kinds, strict=True):
            kinds[ph.name] = NodeKind(kind)
            if kind == "param":
                fqn = next(param_iter)
                params[ph.name] = ParamInfo(
                    fqn, ph.name, output_meta(ph), fqn not in frozen_params, layer_of_param(fqn)
                )
            elif kind == "input":
                inputs.append(ph.name)
        for n in traced.exported.graph.nodes:
            if n.op == "call_function":
                kinds[n.name] = NodeKind.COMPUTE
            elif n.op == "output":
                kinds[n.name] = NodeKind.OUTPUT
        rep, count, num_layers, dedup, node_layer = _deduplicate_layers(traced.exported.graph, params)
        repeats: dict[str, tuple[int, int]] = {}
        for container, n in (layer_repeats or {}).items():
            idxs = sorted({i for c, i in node_layer.values() if c == container})
            first = [name for name, layer in node_layer.items() if layer == (container, 0)]
            k = len(idxs)
            if k < 2 or idxs != list(range(k)) or any(count[name] != k for name in first):
                raise ValueError(f"the traced layers of {container} are not {k} identical layers")
            for name in first:
                count[name] = n
            repeats[container] = (k, n)
            num_layers = max(num_layers, n)
            dedup += n - k
        return cls(traced, kinds, params, tuple(inputs), rep, count, num_layers, dedup, nodes, node_layer, repeats)


def _node_layer(node: fx.Node, params: dict[str, ParamInfo]) -> tuple[str | None, int | None]:
    if node.op == "placeholder":
        return params[node.name].layer if node.name in params else (None, None)
    if node.op != "call_function":
        return None, None
    return layer_of(node)


def _signature(node: fx.Node, params: dict[str, ParamInfo]) -> tuple:
    """What must agree for two nodes at the same position of two layers to be solved as one: a parameter's
    `requires_grad` too (a frozen layer has no gradient, optimizer state or gradient reduction to price)."""
    meta = output_meta(node)
    target = node.op if node.op == "placeholder" else str(node.target)
    info = params.get(node.name)
    trainable = info.requires_grad if info is not None else None
    return (target, meta.shape if meta else None, meta.dtype if meta else None, len(tensor_args(node)), trainable)


def _deduplicate_layers(graph: fx.Graph, params: dict[str, ParamInfo]):
    """Map the nodes of every layer onto the first layer of its container isomorphic to it (parameters frozen alike)."""
    by_layer: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    node_layer: dict[str, tuple[str | None, int | None]] = {}
    for n in graph.nodes:
        container, idx = _node_layer(n, params)
        node_layer[n.name] = (container, idx)
        if container is not None:
            by_layer[(container, idx)].append(n)
    rep = {n.name: n.name for n in graph.nodes}
    count = {n.name: 1 for n in graph.nodes}
    containers: dict[str, list[int]] = defaultdict(list)
    for container, idx in by_layer:
        containers[container].append(idx)
    num_layers = max((len(v) for v in containers.values()), default=0)
    dedup = 0
    for container, idxs in containers.items():
        idxs.sort()
        # each layer maps onto the first layer of its signature: all onto the first when the layers are alike; a
        # frozen first layer stands for itself, and the trainable layers after it for each other
        firsts: dict[tuple, list[fx.Node]] = {}
        for idx in idxs:
            layer_nodes = by_layer[(container, idx)]
            sig = tuple(_signature(n, params) for n in layer_nodes)
            first = firsts.setdefault(sig, layer_nodes)
            if first is layer_nodes:
                continue
            dedup += 1
            for a, b in zip(layer_nodes, first, strict=True):
                rep[a.name] = b.name
                count[b.name] += 1
                count[a.name] = 0
    return rep, count, num_layers, dedup, node_layer

"""Activation recompute: which nodes of the traced graph a recompute mode runs again in backward.

A *segment* is a set of call_function nodes that the rewrite runs as one
`torch.utils.checkpoint.checkpoint` region: its forward keeps only the segment's inputs, and its
backward runs the segment's forward again to regain what the ops inside had saved. The sharding
solver prices the same segments (memory kept, forward run twice), so both read them from here.

Modes:
    none       nothing is recomputed.
    full       every repeated layer (`OpGraph.node_layer`: a node of "model.layers.3" belongs to
               layer 3) is one segment: the layer keeps its inputs only (Korthikanti et al.'s
               `2·s·b·h` bytes per layer, plus the inputs every layer shares, such as masks).
    selective  the attention internals of every layer: the nodes run directly by the attention
               module (the innermost module whose class name holds "Attention" on the stack of the
               attention op), not by its projections. That is the attention op and what lies between
               it and the projections (views, rotary embedding, the repeat of grouped key/value
               heads). With a fused attention op (SDPA, flash attention) the s x s scores are never
               kept, so this saves only the rotated queries and keys and the repeated key/value
               heads; Korthikanti et al.'s `5·a·s²·b` term it was designed to remove is not there.
               With eager attention (matmul, softmax, matmul) it removes the scores as in the paper.

Per layer: a plan may give each repeated layer its own treatment (`layer_modes`, mode -> layer
indices): "full" or "selective" recompute, or "offload" (the layer's saved activations go to the host
in forward and come back in backward), the layers it does not name keeping their activations. An
empty `layer_modes` means the plan's one mode applies to every layer. `plan_segments` and
`offloaded_nodes` read that for the rewrite, and the solver prices the same sets.

A segment is valid only when the rewrite can run it at its last node: every user outside it comes
after that node (so nothing outside needs a value before the segment has run). A layer or
attention block that breaks this is not recomputed, in the solver and the rewrite alike.
"""

from __future__ import annotations

import weakref
from enum import StrEnum

import torch
import torch.fx as fx

from autopar.trace import layer_of


class RecomputeMode(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


RECOMPUTE_MODES = tuple(m.value for m in RecomputeMode)

_ATTENTION_OPS = {
    "aten.scaled_dot_product_attention.default",
    "aten._softmax.default",
    "aten.softmax.int",
    "autopar.flash_attention.default",
}
_SEGMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recompute_segments(graph: fx.Graph, mode: str) -> tuple[tuple[str, ...], ...]:
    """The segments of `graph` under `mode`, each a tuple of node names in graph order (cached per graph)."""
    mode = RecomputeMode(mode)
    cache = _SEGMENTS.setdefault(graph, {})
    if mode not in cache:
        if mode == RecomputeMode.NONE:
            cache[mode] = ()
        else:
            found = _layer_segments(graph) if mode == RecomputeMode.FULL else _attention_segments(graph)
            cache[mode] = tuple(seg for seg in found if _runnable(graph, seg))
    return cache[mode]


def recomputed_nodes(graph: fx.Graph, mode: str) -> dict[str, int]:
    """Node name -> index of its segment, for every node `mode` recomputes."""
    return {name: i for i, seg in enumerate(recompute_segments(graph, mode)) for name in seg}


def _layer_segments(graph: fx.Graph) -> list[tuple[str, ...]]:
    layers: dict[tuple[str, int], list[str]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        container, idx = layer_of(node)
        if container is not None:
            layers.setdefault((container, idx), []).append(node.name)
    return [tuple(names) for names in layers.values()]


def _attention_segments(graph: fx.Graph) -> list[tuple[str, ...]]:
    modules: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target) in _ATTENTION_OPS and layer_of(node)[0] is not None:
            path = _attention_module(node)
            if path is not None:
                modules.setdefault(path, [])
    for node in graph.nodes:
        if node.op == "call_function" and _innermost_path(node) in modules:
            modules[_innermost_path(node)].append(node.name)
    return [tuple(names) for names in modules.values() if names]


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) of every module on the node's stack, outermost first."""
    out = []
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path, cls = value if isinstance(value, tuple) else (value, "")
        out.append((str(path), getattr(cls, "__name__", str(cls))))
    return out


def _attention_module(node: fx.Node) -> str | None:
    for path, cls in reversed(_stack(node)):
        if "Attention" in cls.rsplit(".", 1)[-1]:
            return path
    return None


def _innermost_path(node: fx.Node) -> str | None:
    stack = _stack(node)
    return stack[-1][0] if stack else None


def _runnable(graph: fx.Graph, seg: tuple[str, ...]) -> bool:
    """Every user outside the segment comes after its last node, and it holds no in-place op."""
    if not seg:
        return False
    members = set(seg)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last = max(order[name] for name in seg)
    by_name = {n.name: n for n in graph.nodes if n.name in members}
    for name in seg:
        node = by_name[name]
        schema = getattr(node.target, "_schema", None)
        if isinstance(node.target, torch._ops.OpOverload) and schema is not None and schema.is_mutable:
            return False
        if any(u.name not in members and order[u.name] < last for u in node.users):
            return False
    return True


def segment_layer(graph: fx.Graph, seg: tuple[str, ...]) -> int | None:
    """The index of the repeated layer a segment lies in (None outside layers)."""
    first = _nodes_by_name(graph)[seg[0]]
    return layer_of(first)[1]


def layer_containers(graph: fx.Graph) -> set[str]:
    """The paths of the module lists holding repeated layers ("model.layers", "transformer.h")."""
    return {c for n in graph.nodes if n.op == "call_function" for c in [layer_of(n)[0]] if c is not None}


def plan_segments(graph: fx.Graph, recompute: str, layer_modes: dict | None = None) -> tuple[tuple[str, ...], ...]:
    """The segments a plan recomputes: every segment of `recompute`, or with `layer_modes` those of each
    recompute mode in the layers it names, in graph order."""
    if not layer_modes:
        return recompute_segments(graph, recompute)
    found = []
    for mode in ("selective", "full"):
        layers = set(layer_modes.get(mode, ()))
        if layers:
            found += [seg for seg in recompute_segments(graph, mode) if segment_layer(graph, seg) in layers]
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return tuple(sorted(found, key=lambda seg: order[seg[0]]))


def offloaded_nodes(graph: fx.Graph, layer_modes: dict | None) -> frozenset[str]:
    """The call_function nodes of the layers whose saved activations a plan keeps on the host."""
    layers = set((layer_modes or {}).get("offload", ()))
    if not layers:
        return frozenset()
    return frozenset(
        n.name
        for n in graph.nodes
        if n.op == "call_function" and layer_of(n)[0] is not None and layer_of(n)[1] in layers
    )


def _nodes_by_name(graph: fx.Graph) -> dict[str, fx.Node]:
    cache = _SEGMENTS.setdefault(graph, {})
    if "by_name" not in cache:
        cache["by_name"] = {n.name: n for n in graph.nodes}
    return cache["by_name"]

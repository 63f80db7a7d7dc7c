"""FLOPs of one training step, as a plan reports them: model FLOPs (what MFU divides) and hardware FLOPs (what
the step executes, recompute included).

Model FLOPs are 6 per trainable parameter per token plus attention's, the convention of PaLM's MFU: embedding
tables read only by lookups multiply nothing and are left out; a mixture of experts' weights meet only the
tokens routed to them and count what those matmuls do. Hardware FLOPs add the forward of every node the plan
runs again. Per-node counts come from `cost_model.compute.estimate_node_cost`.
"""

from __future__ import annotations

from autopar.cost_model.compute import estimate_node_cost
from autopar.ir import OpGraph
from autopar.passes.activation_plan import model_layers
from autopar.passes.context_parallel import cp_attention_flops
from autopar.passes.recompute import recompute_segments, recomputed_nodes

_ATTENTION_TARGETS = ("aten.scaled_dot_product_attention.default", "autopar.flash_attention.default")
_ROUTED_MATMULS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default", "aten.bmm.default")
_WEIGHT_VIEWS = (
    "aten.transpose.int",
    "aten.permute.default",
    "aten.t.default",
    "aten.view.default",
    "aten._to_copy.default",
    "aten.to.dtype",
)


def step_flops(
    graph: OpGraph, tokens: int, recompute: str = "none", layer_modes: dict | None = None, cp: int = 1
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: 6 per parameter per token plus attention; all executed FLOPs.

    A mixture of experts' weights meet only the tokens routed to them: for those (`_routed_products`) the
    model FLOPs are their matmuls' own (the top-k of E experts per token), not 6 per parameter per token.

    Hardware FLOPs count the forward of every node the plan runs again (`recompute` in every layer, or
    each mode of `layer_modes` in its layers); model FLOPs do not. A graph traced for a cp plan holds each
    sequence as cp chunks whose attention nodes score (seq/cp)² pairs under a mask built from the chunk's
    shape: they count as the cp program runs them, over whole sequences and causal by global position
    (`passes.context_parallel.cp_attention_flops`), so model FLOPs do not depend on the layout.
    """
    if layer_modes:  # layers are alike: a representative node counts for the share of layers recomputed
        again, scale = {}, model_layers(graph)[1]
        for mode in ("selective", "full"):
            n = len(recompute_segments(graph.graph, mode)) * scale
            if layer_modes.get(mode) and n:
                again |= {name: len(layer_modes[mode]) / n for name in recomputed_nodes(graph.graph, mode)}
    else:
        again = dict.fromkeys(recomputed_nodes(graph.graph, recompute), 1.0)
    attention = 0.0
    hardware = 0.0
    for node in graph.graph.nodes:
        times = graph.layer_count.get(node.name, 1)
        if node.op != "call_function" or not times:
            continue
        fwd, bwd = _node_flops(node, cp)
        hardware += times * (fwd + bwd + fwd * again.get(node.name, 0.0))
        if str(node.target) in _ATTENTION_TARGETS:
            attention += times * (fwd + bwd)
    routed_params, routed_flops = _routed_products(graph)
    dense = graph.num_parameters() - _lookup_only_parameters(graph) - routed_params
    return 6.0 * dense * tokens + attention + routed_flops, hardware


def _node_flops(node, cp: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one node; an attention node of a cp graph over whole sequences."""
    if cp > 1 and str(node.target) in _ATTENTION_TARGETS:
        return cp_attention_flops(node, cp)
    cost = estimate_node_cost(node)
    return cost.flops, cost.backward_flops


def _lookup_only_parameters(graph: OpGraph) -> int:
    """Trainable parameters read only by embedding lookups (an untied input embedding): they cost no
    multiply-adds, so the 6 FLOPs per parameter per token of model FLOPs leave them out (as PaLM's MFU
    does); a table the output layer also multiplies by (tied weights) stays in."""
    total = 0
    for name, info in graph.params.items():
        users = list(graph.node(name).users)
        if info.requires_grad and users and all(str(u.target) == "aten.embedding.default" for u in users):
            total += info.meta.numel * graph.layer_count[name]
    return total


def _routed_products(graph: OpGraph) -> tuple[int, float]:
    """(trainable parameters of experts, forward and backward FLOPs of the matmuls that read them) in one step.

    An expert weight [E, ...] reaches its matmul through views and casts, and either whole (a grouped matmul
    of the tokens sorted by expert) or indexed by each (token, expert) pair (Hugging Face's "batched_mm":
    `w[expert_ids]` then a bmm): each token meets k of the E experts, so it costs what those matmuls do.
    """
    params, flops, seen = 0, 0.0, set()
    for name, info in graph.params.items():
        ends = _routed_uses(graph.node(name))
        if not info.requires_grad or not ends:
            continue
        params += info.meta.numel * graph.layer_count[name]
        for end in ends - seen:
            cost = estimate_node_cost(end)
            flops += graph.layer_count.get(end.name, 1) * (cost.flops + cost.backward_flops)
        seen |= ends
    return params, flops


def _routed_uses(node, indexed: bool = False) -> set | None:
    """The routed matmuls every use of `node` ends in (see `_routed_products`), or None if one use is another op."""
    ends: set = set()
    for user in node.users:
        target = str(user.target)
        if target in _ROUTED_MATMULS and (indexed or target != "aten.bmm.default"):
            ends.add(user)
            continue
        if target == "aten.index.Tensor" and user.args[0] is node:
            found = _routed_uses(user, indexed=True)
        elif target in _WEIGHT_VIEWS:
            found = _routed_uses(user, indexed)
        else:
            return None
        if not found:
            return None
        ends |= found
    return ends or None


__all__ = ["step_flops"]

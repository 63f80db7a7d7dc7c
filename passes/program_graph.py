"""Passes the programs run on the traced graph before executing it (not planning passes).

- `drop_assertions_pass`: removes export's `_assert_tensor_metadata` checks (dispatch cost, no effect).
- `fold_constants_pass`: computes once what depends only on constants (causal masks, rotary tables).
- `sum_loss_pass`: a mean cross-entropy output becomes its sum, with the kept-label count appended, so a
  program can divide the summed gradients by the global count (exact with unevenly ignored labels).
- `eval_pass`: dropout off, for evaluation with the training graph (`Program.eval_step`).

Each takes `(gm, example_inputs, *, knobs)` and returns `gm`, edited in place and recompiled. Input: an
exported training-IR graph (`autopar.trace`), possibly fused (`passes.fused_ops`). Terms: a *constant
placeholder* is a buffer no step writes or a lifted constant.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.fused_ops import emit_fused_loss_sum

aten = torch.ops.aten


def sum_loss_pass(gm: fx.GraphModule, example_inputs, *, loss_index: int) -> fx.GraphModule:
    """Turn output `loss_index`, when it is a mean cross-entropy, into its sum; append the kept-label count.

    Leaves the graph unchanged (and `gm.meta["autopar_loss_count"]` False) for any other loss.
    """
    del example_inputs
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    loss = outs[loss_index]
    gm.meta["autopar_loss_count"] = False
    fused = emit_fused_loss_sum(gm.graph, loss) if isinstance(loss, fx.Node) else None
    if fused is not None:  # autopar::linear_cross_entropy (kernel fusion): the same sum and count
        outs[loss_index] = fused[0]
        out.args = (tuple(outs) + (fused[1],),)
        gm.meta["autopar_loss_count"] = True
        gm.graph.lint()
        gm.recompile()
        return gm
    if not isinstance(loss, fx.Node) or loss.target != aten.cross_entropy_loss.default:
        return gm
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    bound = dict(zip(names, loss.args, strict=False)) | dict(loss.kwargs)
    if bound.get("weight") is not None or bound.get("reduction", 1) != 1:
        return gm
    ignore = bound.get("ignore_index", -100)
    with gm.graph.inserting_after(loss):
        total = gm.graph.call_function(
            aten.cross_entropy_loss.default,
            (bound["input"], bound["target"], None, 2, ignore, bound.get("label_smoothing", 0.0)),
        )
    with gm.graph.inserting_after(total):
        kept = gm.graph.call_function(aten.ne.Scalar, (bound["target"], ignore))
    with gm.graph.inserting_after(kept):
        count = gm.graph.call_function(aten.sum.default, (kept,))
    outs[loss_index] = total
    out.args = (tuple(outs) + (count,),)
    if not loss.users:
        gm.graph.erase_node(loss)
    gm.meta["autopar_loss_count"] = True
    gm.graph.lint()
    gm.recompile()
    return gm


def drop_assertions_pass(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """Remove the graph's `_assert_tensor_metadata` checks (export's record of `.to()` calls).

    They check, on every call, the dtype and device the trace already fixed; each costs a dispatch and
    returns nothing, so no other node depends on them.
    """
    del example_inputs
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def fold_constants_pass(gm: fx.GraphModule, example_inputs, *, constant_placeholders: set[str]) -> fx.GraphModule:
    """Compute once what depends only on constants; the graph then reads the results as attributes.

    A node folds when it is an op whose every input is a placeholder named in `constant_placeholders`
    (buffers no step changes, lifted constants) or a folded node, and it is not random. In a Hugging
    Face decoder that is the causal mask and the rotary cos/sin tables: a quarter of the forward's ops,
    the same on every step. `example_inputs` are the placeholder values in order; every folded node
    that an unfolded one uses becomes a buffer of `gm` holding its value (tensors only: a node of
    another value stays, and so do the folded nodes it needs).
    """
    folded: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        inputs = node.all_input_nodes
        if all(a in folded or (a.op == "placeholder" and a.name in constant_placeholders) for a in inputs):
            folded.add(node)
    frontier = [n for n in folded if any(u not in folded for u in n.users)]
    if not frontier:
        return gm
    env = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs, strict=True))
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node in folded:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)
    for i, node in enumerate(frontier):
        value = env[node]
        if not isinstance(value, torch.Tensor):
            continue
        name = f"_autopar_folded_{i}"
        gm.register_buffer(name, value.detach().clone(), persistent=False)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr, delete_user_cb=lambda user: user not in folded)
    for node in reversed(list(gm.graph.nodes)):
        if node in folded and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of `gm`'s graph (same node names, node meta shared shallowly), so a pass on
    the copy leaves `gm` as it is."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def eval_pass(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """Dropout off: every `aten.dropout` node (how the training-IR export keeps dropout) becomes its input."""
    del example_inputs
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.dropout.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm

"""Split the traced graph at the plan's pipeline cuts into one graph per (virtual) stage.

Input: the exported ATen graph (placeholders for parameters, buffers, constants and user inputs,
as `autopar.trace` returns it), the layer of every node (`OpGraph.node_layer`), and the layers of
each stage in pipeline order (with interleaving, stage j runs on device j mod pp).

Where a node runs:
- a node of layer i runs on the stage that holds layer i;
- a node outside the layers that reads parameters or another stage's values (embeddings, final
  norm, LM head, loss) runs on the earliest stage that has all its inputs, unless every reader is
  later, in which case it runs on the earliest reader's stage;
- a node outside the layers computed only from inputs, buffers and constants (position ids,
  masks, rotary tables) is copied into every stage that reads it: recomputing it is cheaper than
  sending it (an expanded mask is batch x seq x seq).

Export's metadata assertions (`aten._assert_tensor_metadata`, its record of a `.to()` or `.float()`
call) are dropped before splitting: they read a value and give none, so placed by the rules above
one that checks a parameter (Gemma-2's norm weights) would land on stage 0 and make that stage
hold a parameter it never uses, which the runtime would then tie across stages.

Every stage can read every placeholder (each rank holds its stage's parameters and the whole
global batch), so only values computed by the graph cross stage boundaries. A value made on stage
s and read on stage t > s is sent from s to s+1 and passed on by every stage in between. The graph
of a stage takes the values it receives (in the order its predecessor sends them) and the
placeholders it reads, and returns the values it sends on, or, on the last stage, the model's
first output (the loss).

A free op that writes into its argument (an in-place `copy_` into a slice of a tensor made from
nothing, as T5 shifts its labels right into the decoder's inputs) has no reader of its own: it is
copied into every stage that reads the tensor it writes, else the write would be lost.

Several stacks of layers (an encoder and a decoder) are cut as one sequence: `stack_layers` numbers
the layers of every stack in the order the graph runs them (the encoder's 0 .. E-1, then the
decoder's E .. E+D-1), so a stage may end inside either stack or hold the end of one and the start
of the next. What one stack hands the other (the encoder's output, read by every decoder layer's
cross-attention) crosses the boundaries like any value: sent on by every stage in between.

Output: `StageGraph`s. Node names are those of the traced graph, so the plan's placements apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import LoweringError
from autopar.passes.program_graph import copy_graph_module, drop_assertions_pass

_METADATA_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}


STACKS = "stacks"  # the container name `stack_layers` gives the layers of several stacks


def stack_layers(node_layer: dict) -> tuple[dict, str, tuple[tuple[str, int], ...]]:
    """One sequence of layers over every stack of `node_layer` (see the module docstring).

    A container nested in a layer of another (T5's `encoder.block.0.layer`) belongs to that layer.
    Returns (node -> (container, layer) with the layers renumbered, that container, and each stack's
    (module path, number of layers) in the order the graph runs them). One stack keeps its name and numbers.
    """
    found: dict[str, set[int]] = {}
    for c, i in node_layer.values():
        if c is not None:
            found.setdefault(c, set()).add(i)
    order = []
    for c, _ in node_layer.values():  # in graph order: the stacks in the order they run
        if c is not None and not any(c.startswith(o + ".") for o in found) and c not in order:
            order.append(c)
    stacks = tuple((c, max(found[c]) + 1) for c in order)
    if len(stacks) == 1:
        return dict(node_layer), order[0], stacks
    offset = {c: sum(n for _, n in stacks[:k]) for k, (c, _) in enumerate(stacks)}
    flat = {}
    for name, (c, i) in node_layer.items():
        outer = next((o for o in order if c is not None and (c == o or c.startswith(o + "."))), None)
        if outer is None:
            flat[name] = (None, None)
            continue
        index = i if c == outer else int(c[len(outer) + 1 :].split(".")[0])
        flat[name] = (STACKS, offset[outer] + index)
    return flat, STACKS, stacks


@dataclass
class StageGraph:
    """One stage's graph.

    Attributes:
        index: the stage's place in the pipeline (0 .. number of stages - 1).
        graph_module: placeholders are `received` then `placeholders`; outputs are `sends`, or on the
            last stage the loss alone.
        received: names of the values that arrive from the previous stage, in the order it sends them.
        placeholders: names of the traced graph's placeholders this stage reads.
        sends: names of the values this stage passes to the next one (none on the last stage).
        layers: the layer ranges the stage runs.
    """

    index: int
    graph_module: fx.GraphModule
    received: tuple[str, ...]
    placeholders: tuple[str, ...]
    sends: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]


def assign_stages(
    graph: fx.Graph, node_layer: dict, container: str, stage_layers: list, *, param_nodes: set[str]
) -> tuple[dict[str, int], dict[str, set[int]]]:
    """(node -> stage for computed nodes, node -> stages for copied input-only nodes); see the module docstring."""
    layer_stage: dict[int, int] = {}
    for s, ranges in enumerate(stage_layers):
        for a, b in ranges:
            for i in range(a, b):
                if i in layer_stage:
                    raise LoweringError(f"layer {i} is given to stages {layer_stage[i]} and {s}")
                layer_stage[i] = s
    last = len(stage_layers) - 1
    # metadata assertions run nowhere (split_stages drops them): they must not pull a parameter onto a stage
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target not in _METADATA_CHECKS]
    checks = {n.name for n in graph.nodes if n.op == "call_function" and n.target in _METADATA_CHECKS}
    seen_layers = {idx for n in nodes for c, idx in [node_layer.get(n.name, (None, None))] if c == container}
    missing = sorted(seen_layers - set(layer_stage))
    if missing:
        raise LoweringError(f"layers {missing[:5]} of {container} are on no pipeline stage")

    free: set[str] = set()  # outside the layers, computed from inputs, buffers and constants only
    for n in nodes:
        c, _ = node_layer.get(n.name, (None, None))
        if c == container:
            continue
        if all(i.op == "placeholder" and i.name not in param_nodes or i.name in free for i in n.all_input_nodes):
            free.add(n.name)

    stage: dict[str, int] = {}
    fixed: set[str] = set()
    for n in nodes:  # earliest stage with every input
        c, idx = node_layer.get(n.name, (None, None))
        if c == container:
            stage[n.name] = layer_stage[idx]
            fixed.add(n.name)
        elif n.name not in free:
            stage[n.name] = max((stage[i.name] for i in n.all_input_nodes if i.name in stage), default=0)
    not_placed = free | checks
    for n in reversed(nodes):  # then as late as the readers allow
        if n.name in fixed or n.name in free:
            continue
        readers = [last if u.op == "output" else stage[u.name] for u in n.users if u.name not in not_placed]
        if readers:
            stage[n.name] = max(stage[n.name], min(readers))
    for n in nodes:
        for i in n.all_input_nodes:
            if i.name in stage and n.name in stage and stage[i.name] > stage[n.name]:
                raise LoweringError(
                    f"{n.name} (stage {stage[n.name]}) reads {i.name} from the later stage "
                    f"{stage[i.name]}: the layers do not run in the order of the stages"
                )
    copies = _free_copies(nodes, free, checks, stage, last, {})
    # a free op that writes into its argument (T5 shifts the labels into its decoder inputs by a copy_ into a
    # slice of zeros) has no reader of its own: it runs wherever the tensor it writes is read
    writes = {n.name: copies[_written_base(n).name] for n in nodes if n.name in free and _writes_in_place(n)}
    if writes:
        copies = _free_copies(nodes, free, checks, stage, last, writes)
    return stage, copies


def _writes_in_place(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _written_base(node: fx.Node) -> fx.Node:
    """The tensor an in-place op writes into: its first argument, seen through the views it was taken by."""
    base = node.args[0]
    while isinstance(base.target, torch._ops.OpOverload) and base.target.is_view and base.args:
        base = base.args[0]
    return base


def _free_copies(
    nodes: list, free: set[str], checks: set[str], stage: dict[str, int], last: int, seeds: dict[str, set[int]]
) -> dict[str, set[int]]:
    """Stages that read each free node (directly or through other free nodes), plus its `seeds`."""
    copies: dict[str, set[int]] = {name: set() for name in free}
    for n in reversed(nodes):
        readers: set[int] = set(seeds.get(n.name, ()))
        for u in n.users:
            if u.name in checks:
                continue
            if u.op == "output":
                readers.add(last)
            elif u.name in free:
                readers |= copies[u.name]
            else:
                readers.add(stage[u.name])
        if n.name in free:
            copies[n.name] = readers
    return copies


def split_stages(
    gm: fx.GraphModule,
    node_layer: dict,
    container: str,
    stage_layers: list,
    *,
    param_nodes: set[str],
    loss_output: int = 0,
) -> list[StageGraph]:
    """Cut `gm` into one `StageGraph` per entry of `stage_layers` (see the module docstring).

    `loss_output` is the position of the loss among the graph's outputs. `gm` is left as it is.
    """
    gm = drop_assertions_pass(copy_graph_module(gm), None)
    graph = gm.graph
    stage, copies = assign_stages(graph, node_layer, container, stage_layers, param_nodes=param_nodes)
    num = len(stage_layers)
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = list(out_node.args[0])
    loss = outputs[loss_output]
    if not isinstance(loss, fx.Node) or stage.get(loss.name, num - 1) != num - 1:
        raise LoweringError("the model's loss is not computed on the last pipeline stage")

    def runs_on(name: str) -> set[int]:
        return copies[name] if name in copies else {stage[name]}

    # values crossing boundary s -> s+1: made on a stage <= s, read on a stage > s
    crossing: list[list[str]] = [[] for _ in range(num)]
    for n in graph.nodes:
        if n.op != "call_function" or n.name in copies:
            continue
        readers = [stage[u.name] for u in n.users if u.op != "output"] + ([num - 1] if n is loss else [])
        far = max(readers, default=stage[n.name])
        for s in range(stage[n.name], far):
            crossing[s].append(n.name)

    out: list[StageGraph] = []
    by_name = {n.name: n for n in graph.nodes}
    for s in range(num):
        members = [n for n in graph.nodes if n.op == "call_function" and s in runs_on(n.name)]
        received = tuple(crossing[s - 1]) if s else ()
        needed_ph = []
        for n in members:
            for i in n.all_input_nodes:
                if i.op == "placeholder" and i.name not in needed_ph:
                    needed_ph.append(i.name)
        placeholders = tuple(n.name for n in graph.nodes if n.op == "placeholder" and n.name in needed_ph)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for name in received + placeholders:
            src = by_name[name]
            ph = g.placeholder(name)
            ph.meta = dict(src.meta)
            env[src] = ph
        for n in members:
            env[n] = g.node_copy(n, env.__getitem__)
        if s < num - 1:
            sends = tuple(crossing[s])
            g.output(tuple(env[by_name[name]] for name in sends))
        else:
            sends = ()
            g.output(env[loss])
        g.lint()
        sgm = fx.GraphModule(gm, g)
        out.append(StageGraph(s, sgm, received, placeholders, sends, tuple(tuple(r) for r in stage_layers[s])))
    return out


_NO_GRAD = {torch.ops.aten.detach.default}


def values_needing_grad(graph: fx.Graph, trainable: set[str]) -> set[str]:
    """Names of the nodes whose values carry a gradient: floating values computed from a trainable parameter."""
    out = set(trainable)
    for n in graph.nodes:
        if n.op != "call_function" or n.target in _NO_GRAD:
            continue
        val = n.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if floating and any(i.name in out for i in n.all_input_nodes):
            out.add(n.name)
    return out

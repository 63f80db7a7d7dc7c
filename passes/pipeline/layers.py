r"""The layers a pipeline cuts: where they sit in the traced graph, what crosses a cut, and the graph of one stage.

Expects an `OpGraph` whose repeated layers are all alike (one container, every layer deduplicated onto the first,
as `OpGraph.from_traced` and the shortened preset traces give), or a full trace of several stacks of layers (an
encoder and a decoder). Gives the `LayerStructure` the search cuts, and for a stage the view of the graph its
program prices; it rewrites no graph (a view is the same graph with other counts).

Terms:
    L  layers of the model, numbered 0 .. L-1 in the order they run;  k_s  layers of stage s
    pre, post  the nodes before the layers (embeddings, masks, rotary tables) and after them (final norm, head,
         loss): stage 0 runs the first, stage p-1 the second
    boundary bytes  what one layer hands the next for one sample: what crosses a stage boundary

One stack of alike layers (-> Implemented in: layer_structure(), stage_view()). A stage is a view of the graph:
the representative layer nodes stand for k_s layers, the nodes before and after the layers count on the first and
last stage only. Identical layers share one set of decision groups, so a stage of any k_s is one small program.
The boundary bytes are those the first traced layer hands the second (the hidden state).

Several stacks (-> Implemented in: stack_structure(), range_view(), crossing_bytes()). An encoder-decoder model
(T5) has two stacks whose layers are not alike (the first of each stack computes the position bias, decoder layers
cross-attend): `stack_structure` numbers their layers as one sequence 0 .. L-1 (`pipeline_split.stack_layers`),
and a stage is a range [a, b) of it, priced by `range_view` over exactly the nodes `assign_stages` puts on that
stage (the nodes between the stacks where the split runs them). Each range is its own program, without
deduplication (the model is traced whole). What crosses each boundary is read from the values made before it and
read after it (`crossing_bytes`: in the decoder, the hidden state, the encoder's output and the position biases).

`why_no_layer_run` says, for an error message, why a graph has neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.ir import NodeKind, OpGraph, output_meta, tensor_args
from autopar.passes.pipeline_split import STACKS, assign_stages, stack_layers


@dataclass(frozen=True, slots=True)
class LayerStructure:
    """How the traced graph splits into the part before the layers, the repeated layers, and the part after.

    Attributes:
        container: module path of the repeated layers ("model.layers").
        num_layers: layers of the model (the trace may hold fewer, each standing for several).
        traced_layers: layers present in the traced graph.
        pre: nodes before the layers (embeddings, masks, rotary tables): priced on the first stage only.
        post: nodes after the layers (final norm, head, loss): priced on the last stage only.
            A parameter read on both sides (tied embeddings) is in both: the two stages each hold it.
        boundary_bytes_per_sample: bytes one layer hands the next for one sample (what crosses a stage boundary).
        stacks: for several stacks of unlike layers (`stack_structure`), each stack's (module path, layers)
            in the order they run; empty for one container of alike layers.
    """

    container: str
    num_layers: int
    traced_layers: int
    pre: frozenset[str]
    post: frozenset[str]
    boundary_bytes_per_sample: float
    stacks: tuple[tuple[str, int], ...] = ()


def layer_structure(graph: OpGraph, batch_size: int) -> LayerStructure | None:
    """The layer structure of `graph`, or None when it has no one run of identical layers to cut."""
    containers = {c for c, _ in graph.node_layer.values() if c is not None}
    if len(containers) != 1:
        return None
    (container,) = containers
    in_layer = {n: i for n, (c, i) in graph.node_layer.items() if c == container}
    idxs = sorted(set(in_layer.values()))
    traced = len(idxs)
    num = graph.repeats.get(container, (traced, traced))[1]
    first = [n for n, i in in_layer.items() if i == idxs[0]]
    if traced < 1 or idxs != list(range(idxs[0], idxs[0] + traced)) or any(graph.layer_count[n] != num for n in first):
        return None  # layers that are not all alike: their costs differ, a cut cannot count them
    nodes = graph.nodes()
    positions = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.name in in_layer]
    if not positions:
        return None
    last_layer_pos = positions[-1]
    pre: set[str] = set()
    post: set[str] = set()
    for i, n in enumerate(nodes):
        if n.op == "call_function" and n.name not in in_layer:
            (post if i > last_layer_pos else pre).add(n.name)
    for n in nodes:
        if n.op != "placeholder" or n.name in in_layer or graph.kinds.get(n.name) != NodeKind.PARAM:
            continue
        users = {u.name for u in n.users}
        if users & post:
            post.add(n.name)
        if users & pre or not users & post:
            pre.add(n.name)
    return LayerStructure(
        container, num, traced, frozenset(pre), frozenset(post), _boundary_bytes(graph, in_layer, idxs[0], batch_size)
    )


def why_no_layer_run(graph: OpGraph) -> str:
    """Why `graph` has no one run of alike layers a pipeline can cut, naming the containers of layers it found."""
    found: dict[str, set[int]] = {}
    for c, i in graph.node_layer.values():
        if c is not None:
            found.setdefault(c, set()).add(i)
    if not found:
        return "the model has no repeated layers to cut into stages (pipeline cuts need one container of alike layers)"
    # a stack inside a layer of another (T5's encoder.block.0.layer) is part of that one
    outer = {c: i for c, i in found.items() if not any(c.startswith(o + ".") for o in found if o != c)}
    if len(outer) > 1:
        names = sorted(outer)
        listed = ", ".join(names[:-1]) + f" and {names[-1]}"
        return (
            f"the model has {_count_words(len(names))} stacks of layers: {listed}; pipelines cut several "
            f"stacks (an encoder and a decoder) only from a trace of every layer, not a shortened one"
        )
    container = next(iter(outer))
    return (
        f"the layers of {container} are not all alike (their shapes or ops differ), so a cut cannot count "
        f"them; pipeline cuts need one container of identical layers"
    )


def _count_words(n: int) -> str:
    return {2: "two", 3: "three", 4: "four"}.get(n, str(n))


def _boundary_bytes(graph: OpGraph, in_layer: dict[str, int], first: int, batch_size: int) -> float:
    """Bytes per sample of the values the first traced layer hands the second (the hidden state)."""
    sent = set()
    for n in graph.nodes():
        if in_layer.get(n.name) == first + 1:
            sent.update(a.name for a in tensor_args(n) if in_layer.get(a.name) == first)
    if not sent:  # one traced layer: what it returns to the nodes after it
        last = [n for n in graph.nodes() if in_layer.get(n.name) == first]
        sent = {n.name for n in last if any(u.name not in in_layer for u in n.users) and output_meta(n) is not None}
    total = sum(output_meta(graph.node(n)).nbytes for n in sent if output_meta(graph.node(n)) is not None)
    return total / batch_size


def stage_view(graph: OpGraph, structure: LayerStructure, num_layers: int, *, first: bool, last: bool) -> OpGraph:
    """The OpGraph of one pipeline stage: `num_layers` of the layers, plus the embedding and/or the head.

    The representative layer nodes stand for `num_layers` layers (the view's own `repeats` entry makes
    uses inside a layer count `num_layers` times and uses of the previous layer's output
    `num_layers - 1` times); nodes before the layers count only when `first`, nodes after them only
    when `last`, and the uses they read are scaled the same way. Buffers and inputs count on every
    stage (each stage sees the batch and its masks). With every layer, first and last, the view
    prices exactly like `graph`.
    """
    s = structure
    counts = dict(graph.layer_count)
    scale: dict[str, float] = {}
    for name, n in graph.layer_count.items():
        if name in s.pre or name in s.post:
            on = (first and name in s.pre) or (last and name in s.post)
            counts[name] = n if on else 0
            if graph.kinds.get(name) == NodeKind.COMPUTE and not on:
                scale[name] = 0.0
        elif graph.node_layer.get(name, (None, None))[0] == s.container and n:
            counts[name] = num_layers
    repeats = dict(graph.repeats)
    repeats[s.container] = (s.traced_layers, num_layers)
    tag = f"stage-{num_layers}-{'f' if first else ''}{'l' if last else ''}"
    return dataclasses.replace(graph, view=tag, layer_count=counts, edge_scale=scale, repeats=repeats)


def stack_structure(graph: OpGraph, batch_size: int) -> LayerStructure | None:
    """The layers of several stacks (an encoder and a decoder) as one sequence, or None.

    The layers need not be alike (T5's first layer of each stack computes the position bias): a stage
    is priced by `range_view` over the exact nodes it runs, so every layer is in the trace (no shortened
    trace). `pre`, `post` and the boundary bytes stay empty: ranges and their boundaries are priced
    from the nodes `assign_stages` places (see `_StackPricer`).
    """
    if graph.repeats:
        return None
    _, container, stacks = stack_layers(graph.node_layer)
    if len(stacks) < 2:
        return None
    total = sum(n for _, n in stacks)
    return LayerStructure(container, total, total, frozenset(), frozenset(), 0.0, stacks)


def _stage_nodes(graph: OpGraph, flat: dict, layers: int, a: int, b: int) -> tuple[set[str], dict[str, int]]:
    """(nodes stage [a, b) runs, computed node -> part) when layers 0..a-1, a..b-1, b..layers-1 make the stages."""
    parts = [r for r in ((0, a), (a, b), (b, layers)) if r[0] < r[1]]
    stage, copies = assign_stages(graph.graph, flat, STACKS, [[r] for r in parts], param_nodes=set(graph.params))
    t = parts.index((a, b))
    return {n for n, s in stage.items() if s == t} | {n for n, ss in copies.items() if t in ss}, stage


def range_view(graph: OpGraph, flat: dict, layers: int, a: int, b: int) -> OpGraph:
    """The OpGraph of the stage that runs layers a..b-1 of the stacks' sequence (see `stack_structure`).

    Counts exactly the nodes `assign_stages` puts on that stage (the nodes between the stacks where the
    split puts them, input-only nodes wherever they are copied) and the parameters they read; inputs and
    buffers count on every stage. A representative counts the nodes of the stage it stands for.
    """
    on, _ = _stage_nodes(graph, flat, layers, a, b)
    held = {
        n.name
        for n in graph.nodes()
        if n.op == "placeholder" and n.name in graph.params and any(u.name in on for u in n.users)
    }
    counts = {name: 0 for name in graph.layer_count}
    for n in graph.nodes():
        if n.op == "call_function" and n.name in on or n.name in held:
            rep = graph.representative.get(n.name, n.name)
            counts[rep] = counts.get(rep, 0) + 1
        elif n.op not in ("call_function", "output") and n.name not in graph.params:
            counts[n.name] = graph.layer_count.get(n.name, 1)
    scale = {name: 0.0 for name, c in counts.items() if not c and graph.kinds.get(name) == NodeKind.COMPUTE}
    return dataclasses.replace(graph, view=f"stage-{a}-{b}", layer_count=counts, edge_scale=scale)


def crossing_bytes(graph: OpGraph, flat: dict, layers: int, cut: int, batch_size: int) -> float:
    """Bytes per sample of the values made before layer `cut` and read after it (what crosses that boundary):
    the hidden state, and where the cut sits in the decoder also the encoder's output and the position biases."""
    _, stage = _stage_nodes(graph, flat, layers, 0, cut)
    sent = {n for n, s in stage.items() if s == 0 and any(stage.get(u.name, 0) == 1 for u in graph.node(n).users)}
    return sum(m.nbytes for n in sent if (m := output_meta(graph.node(n))) is not None) / batch_size

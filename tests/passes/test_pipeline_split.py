"""Pipeline split: the stage graphs, run one after another, compute what the whole graph computes."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.errors import LoweringError
from autopar.ir import OpGraph
from autopar.passes.pipeline_split import assign_stages, split_stages, stack_layers, values_needing_grad
from autopar.trace import trace_model
from tests.models import make_batch, make_model


@functools.cache
def _traced(name: str, layers: int):
    model = make_model(name, num_layers=layers)
    args, kwargs = make_batch(name, batch=4, seq=8)
    traced = trace_model(model, args, kwargs)
    return model, args, kwargs, traced, OpGraph.from_traced(traced)


def _placeholder_values(model, traced, args, kwargs) -> dict:
    """Name -> value of every placeholder of the traced graph, from the model and the call."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    sig = traced.exported.graph_signature
    flat = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs)))
    params, buffers, inputs = iter(traced.param_names), iter(traced.buffer_names), iter(flat)
    consts = iter(s.target for s in sig.input_specs if s.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ"))
    out = {}
    phs = [n for n in traced.exported.graph.nodes if n.op == "placeholder"]
    for ph, kind in zip(phs, traced.placeholder_kinds, strict=True):
        if kind in ("param", "buffer"):
            out[ph.name] = named[next(params if kind == "param" else buffers)]
        elif kind == "constant":
            out[ph.name] = traced.exported.constants[next(consts)]
        else:
            out[ph.name] = next(inputs)
    return out


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "layers", "cuts"),
    [
        ("llama", 4, [[(0, 2)], [(2, 4)]]),
        ("gpt2", 5, [[(0, 1)], [(1, 3)], [(3, 5)]]),  # uneven; the tied embedding is read on the first and last stage
        ("llama", 4, [[(0, 1)], [(1, 2)], [(2, 3)], [(3, 4)]]),
    ],
)
def test_stages_in_sequence_give_the_model_loss_and_gradients(name, layers, cuts):
    model, args, kwargs, traced, graph = _traced(name, layers)
    container = next(c for c, _ in graph.node_layer.values() if c is not None)
    stages = split_stages(traced.graph_module, graph.node_layer, container, cuts, param_nodes=set(graph.params))
    assert [sg.index for sg in stages] == list(range(len(cuts)))
    values = _placeholder_values(model, traced, args, kwargs)
    carried: dict = {}
    for sg in stages:
        assert tuple(carried) == sg.received  # what arrives is what the previous stage sent, in its order
        out = sg.graph_module(*[carried[n] for n in sg.received], *[values[n] for n in sg.placeholders])
        carried = dict(zip(sg.sends, out, strict=True)) if sg.sends else {}
    loss = out
    expected = model(*args, **kwargs).loss
    # same ops in the same order on the same inputs: equal up to fp32 rounding of a different kernel choice
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = torch.autograd.grad(expected, list(model.parameters()))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    if name == "gpt2":  # the token embedding is read by the embedding (first stage) and the LM head (last)
        wte = next(n for n, p in graph.params.items() if p.name == "transformer.wte.weight")
        assert wte in stages[0].placeholders and wte in stages[-1].placeholders


@pytest.mark.integration
@pytest.mark.parametrize("cut", [1, 2, 3])  # inside the encoder, between the stacks, inside the decoder
def test_an_encoder_decoder_cut_anywhere_gives_the_model_loss_and_gradients(cut):
    from tests.families import family_batch, make_family

    model = make_family("t5")
    args, kwargs = family_batch("t5")
    traced = trace_model(model, args, kwargs)
    graph = OpGraph.from_traced(traced)
    node_layer, container, stacks = stack_layers(graph.node_layer)
    assert stacks == (("encoder.block", 2), ("decoder.block", 2))
    stages = split_stages(
        traced.graph_module, node_layer, container, [[(0, cut)], [(cut, 4)]], param_nodes=set(graph.params)
    )
    values = _placeholder_values(model, traced, args, kwargs)
    out = stages[0].graph_module(*[values[n] for n in stages[0].placeholders])
    loss = stages[1].graph_module(*out, *[values[n] for n in stages[1].placeholders])
    expected = model(*args, **kwargs).loss
    # same ops in the same order; a stage that lost the in-place shift of the labels into the decoder's
    # inputs (a free copy_ nothing reads) gives another loss altogether (5.16 against 5.63)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for g, r in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    if cut == 3:  # the encoder's output, read by both decoder layers' cross-attention, is carried to stage 1
        nodes = {n.name: n for n in traced.graph_module.graph.nodes}
        both = [
            v
            for v in stages[0].sends
            if {node_layer.get(u.name) for u in nodes[v].users} >= {(container, 2), (container, 3)}
        ]
        assert both and node_layer.get(both[0], (None, None)) == (None, None)


def test_layer_nodes_run_on_their_stage_and_input_only_nodes_are_copied():
    _, _, _, traced, graph = _traced("llama", 4)
    cuts = [[(0, 2)], [(2, 4)]]
    stage, copies = assign_stages(
        traced.exported.graph, graph.node_layer, "model.layers", cuts, param_nodes=set(graph.params)
    )
    checks = {n.name for n in traced.exported.graph.nodes if n.target == torch.ops.aten._assert_tensor_metadata.default}
    assert checks and not checks & (set(stage) | set(copies))  # export's dtype checks run on no stage
    for name, (c, idx) in graph.node_layer.items():
        if c == "model.layers" and graph.node(name).op == "call_function" and name not in checks:
            assert stage[name] == (0 if idx < 2 else 1)
    # rotary tables come from positions and a buffer only: every stage computes its own
    assert any(at == {0, 1} for at in copies.values())
    trainable = {n for n, p in graph.params.items() if p.requires_grad}
    grad = values_needing_grad(traced.exported.graph, trainable)
    assert not any(n in grad for n in copies)  # nothing copied carries a gradient


def test_layers_out_of_order_are_refused():
    _, _, _, traced, graph = _traced("llama", 4)
    with pytest.raises(LoweringError, match="order"):
        split_stages(
            traced.graph_module, graph.node_layer, "model.layers", [[(2, 4)], [(0, 2)]], param_nodes=set(graph.params)
        )
    with pytest.raises(LoweringError, match="no pipeline stage"):
        split_stages(
            traced.graph_module, graph.node_layer, "model.layers", [[(0, 1)], [(1, 3)]], param_nodes=set(graph.params)
        )


@pytest.mark.integration
def test_a_dtype_check_on_the_final_norm_weight_puts_it_on_no_earlier_stage():
    # Gemma-2's RMSNorm reads its weight with .float(): export records an _assert_tensor_metadata on the
    # weight, a node with no graph inputs that used to land on stage 0 and make stage 0 hold the weight
    from tests.families import family_batch, make_family

    args, kwargs = family_batch("gemma2")
    traced = trace_model(make_family("gemma2"), args, kwargs)
    graph = OpGraph.from_traced(traced)
    checked = {
        i.name
        for n in traced.exported.graph.nodes
        if n.target == torch.ops.aten._assert_tensor_metadata.default
        for i in n.all_input_nodes
    }
    assert "p_model_norm_weight" in checked
    before = len(traced.exported.graph.nodes)
    stages = split_stages(
        traced.graph_module, graph.node_layer, "model.layers", [[(0, 1)], [(1, 2)]], param_nodes=set(graph.params)
    )
    assert len(traced.exported.graph.nodes) == before  # the traced graph is left as it is
    assert "p_model_norm_weight" not in stages[0].placeholders
    assert "p_model_norm_weight" in stages[1].placeholders
    assert "p_model_layers_1_input_layernorm_weight" not in stages[0].placeholders
    for sg in stages:
        assert not any(n.target == torch.ops.aten._assert_tensor_metadata.default for n in sg.graph_module.graph.nodes)

"""Graph passes the programs run (passes.program_graph): each counts the ops it removes and keeps the numerics."""

from __future__ import annotations

import pytest
import torch

from autopar.passes.program_graph import drop_assertions_pass, fold_constants_pass
from autopar.runtime import flat_inputs, placeholder_values
from autopar.trace import trace_model
from tests.models import VOCAB, tiny_llama

aten = torch.ops.aten


def _traced_llama():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16))
    traced = trace_model(model, (ids,), {"labels": ids})
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    values = placeholder_values(
        traced,
        [named[n] for n in traced.param_names],
        [buffers[n] for n in traced.buffer_names],
        traced.exported.constants.get,
        flat_inputs(traced, (ids,), {"labels": ids}),
    )
    return traced, values


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.integration
def test_checks_are_dropped_and_constants_folded_with_the_same_loss_and_gradients():
    traced, values = _traced_llama()
    gm = traced.graph_module
    before = _ops(gm)
    loss_ref = gm(*values)[0]
    grads_ref = torch.autograd.grad(loss_ref, [v for v in values if isinstance(v, torch.nn.Parameter)])

    drop_assertions_pass(gm, values)
    assert aten._assert_tensor_metadata.default in before and aten._assert_tensor_metadata.default not in _ops(gm)
    kinds = traced.placeholder_kinds
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    constant = {n for n, k in zip(names, kinds, strict=True) if k in ("buffer", "constant")}
    fold_constants_pass(gm, values, constant_placeholders=constant)
    after = _ops(gm)
    # The causal mask and the rotary tables are built from constants only: their ops leave the graph.
    assert aten.arange.default in before and aten.arange.default not in after
    assert aten.cos.default in before and aten.cos.default not in after
    # every op that touches the parameters stays
    assert after.count(aten.linear.default) == before.count(aten.linear.default)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)

    loss = gm(*values)[0]
    grads = torch.autograd.grad(loss, [v for v in values if isinstance(v, torch.nn.Parameter)])
    assert torch.equal(loss, loss_ref)  # the same ops on the same values: bit for bit
    for g, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


@pytest.mark.integration
def test_only_what_the_named_placeholders_determine_folds():
    traced, values = _traced_llama()
    gm = traced.graph_module
    before = _ops(gm)
    fold_constants_pass(gm, values, constant_placeholders=set())
    after = _ops(gm)
    # The rotary tables read the inv_freq buffer, which is not named constant here: they stay.
    assert after.count(aten.cos.default) == before.count(aten.cos.default) == 1
    # ops that read no placeholder at all (the positions' arange) are constants whatever is named
    assert aten.arange.default not in after
    assert after.count(aten.linear.default) == before.count(aten.linear.default)

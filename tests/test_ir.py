"""OpGraph: parameters under their original names, and identical layers mapped onto the first."""

from __future__ import annotations

import pytest

from autopar.ir import NodeKind, OpGraph
from autopar.trace import trace_model
from tests.models import make_batch, make_model


@pytest.mark.integration
def test_layers_are_deduplicated_and_parameters_named():
    model = make_model("llama", num_layers=3)
    args, kwargs = make_batch("llama")
    graph = OpGraph.from_traced(trace_model(model, args, kwargs))
    assert graph.num_layers == 3 and graph.deduplicated_layers == 2
    names = {p.name for p in graph.params.values()}
    assert names == {n for n, _ in model.named_parameters()}
    assert graph.num_parameters() == sum(p.numel() for p in model.parameters())
    # every node of layers 1 and 2 stands in for nothing; its representative in layer 0 counts three
    counts = [c for c in graph.layer_count.values() if c > 1]
    assert counts and set(counts) == {3}
    zero = [n for n, c in graph.layer_count.items() if c == 0]
    assert len(zero) == 2 * len(counts)
    for name in zero:
        rep = graph.representative[name]
        a, b = graph.node(rep), graph.node(name)
        assert a.op == b.op and (a.op == "placeholder" or a.target == b.target)
    assert sum(1 for k in graph.kinds.values() if k == NodeKind.INPUT) == 2  # input ids and labels


@pytest.mark.integration
def test_frozen_parameters_are_not_counted_as_trainable():
    model = make_model("gpt2")
    args, kwargs = make_batch("gpt2")
    frozen = frozenset({"transformer.wpe.weight"})
    graph = OpGraph.from_traced(trace_model(model, args, kwargs), frozen_params=frozen)
    wpe = next(p for p in graph.params.values() if p.name == "transformer.wpe.weight")
    assert not wpe.requires_grad
    assert graph.num_parameters() == sum(p.numel() for p in model.parameters()) - wpe.meta.numel

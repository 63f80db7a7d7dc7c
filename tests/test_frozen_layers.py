"""Frozen parameters are part of a layer's signature: a partly frozen model is planned with exactly its trainable
parameters, priced as frozen (no gradient, optimizer state or gradient reduction), and compiles with its own plan."""

from __future__ import annotations

import pytest

import autopar
from autopar.ir import OpGraph
from autopar.trace import trace_model
from tests.models import make_batch, make_model


def _frozen_first_layer(num_layers: int = 3):
    model = make_model("llama", num_layers=num_layers)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    return model


def test_a_frozen_layer_is_not_the_representative_of_trainable_ones():
    model = _frozen_first_layer()
    args, kwargs = make_batch("llama")
    frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
    graph = OpGraph.from_traced(trace_model(model, args, kwargs), frozen_params=frozen)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert graph.num_parameters() == trainable
    # layers 1 and 2 still share one representative: layer 1 stands for both, layer 0 for itself
    assert graph.deduplicated_layers == 1
    reps = {graph.representative[info.node_name] for info in graph.params.values() if ".layers.2." in info.name}
    assert reps and all(".layers.1." in graph.params[r].name for r in reps)


@pytest.mark.integration
def test_plan_counts_the_trainable_parameters_and_compile_accepts_it():
    model = _frozen_first_layer()
    args, kwargs = make_batch("llama")
    plan = autopar.plan(model, "cpu:1", args, kwargs)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.num_parameters == trainable
    # fp32 AdamW holds two moments per trainable element (8 bytes): none for the frozen layer
    assert plan.predicted.memory_breakdown["optimizer"] == 8 * trainable
    whole = autopar.plan(make_model("llama", num_layers=3), "cpu:1", args, kwargs)
    assert whole.predicted.memory_breakdown["optimizer"] > plan.predicted.memory_breakdown["optimizer"]
    pm = autopar.compile(model, "cpu:1", args, kwargs, plan=plan)
    assert pm.plan is plan or pm.plan.num_parameters == trainable
    assert pm.train_step(*args, **kwargs) > 0

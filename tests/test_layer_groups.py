"""The layer a parameter belongs to: one rule (`autopar.trace.layer_of_param`) for the price of ZeRO's layer gathers
(the `layer` of an `OpGraph` parameter) and for the sharded program's gathers (`layer_gather.layer_groups`).

Models whose names hold several numbers (T5's numbered sub-layers inside a block, Mixtral's numbered experts inside
a layer) are where a rule of the first number and one of the last would part: the layer is the outermost numbered
module, the one `autopar.trace.layer_of` gives the ops that read the parameter.
"""

from __future__ import annotations

import pytest

from autopar.ir import OpGraph
from autopar.runtime.layer_gather import layer_groups
from autopar.trace import layer_of, layer_of_param, trace_model
from tests.families import family_batch, make_family

# name -> (container, index) of its layer; None: outside the repeated layers
NAMES = {
    # llama
    "model.embed_tokens.weight": None,
    "model.layers.0.self_attn.q_proj.weight": ("model.layers", 0),
    "model.layers.0.mlp.down_proj.weight": ("model.layers", 0),
    "model.layers.1.input_layernorm.weight": ("model.layers", 1),
    "model.layers.12.post_attention_layernorm.weight": ("model.layers", 12),
    "model.norm.weight": None,
    "lm_head.weight": None,
    # gpt2
    "transformer.wte.weight": None,
    "transformer.wpe.weight": None,
    "transformer.h.0.attn.c_attn.weight": ("transformer.h", 0),
    "transformer.h.3.mlp.c_proj.bias": ("transformer.h", 3),
    "transformer.ln_f.weight": None,
    # bert
    "bert.embeddings.word_embeddings.weight": None,
    "bert.encoder.layer.0.attention.self.query.weight": ("bert.encoder.layer", 0),
    "bert.encoder.layer.11.output.LayerNorm.bias": ("bert.encoder.layer", 11),
    "cls.predictions.transform.dense.weight": None,
    # T5: a block's numbered sub-layers (self-attention, cross-attention, MLP) are part of the block
    "shared.weight": None,
    "encoder.block.0.layer.0.SelfAttention.q.weight": ("encoder.block", 0),
    "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": ("encoder.block", 0),
    "encoder.block.0.layer.1.DenseReluDense.wi.weight": ("encoder.block", 0),
    "encoder.block.1.layer.1.layer_norm.weight": ("encoder.block", 1),
    "encoder.final_layer_norm.weight": None,
    "decoder.block.0.layer.1.EncDecAttention.k.weight": ("decoder.block", 0),
    "decoder.block.1.layer.2.DenseReluDense.wo.weight": ("decoder.block", 1),
    "decoder.final_layer_norm.weight": None,
    # Mixtral, experts as numbered modules (older naming): an expert is part of its layer
    "model.layers.0.block_sparse_moe.gate.weight": ("model.layers", 0),
    "model.layers.0.block_sparse_moe.experts.3.w1.weight": ("model.layers", 0),
    "model.layers.1.block_sparse_moe.experts.0.w2.weight": ("model.layers", 1),
    # Mixtral, experts as stacked tensors (newer naming)
    "model.layers.0.mlp.gate.weight": ("model.layers", 0),
    "model.layers.0.mlp.experts.gate_up_proj": ("model.layers", 0),
    "model.layers.1.mlp.experts.down_proj": ("model.layers", 1),
    # a root Sequential's numbered modules have no container; a ParameterList entry is a tensor, not a module
    "0.weight": None,
    "0.1.weight": ("0", 1),
    "heads.3": None,
    "model.layers.2.scales.1": ("model.layers", 2),
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_parameter_is_in_its_outermost_numbered_module(name):
    assert layer_of_param(name) == (NAMES[name] or (None, None))


def test_the_program_gathers_together_what_the_price_counts_as_one_layer():
    """`layer_groups` (what one all-gather of the sharded program brings) is the grouping by `layer_of_param` (what
    the planner's `_members` counts), names outside layers alone; groups in order of their first member."""
    names = list(NAMES)
    expected: dict[object, list[int]] = {}
    for k, name in enumerate(names):
        expected.setdefault(NAMES[name] or name, []).append(k)
    assert layer_groups(names) == list(expected.values())
    t5_block = [names.index(n) for n in names if n.startswith("encoder.block.0.")]
    assert len(t5_block) == 3 and t5_block in layer_groups(names)  # one gather for the block's three sub-layers


@pytest.mark.integration
@pytest.mark.parametrize("family", ["t5", "mixtral", "llama"])
def test_a_traced_parameter_is_in_the_layer_of_the_ops_that_read_it(family):
    """On a traced model: an `OpGraph` parameter's layer (the price) is `layer_of_param` of its name (the program's
    groups), and it is the `layer_of` of every op that reads it (the layers the planner dedups and cuts)."""
    args, kwargs = family_batch(family)
    traced = trace_model(make_family(family), args, kwargs)
    graph = OpGraph.from_traced(traced)
    inside = 0
    for info in graph.params.values():
        assert info.layer == layer_of_param(info.name), info.name
        readers = {layer_of(u) for u in graph.node(info.node_name).users}
        assert readers <= {info.layer}, (info.name, readers)
        inside += info.layer[0] is not None
    assert inside > 0
    names = list(traced.param_names)
    by_price: dict[object, list[int]] = {}
    for k, name in enumerate(names):
        layer = next(p.layer for p in graph.params.values() if p.name == name)
        by_price.setdefault(layer if layer[0] is not None else name, []).append(k)
    assert layer_groups(names) == list(by_price.values())

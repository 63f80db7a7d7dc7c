"""Sharding rules: placements follow views and matrix ops the way the math says."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir import tensor_args
from autopar.passes import sharding_rules as rules
from autopar.trace import trace_model


def _nodes(fn_module, *inputs):
    traced = trace_model(fn_module, inputs)
    return {n.name: n for n in traced.exported.graph.nodes if n.op == "call_function"}, traced


class _Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(32, 32)
        self.o = torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h)
        return self.o(h.transpose(1, 2).reshape(b, s, 32))


def test_view_groups_pair_dims_of_equal_size():
    assert rules.view_groups((2, 16, 64), (2, 16, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert rules.view_groups((2, 16, 4, 16), (32, 64)) == [([0, 1], [0]), ([2, 3], [1])]


def test_head_split_view_keeps_the_shard_on_heads():
    nodes, _ = _nodes(_Heads(), torch.randn(2, 16, 32))
    view = next(n for n in nodes.values() if n.target == torch.ops.aten.view.default)
    # hidden split over 2 ranks -> the heads dim (first of the split group) carries the shard
    assert rules.follow(view, Shard(2), 2) == Shard(2)
    assert rules.follow(view, Replicate(), 2) == Replicate()
    tr = next(n for n in nodes.values() if n.target == torch.ops.aten.transpose.int)
    assert rules.follow(tr, Shard(2), 2) == Shard(1)
    # 4 heads do not split over 8 ranks
    assert rules.follow(view, Shard(2), 8) is None


def test_linear_strategies_are_megatron_column_and_row():
    nodes, _ = _nodes(_Heads(), torch.randn(2, 16, 32))
    lin = next(n for n in nodes.values() if n.target == torch.ops.aten.linear.default)
    strategies = {s.name: s for s in rules.strategies_for(lin, 2)}
    col, row = strategies["column parallel"], strategies["row parallel"]
    assert col.inputs == (Replicate(), Shard(0), Shard(0)) and col.output == Shard(2)
    assert col.grad_placements()[0] == Partial()  # the input's gradient sums over the output shards
    assert row.inputs == (Shard(2), Shard(1), Replicate()) and row.output == Partial()
    assert all(s.divisor == 2 for s in (col, row))
    assert len(tensor_args(lin)) == 3


def test_attention_splits_heads_or_batch_only():
    nodes, _ = _nodes(_Heads(), torch.randn(2, 16, 32))
    sdpa = next(n for n in nodes.values() if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    outs = {s.output for s in rules.strategies_for(sdpa, 2)}
    assert outs == {Replicate(), Shard(1), Shard(0)}
    outs4 = {s.output for s in rules.strategies_for(sdpa, 4)}
    assert Shard(0) not in outs4  # batch 2 does not split 4 ways


def test_unruled_op_is_replicated_and_recorded():
    class Flip(torch.nn.Module):
        def forward(self, x):
            return torch.flip(x, dims=[0]) * 2

    nodes, _ = _nodes(Flip(), torch.randn(4, 4))
    rules.UNRULED_OPS.clear()
    flip = next(n for n in nodes.values() if n.target == torch.ops.aten.flip.default)
    assert [s.output for s in rules.strategies_for(flip, 2)] == [Replicate()]
    assert "aten.flip.default" in rules.UNRULED_OPS


def test_placement_strings_round_trip():
    for p in (Replicate(), Partial(), Shard(0), Shard(3)):
        assert rules.parse_placement(rules.placement_str(p)) == p


def _fused_graph():
    """A fused tiny LLaMA, traced on the meta device."""
    from autopar import presets
    from autopar.passes.fused_ops import fuse_traced

    config = presets.load_config("tiny-llama", num_hidden_layers=1)
    model = presets.build_model(config, device="meta")
    args, kwargs = presets.example_batch(config, 4, 16, device="meta")
    return fuse_traced(trace_model(model, args, kwargs)).graph_module.graph


@pytest.mark.integration
def test_fused_ops_have_rules():
    placement_str = rules.placement_str
    graph = _fused_graph()
    by_op = {}
    for node in graph.nodes:
        if str(node.target).startswith("autopar."):
            by_op.setdefault(str(node.target).split(".")[1], node)
    assert set(by_op) == {"flash_attention", "rms_norm", "linear_cross_entropy"}

    def named(node, tp):
        return {s.name: s for s in rules.strategies_for(node, tp)[1:]}

    kv_heads = by_op["flash_attention"].args[1].meta["val"].shape[1]
    assert named(by_op["flash_attention"], kv_heads).keys() == {"head parallel", "batch parallel"}
    assert named(by_op["flash_attention"], 8).keys() == set()  # 4 heads, batch 4: nothing splits 8 ways
    rows = named(by_op["rms_norm"], 2)
    assert rows and all(s.inputs[1] == Replicate() and s.grad_placements()[1].is_partial() for s in rows.values())
    assert "rows S(2)" not in rows  # never the normalised (last) dim
    (tokens,) = named(by_op["linear_cross_entropy"], 2).values()
    assert [placement_str(p) for p in tokens.inputs] == ["S(0)", "R", "S(0)"]
    assert placement_str(tokens.output) == "R" and placement_str(tokens.grad_placements()[1]) == "P"

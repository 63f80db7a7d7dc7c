"""Sharding rules: placements follow views and matrix ops the way the math says."""

from __future__ import annotations

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

"""Every sharding rule against DTensor: run each strategy's op on two gloo ranks and compare placements.

For every op a rule in `passes.sharding_rules` covers (followers included), a one-op fx graph runs under the
`ShardedInterpreter` (the program's own runtime: DTensor's ATen rules, or the interpreter's local ops for
attention) with its tensor arguments placed as the strategy says on the tensor axis of a (dp=1, tp=2) mesh,
and nothing forced on the output. The output placement the runtime produces must be the one the rule claims
(masked partial sums included), and its full value the op's value on whole tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed
aten = torch.ops.aten


def _samples():
    """(label, target, args) per op a rule covers: shapes divisible by 2 where a split may fall."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x, y, b8 = r(4, 6, 8), r(4, 6, 8), r(8)
    pos, mask = r(4, 6, 8).abs() + 0.5, r(4, 6, 8) > 0
    ids = torch.randint(0, 16, (4, 6), generator=g)
    out = []
    for op in (
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.maximum.default,
        aten.minimum.default,
        aten.eq.Tensor,
        aten.ne.Tensor,
        aten.le.Tensor,
        aten.lt.Tensor,
        aten.ge.Tensor,
        aten.gt.Tensor,
    ):
        out += [(f"{op} same", op, (x, y)), (f"{op} broadcast", op, (x, b8))]
    out += [
        ("pow.Tensor_Tensor", aten.pow.Tensor_Tensor, (pos, y)),
        ("where", aten.where.self, (mask, x, y)),
        ("and", aten.__and__.Tensor, (mask, mask)),
        ("bitwise_and", aten.bitwise_and.Tensor, (mask, mask)),
        ("or", aten.__or__.Tensor, (mask, mask)),
        ("masked_fill.Tensor", aten.masked_fill.Tensor, (x, mask, r(()))),
        ("cat", aten.cat.default, ([x, y], 1)),
        ("mean.dim", aten.mean.dim, (x, [2])),
        ("sum.dim_IntList", aten.sum.dim_IntList, (x, [1], True)),
        ("amax", aten.amax.default, (x, [2])),
        ("amin", aten.amin.default, (x, [1])),
        ("_softmax", aten._softmax.default, (x, 2, False)),
        ("softmax.int", aten.softmax.int, (x, 2)),
        ("_log_softmax", aten._log_softmax.default, (x, 2, False)),
        ("log_softmax.int", aten.log_softmax.int, (x, 2)),
        ("cumsum", aten.cumsum.default, (x, 1)),
        ("layer_norm", aten.layer_norm.default, (x, [8], r(8), r(8))),
        ("rms_norm", aten.rms_norm.default, (x, [8], r(8), 1e-6)),
        ("linear", aten.linear.default, (x, r(10, 8), r(10))),
        ("linear no bias", aten.linear.default, (x, r(10, 8))),
        ("addmm", aten.addmm.default, (r(10), r(6, 8), r(8, 10))),
        ("mm", aten.mm.default, (r(6, 8), r(8, 10))),
        ("bmm", aten.bmm.default, (x, r(4, 8, 10))),
        ("matmul x@W", aten.matmul.default, (x, r(8, 10))),
        ("matmul batched", aten.matmul.default, (x, r(4, 8, 10))),
        ("embedding", aten.embedding.default, (r(16, 8), ids)),
        ("sdpa", aten.scaled_dot_product_attention.default, (r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8))),
        ("cross_entropy", aten.cross_entropy_loss.default, (r(24, 16), ids.reshape(-1))),
    ]
    # followers: one tensor argument, output placement a function of the input's
    for op in (
        aten.silu.default,
        aten.gelu.default,
        aten.tanh.default,
        aten.relu.default,
        aten.sigmoid.default,
        aten.exp.default,
        aten.cos.default,
        aten.sin.default,
        aten.abs.default,
        aten.neg.default,
        aten.clone.default,
        aten.alias.default,
        aten.detach.default,
        aten.logical_not.default,
    ):
        out.append((str(op), op, (x,)))
    out += [
        ("rsqrt", aten.rsqrt.default, (pos,)),
        ("sqrt", aten.sqrt.default, (pos,)),
        ("pow.Tensor_Scalar", aten.pow.Tensor_Scalar, (x, 2)),
        ("mul.Scalar", aten.mul.Scalar, (x, 3.0)),
        ("div.Scalar", aten.div.Scalar, (x, 2.0)),
        ("add.Scalar", aten.add.Scalar, (x, 1.0)),
        ("sub.Scalar", aten.sub.Scalar, (x, 1.0)),
        ("gt.Scalar", aten.gt.Scalar, (x, 0.0)),
        ("ne.Scalar", aten.ne.Scalar, (x, 0.0)),
        ("eq.Scalar", aten.eq.Scalar, (x, 0.0)),
        ("ge.Scalar", aten.ge.Scalar, (x, 0.0)),
        ("le.Scalar", aten.le.Scalar, (x, 0.0)),
        ("lt.Scalar", aten.lt.Scalar, (x, 0.0)),
        ("masked_fill.Scalar", aten.masked_fill.Scalar, (x, mask, 0.0)),
        ("to.dtype", aten.to.dtype, (x, torch.float64)),
        ("_to_copy", aten._to_copy.default, (x,)),
        ("contiguous", aten.contiguous.default, (x,)),
        ("transpose", aten.transpose.int, (x, 0, 2)),
        ("t", aten.t.default, (r(6, 8),)),
        ("numpy_T", aten.numpy_T.default, (x,)),
        ("permute", aten.permute.default, (x, [2, 0, 1])),
        ("unsqueeze", aten.unsqueeze.default, (x, 1)),
        ("squeeze.dim", aten.squeeze.dim, (r(4, 1, 8), 1)),
        ("select", aten.select.int, (x, 1, 2)),
        ("slice", aten.slice.Tensor, (x, 1, 0, 4)),
        ("slice whole", aten.slice.Tensor, (x, 1, 0, 6)),
        ("narrow", aten.narrow.default, (x, 2, 0, 4)),
        ("split", aten.split.Tensor, (x, 4, 2)),
        ("split_with_sizes", aten.split_with_sizes.default, (x, [2, 6], 2)),
        ("expand", aten.expand.default, (r(4, 1, 8), [4, 6, 8])),
        ("view", aten.view.default, (x, [4, 48])),
        ("reshape", aten.reshape.default, (x, [24, 8])),
        ("_unsafe_view", aten._unsafe_view.default, (x, [4, 6, 2, 4])),
        ("flatten", aten.flatten.using_ints, (x, 0, 1)),
    ]
    return out


def _one_op_graph(target, args) -> tuple[fx.GraphModule, fx.Node, list[torch.Tensor]]:
    """A graph with one placeholder per tensor argument and one call of `target`, every node's meta["val"] set."""
    graph = fx.Graph()
    leaves, spec = pytree.tree_flatten(args)
    tensors, node_args = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            ph = graph.placeholder(f"arg{len(tensors)}")
            ph.meta["val"] = leaf
            tensors.append(leaf)
            node_args.append(ph)
        else:
            node_args.append(leaf)
    node = graph.call_function(target, tuple(pytree.tree_unflatten(node_args, spec)))
    node.meta["val"] = target(*args)
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph), node, tensors


def _placed(t: torch.Tensor, placement, mesh):
    """`t` as a DTensor with `placement` on the tensor axis: a partial sum keeps the whole value on rank 0."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from autopar.passes.sharding_rules import is_masked_partial

    if is_masked_partial(placement):  # made the way a model makes one: a lookup in a vocabulary-split table
        table = distribute_tensor(t.reshape(-1, t.shape[-1]), mesh, (Replicate(), Shard(0)))
        ids = distribute_tensor(torch.arange(table.shape[0]).reshape(t.shape[:-1]), mesh, (Replicate(), Replicate()))
        return aten.embedding.default(table, ids)
    if placement.is_partial():
        local = t if mesh.get_local_rank(1) == 0 else torch.zeros_like(t)
        return DTensor.from_local(local, mesh, (Replicate(), placement), run_check=False)
    return distribute_tensor(t, mesh, (Replicate(), placement))


def _strategies(node, tp):
    """(name, argument placements, claimed output) of every strategy of `node`: a rule's, or a follower's."""
    from torch.distributed.tensor import Partial, Shard

    from autopar.ir import tensor_args
    from autopar.passes import sharding_rules as rules

    if node.target in rules._RULES or not rules.is_follower(node):
        return [(s.name or "replicate", s.inputs, s.output) for s in rules.strategies_for(node, tp)]
    (arg,) = tensor_args(node)
    out = []
    shape = rules._shape(arg)
    candidates = [Shard(d) for d in rules._divisible_dims(shape, tp)] + [Partial()]
    if len(shape) >= 2 and shape[-1] > 1 and rules._shape(node) and arg.meta["val"].is_floating_point():
        candidates.append(rules.MP)  # an embedding's output, as the followers of a lookup see it
    for p in candidates:
        claimed = rules.follow(node, p, tp)
        if claimed is not None:
            out.append((f"follow {rules.placement_str(p)}", (p,), claimed))
    return out


def _same_placement(got, claimed) -> bool:
    from autopar.passes.sharding_rules import is_masked_partial

    if claimed.is_partial():  # a plain partial sum is not a masked one, nor the other way round
        return got.is_partial() and is_masked_partial(got) == is_masked_partial(claimed)
    return got == claimed


def _check_rules(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autopar.passes.parallelize import ShardedInterpreter
    from autopar.passes.sharding_rules import placement_str

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    wrong = []
    for label, target, args in _samples():
        gm, node, tensors = _one_op_graph(target, args)
        for name, inputs, claimed in _strategies(node, world_size):
            placed = [_placed(t, p, mesh) for t, p in zip(tensors, inputs, strict=True)]
            interp = ShardedInterpreter(gm, mesh, {node.name: tuple(placement_str(p) for p in inputs)}, {})
            try:
                got = interp.run(*placed)
            except Exception as e:  # noqa: BLE001 - every failure is reported with its op and strategy
                wrong.append(f"{label} [{name}]: raised {type(e).__name__}: {str(e)[:200]}")
                continue
            got = got[0] if isinstance(got, (tuple, list)) else got
            want = node.meta["val"]
            want = want[0] if isinstance(want, (tuple, list)) else want
            if not isinstance(got, DTensor):
                wrong.append(f"{label} [{name}]: not a DTensor")
                continue
            if not _same_placement(got.placements[1], claimed):
                wrong.append(f"{label} [{name}]: rule says {placement_str(claimed)}, runtime gives {got.placements[1]}")
            try:
                value = got.full_tensor()
            except Exception as e:  # noqa: BLE001 - a placement the runtime cannot reduce is a wrong one
                wrong.append(
                    f"{label} [{name}]: {got.placements[1]} does not reduce: {type(e).__name__}: {str(e)[:120]}"
                )
                continue
            if value.is_floating_point() and not torch.allclose(value, want, atol=1e-5, rtol=1e-5):
                wrong.append(f"{label} [{name}]: values differ by {(value - want).abs().max().item():.3g}")
            elif not value.is_floating_point() and not torch.equal(value, want):
                wrong.append(f"{label} [{name}]: values differ")
    return wrong


def test_every_rule_claims_the_placement_the_runtime_produces():
    wrong = run_distributed(_check_rules, 2)[0]
    assert not wrong, "\n".join(wrong)

"""Sharding rules: for every ATen op, the ways it can run on the tensor-parallel mesh axis.

A rule looks at one fx node (shapes from `node.meta["val"]`) and the size of the tensor axis,
and returns the op's strategies in DTensor's placement vocabulary. A strategy fixes

- the placement each tensor argument must have when the op runs (`inputs`),
- the placement of the output (`output`),
- the placement in which the gradient of each tensor argument comes back (`input_grads`;
  e.g. a column-parallel linear takes its input replicated but returns a `Partial` gradient),
- how many ranks split the op's work (`divisor`).

The data axis is not described here: activations are sharded on their batch dimension over it,
parameters are replicated or (ZeRO) sharded over it, and the solver prices that separately.

Rules are registered with `@register_rule(*targets)` and looked up with `strategies_for`.
An op with no rule gets one fully replicated strategy and is recorded in `UNRULED_OPS`, so
the plan can report it; it never crashes the planner.

Terms: *follower* — an op with one tensor argument whose output placement is a function of the
input placement (views, unary elementwise ops); the solver merges followers into their producer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.ir import output_meta, tensor_args

aten = torch.ops.aten
R = Replicate()
P = Partial()


class MaskedPartial(Partial):
    """A partial sum whose reduction first masks each rank's out-of-range rows: what DTensor's embedding on a
    vocabulary-split table produces (its `_MaskPartial`). It reduces to replicated or sharded values like a
    partial sum, but never turns into a plain one, so no op that wants `Partial` inputs may consume it."""

    def __repr__(self) -> str:
        return "MaskedPartial()"

    # Partial compares by its reduce op only; a masked sum is another placement (it never turns into a plain one)
    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaskedPartial) and self.reduce_op == other.reduce_op

    def __hash__(self) -> int:
        return hash(("masked", self.reduce_op))


MP = MaskedPartial()


def is_masked_partial(p: Placement) -> bool:
    """Whether `p` is a masked partial sum: ours (`MaskedPartial`) or DTensor's (its embedding's output)."""
    return isinstance(p, MaskedPartial) or type(p).__name__ == "_MaskPartial"


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """One way to run an op on the tensor axis (see the module docstring)."""

    inputs: tuple[Placement, ...]
    output: Placement
    divisor: int = 1
    input_grads: tuple[Placement, ...] | None = None
    name: str = ""

    def grad_placements(self) -> tuple[Placement, ...]:
        """Placement of each argument's gradient; by default the argument's own (Partial ones come back replicated)."""
        if self.input_grads is not None:
            return self.input_grads
        return tuple(R if p.is_partial() else p for p in self.inputs)


RuleFn = Callable[[fx.Node, int], list[OpStrategy]]
_RULES: dict[object, RuleFn] = {}
_FOLLOW_RULES: dict[object, Callable[[fx.Node, Placement, int], Placement | None]] = {}
UNRULED_OPS: set[str] = set()


def register_rule(*targets):
    """Register `fn(node, tp) -> list[OpStrategy]` for the given ATen targets."""

    def wrap(fn: RuleFn) -> RuleFn:
        for t in targets:
            _RULES[t] = fn
        return fn

    return wrap


def register_follow(*targets):
    """Register `fn(node, input_placement, tp) -> output placement | None` for follower ops."""

    def wrap(fn):
        for t in targets:
            _FOLLOW_RULES[t] = fn
        return fn

    return wrap


def shard_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


def placement_str(p: Placement) -> str:
    """Compact name used in plans and reports: R, P, MP (a masked partial sum), S(d)."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if is_masked_partial(p):
        return "MP"
    return "P" if p.is_partial() else "R"


def parse_placement(text: str) -> Placement:
    if text == "R":
        return R
    if text == "P":
        return P
    if text == "MP":
        return MP
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise ValueError(f"not a placement: {text!r} (expected R, P, MP or S(dim))")


def _shape(node) -> tuple[int, ...]:
    meta = output_meta(node) if isinstance(node, fx.Node) else None
    return meta.shape if meta else ()


def _divisible_dims(shape: Sequence[int], tp: int) -> list[int]:
    return [d for d, s in enumerate(shape) if s % tp == 0 and s >= tp]


def replicated(node: fx.Node) -> OpStrategy:
    n = len(tensor_args(node))
    return OpStrategy((R,) * n, R, 1, name="replicate")


def is_follower(node: fx.Node) -> bool:
    return node.target in _FOLLOW_RULES and len(tensor_args(node)) == 1


def follow(node: fx.Node, placement: Placement, tp: int) -> Placement | None:
    """The output placement of follower `node` when its input has `placement` (None: not expressible)."""
    if is_masked_partial(placement):
        # DTensor carries its mask along views and copies without reshaping it (so the sum can no longer be
        # reduced) and sums a masked partial only after ops that keep the shape and are linear
        return placement if node.target in _MASK_KEEPING else None
    return _FOLLOW_RULES[node.target](node, placement, tp)


def strategies_for(node: fx.Node, tp: int) -> list[OpStrategy]:
    """All strategies of `node` on a tensor axis of size `tp` (replicated first, always present)."""
    if tp == 1 or not tensor_args(node):
        return [replicated(node)]
    rule = _RULES.get(node.target)
    if rule is None and isinstance(node.target, torch._ops.OpOverload):
        rule = _RULES.get(str(node.target))  # ops registered by name ("autopar.flash_attention.default")
    if rule is None and node.target in _FOLLOW_RULES and len(tensor_args(node)) == 1:
        rule = _follower_as_rule
    if rule is None:
        UNRULED_OPS.add(str(node.target))
        return [replicated(node)]
    out = [replicated(node)]
    seen = {out[0].inputs + (out[0].output,)}
    for s in rule(node, tp):
        key = s.inputs + (s.output,)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _follower_as_rule(node: fx.Node, tp: int) -> list[OpStrategy]:
    (arg,) = tensor_args(node)
    cands = [Shard(d) for d in _divisible_dims(_shape(arg), tp)] + [P]
    out = []
    for c in cands:
        o = follow(node, c, tp)
        if o is not None:
            out.append(OpStrategy((c,), o, tp if not c.is_partial() else 1))
    return out


# ---------------------------------------------------------------- followers: views and unary ops

_UNARY_ELEMENTWISE = [
    aten.silu.default,
    aten.gelu.default,
    aten.tanh.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.exp.default,
    aten.cos.default,
    aten.sin.default,
    aten.pow.Tensor_Scalar,
    aten.dropout.default,
    aten.ne.Scalar,
    aten.eq.Scalar,
    aten.ge.Scalar,
    aten.gt.Scalar,
    aten.le.Scalar,
    aten.lt.Scalar,
    aten.logical_not.default,
    aten.abs.default,
    aten.mul.Scalar,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.div.Scalar,
    aten.masked_fill.Scalar,
    aten.gelu_.default,
    aten.silu_.default,
    aten.clone.default,  # DTensor sums a partial before it copies it
]
_LINEAR_UNARY = [
    aten.neg.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.to.device,
    aten.type_as.default,
    aten.mul.Scalar,
    aten.div.Scalar,
]


# what a masked partial sum stays one through (DTensor sums it before any other op, copies and casts included)
_MASK_KEEPING = {aten.contiguous.default, aten.alias.default, aten.detach.default}


@register_follow(*_UNARY_ELEMENTWISE)
def _follow_unary(node, p, tp):
    return None if p.is_partial() else p


@register_follow(*_LINEAR_UNARY)
def _follow_linear_unary(node, p, tp):
    return p


@register_follow(aten._assert_tensor_metadata.default)
def _follow_assert(node, p, tp):
    return p


@register_follow(operator.getitem)
def _follow_getitem(node, p, tp):
    return p


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


@register_follow(aten.transpose.int)
def _follow_transpose(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    ndim = len(_shape(node))
    a, b = _norm_dim(node.args[1], ndim), _norm_dim(node.args[2], ndim)
    return Shard(b if d == a else a if d == b else d)


@register_follow(aten.t.default)
def _follow_t(node, p, tp):
    d = shard_dim(p)
    return p if d is None else Shard(1 - d)


@register_follow(aten.numpy_T.default)
def _follow_numpy_t(node, p, tp):
    """`x.T`: every dim reversed."""
    d = shard_dim(p)
    return p if d is None else Shard(len(_shape(node)) - 1 - d)


@register_follow(aten.permute.default)
def _follow_permute(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    dims = [_norm_dim(x, len(node.args[1])) for x in node.args[1]]
    return Shard(dims.index(d))


@register_follow(aten.unsqueeze.default)
def _follow_unsqueeze(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    u = _norm_dim(node.args[1], len(_shape(node)))
    return Shard(d if d < u else d + 1)


@register_follow(aten.squeeze.dim, aten.select.int)
def _follow_squeeze(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return None if p.is_partial() and node.target == aten.select.int else p
    s = _norm_dim(node.args[1], len(_shape(node.args[0])))
    if d == s:
        return None
    return Shard(d if d < s else d - 1)


@register_follow(aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default)
def _follow_slice(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    in_shape = _shape(node.args[0])
    # slice and narrow take the dim first; split and split_with_sizes take the sizes first, then the dim
    dim_at = 2 if node.target in (aten.split.Tensor, aten.split_with_sizes.default) else 1
    dim = node.args[dim_at] if len(node.args) > dim_at else node.kwargs.get("dim", 0)
    dim = _norm_dim(dim, len(in_shape))
    if node.target == aten.slice.Tensor:
        out_shape = _shape(node)
        if d != dim or out_shape == in_shape:
            return p
        return None
    return None if d == dim else p


@register_follow(aten.expand.default)
def _follow_expand(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    in_shape, out_shape = _shape(node.args[0]), _shape(node)
    off = len(out_shape) - len(in_shape)
    return Shard(d + off) if in_shape[d] == out_shape[d + off] else None


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of the same total size (a reshape's dim map)."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, go = [], []
        pi = po = 1
        while True:
            if pi == po and gi and go:
                break
            if (pi <= po and i < len(in_shape)) or j >= len(out_shape):
                if i >= len(in_shape):
                    break
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                po *= out_shape[j]
                go.append(j)
                j += 1
        # size-1 dims travel alone so that a shard never lands on one
        groups.append((gi, go))
    return groups


@register_follow(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
def _follow_view(node, p, tp):
    d = shard_dim(p)
    if d is None:
        return p
    in_shape, out_shape = _shape(node.args[0]), _shape(node)
    for gi, go in view_groups(in_shape, out_shape):
        if d not in gi:
            continue
        big_in = [x for x in gi if in_shape[x] != 1]
        big_out = [x for x in go if out_shape[x] != 1]
        if not big_in or d != big_in[0] or not big_out:
            return None
        o = big_out[0]
        return Shard(o) if out_shape[o] % tp == 0 and in_shape[d] % tp == 0 else None
    return None


# ------------------------------------------------------------------------- n-ary elementwise ops

_BINARY_ELEMENTWISE = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.where.self,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.le.Tensor,
    aten.lt.Tensor,
    aten.ge.Tensor,
    aten.gt.Tensor,
    aten.__and__.Tensor,
    aten.bitwise_and.Tensor,
    aten.__or__.Tensor,
    aten.maximum.default,
    aten.minimum.default,
    aten.masked_fill.Tensor,
    aten.pow.Tensor_Tensor,
]


def _broadcast_placement(arg_shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> Placement:
    off = len(out_shape) - len(arg_shape)
    d = out_dim - off
    if d < 0 or arg_shape[d] != out_shape[out_dim]:
        return R
    return Shard(d)


@register_rule(*_BINARY_ELEMENTWISE)
def _elementwise_rule(node, tp):
    args = tensor_args(node)
    out_shape = _shape(node)
    out = []
    for d in _divisible_dims(out_shape, tp):
        ins = tuple(_broadcast_placement(_shape(a), out_shape, d) for a in args)
        out.append(OpStrategy(ins, Shard(d), tp, name=f"elementwise S({d})"))
    if node.target in (aten.add.Tensor, aten.sub.Tensor) and all(_shape(a) == out_shape for a in args):
        out.append(OpStrategy((P,) * len(args), P, 1, name="partial sum"))
    return out


@register_rule(aten.cat.default)
def _cat_rule(node, tp):
    args = tensor_args(node)
    out_shape = _shape(node)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
    return [
        OpStrategy((Shard(d),) * len(args), Shard(d), tp)
        for d in _divisible_dims(out_shape, tp)
        if d != dim and all(_shape(a)[d] == out_shape[d] for a in args)
    ]


# ----------------------------------------------------------------------------- reductions, norms


def _reduced_dims(node) -> list[int]:
    in_shape = _shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        return list(range(len(in_shape)))
    dims = [dims] if isinstance(dims, int) else dims
    return [_norm_dim(d, len(in_shape)) for d in dims]


@register_rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
def _reduction_rule(node, tp):
    in_shape = _shape(node.args[0])
    red = _reduced_dims(node)
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    out = []
    for d in _divisible_dims(in_shape, tp):
        if d in red:
            continue
        od = d if keep else d - sum(1 for r in red if r < d)
        out.append(OpStrategy((Shard(d),), Shard(od), tp))
    return out


@register_rule(
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int, aten.cumsum.default
)
def _softmax_rule(node, tp):
    in_shape = _shape(node.args[0])
    dim = _norm_dim(node.args[1], len(in_shape))
    return [OpStrategy((Shard(d),), Shard(d), tp) for d in _divisible_dims(in_shape, tp) if d != dim]


@register_rule(aten.layer_norm.default, aten.rms_norm.default)
def _norm_rule(node, tp):
    return _rows_norm_strategies(node, tp, len(node.args[1]))


def _rows_norm_strategies(node, tp, norm_ndim: int) -> list[OpStrategy]:
    """A norm over the last `norm_ndim` dims: rows split on any other dim, weight (and bias) whole."""
    args = tensor_args(node)
    in_shape = _shape(node.args[0])
    out = []
    for d in _divisible_dims(in_shape, tp):
        if d >= len(in_shape) - norm_ndim:
            continue
        # weight and bias stay whole; their gradients are sums over the sharded rows
        ins = (Shard(d),) + (R,) * (len(args) - 1)
        grads = (Shard(d),) + (P,) * (len(args) - 1)
        out.append(OpStrategy(ins, Shard(d), tp, grads, name=f"rows S({d})"))
    return out


# ----------------------------------------------------------------------------------- matrix ops


def _linear_like(node, tp, *, x_idx: int, w_idx: int, b_idx: int | None, w_out_dim: int, w_in_dim: int):
    """Strategies of y = x @ W (+ b) with W's output features on `w_out_dim`."""
    args = tensor_args(node)
    x_shape, w_shape = _shape(args[x_idx]), _shape(args[w_idx])
    n = len(args)
    out_ndim = len(x_shape)
    out = []

    def make(x, w, b, o, div, grads_xwb, name):
        ins, grads = [R] * n, [R] * n
        ins[x_idx], ins[w_idx] = x, w
        grads[x_idx], grads[w_idx] = grads_xwb[0], grads_xwb[1]
        if b_idx is not None:
            ins[b_idx], grads[b_idx] = b, grads_xwb[2]
        return OpStrategy(tuple(ins), o, div, tuple(grads), name)

    if w_shape[w_out_dim] % tp == 0:
        out.append(
            make(
                R,
                Shard(w_out_dim),
                Shard(0),
                Shard(out_ndim - 1),
                tp,
                (P, Shard(w_out_dim), Shard(0)),
                "column parallel",
            )
        )
    if w_shape[w_in_dim] % tp == 0:
        out.append(
            make(
                Shard(out_ndim - 1),
                Shard(w_in_dim),
                R,
                P,
                tp,
                (Shard(out_ndim - 1), Shard(w_in_dim), R),
                "row parallel",
            )
        )
    for d in _divisible_dims(x_shape[:-1], tp):
        out.append(make(Shard(d), R, R, Shard(d), tp, (Shard(d), P, P), f"split rows S({d})"))
    return out


@register_rule(aten.linear.default)
def _linear_rule(node, tp):
    b = 2 if len(tensor_args(node)) == 3 else None
    return _linear_like(node, tp, x_idx=0, w_idx=1, b_idx=b, w_out_dim=0, w_in_dim=1)


@register_rule(aten.addmm.default)
def _addmm_rule(node, tp):
    # addmm(bias, x, w) with w laid out [in, out] (GPT-2's Conv1D)
    return _linear_like(node, tp, x_idx=1, w_idx=2, b_idx=0, w_out_dim=1, w_in_dim=0)


@register_rule(aten.mm.default)
def _mm_rule(node, tp):
    return _linear_like(node, tp, x_idx=0, w_idx=1, b_idx=None, w_out_dim=1, w_in_dim=0)


@register_rule(aten.bmm.default, aten.matmul.default)
def _bmm_rule(node, tp):
    a, b = tensor_args(node)
    sa, sb, so = _shape(a), _shape(b), _shape(node)
    if node.target == aten.matmul.default and len(sb) == 2 and len(sa) >= 2:  # x @ W: a linear without bias
        return _linear_like(node, tp, x_idx=0, w_idx=1, b_idx=None, w_out_dim=1, w_in_dim=0)
    out = []
    if len(sa) == len(sb) == len(so) >= 3:
        for d in _divisible_dims(so[:-2], tp):
            if sa[d] == sb[d] == so[d]:
                out.append(OpStrategy((Shard(d), Shard(d)), Shard(d), tp, name=f"batch S({d})"))
    return out


@register_rule(aten.embedding.default)
def _embedding_rule(node, tp):
    w, ids = tensor_args(node)[:2]
    ws, ids_shape = _shape(w), _shape(ids)
    out_ndim = len(ids_shape) + 1
    out = []
    if ws[1] % tp == 0:
        out.append(OpStrategy((Shard(1), R), Shard(out_ndim - 1), tp, name="hidden parallel"))
    if ws[0] % tp == 0:
        # each rank looks up the ids in its rows and zeroes the others: DTensor's masked partial sum
        out.append(OpStrategy((Shard(0), R), MP, tp, name="vocab parallel"))
    for d in _divisible_dims(ids_shape, tp):
        out.append(OpStrategy((R, Shard(d)), Shard(d), tp, (P, Shard(d)), name=f"split rows S({d})"))
    return out


@register_rule(aten.scaled_dot_product_attention.default)
def _sdpa_rule(node, tp):
    args = tensor_args(node)
    q, k = _shape(args[0]), _shape(args[1])
    out = []
    for d, name in ((1, "head parallel"), (0, "batch parallel")):
        if q[d] % tp or k[d] % tp:
            continue
        ins = [Shard(d), Shard(d), Shard(d)]
        for m in args[3:]:  # attention mask: sharded along with the dim unless broadcast
            ms = _shape(m)
            off = len(q) - len(ms)
            ins.append(Shard(d - off) if d - off >= 0 and ms[d - off] == q[d] else R)
        out.append(OpStrategy(tuple(ins), Shard(d), tp, name=name))
    return out


# ---------------------------------------------------------------- autopar's fused Triton ops
# Registered by name: autopar.triton_kernels defines them, and planning must not import Triton.


@register_rule("autopar.flash_attention.default")
def _flash_attention_rule(node, tp):
    """Attention is independent across heads and batch rows; (out, lse) come out split like q."""
    q, k = (_shape(a) for a in tensor_args(node)[:2])
    out = []
    for d, name in ((1, "head parallel"), (0, "batch parallel")):
        if q[d] % tp == 0 and k[d] % tp == 0:  # GQA: contiguous head blocks keep each query group with its kv head
            out.append(OpStrategy((Shard(d),) * 3, Shard(d), tp, name=name))
    return out


@register_rule("autopar.rms_norm.default", "autopar.layer_norm.default")
def _fused_norm_rule(node, tp):
    return _rows_norm_strategies(node, tp, 1)


@register_rule("autopar.linear_cross_entropy.default")
def _linear_cross_entropy_rule(node, tp):
    """Tokens split, LM-head weight whole: each rank's loss sum and kept-label count are summed over the ranks.

    The runtime (`ShardedInterpreter`) does that sum, so the loss comes out replicated and exact whatever the
    spread of ignored labels; the weight's gradient is a sum over the token shards (Partial).
    """
    hidden, weight, labels = tensor_args(node)[:3]
    h, lab = _shape(hidden), _shape(labels)
    out = []
    for d in _divisible_dims(h[:-1], tp):
        if d < len(lab) and lab[d] == h[d]:
            ins = (Shard(d), R, Shard(d))
            out.append(OpStrategy(ins, R, tp, (Shard(d), P, Shard(d)), name=f"split tokens S({d})"))
    return out


# The loss has no rule on purpose: a mean over rows split across ranks is not the mean of the
# local means once some labels are ignored, so the planner keeps the loss replicated on the
# tensor axis (its logits are gathered first) rather than risk a wrong loss.


@register_rule(aten.cross_entropy_loss.default, aten.nll_loss_forward.default)
def _loss_rule(node, tp):
    return []

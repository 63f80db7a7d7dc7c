"""Compute cost per ATen op: FLOPs and bytes from an fx node's shapes, and roofline time.

`estimate_node_cost(node)` reads `node.meta["val"]` of a node of a `torch.export` training
graph and of its argument nodes, and returns an `OpCost`: forward and backward FLOPs and bytes
moved. Per-op knowledge lives in one registry keyed by ATen `OpOverload`, filled by
`@register_op_cost(*targets)`.

Conventions (per op, M·N·K for a product of an M x K and a K x N matrix):

- matmuls (linear, addmm, mm, bmm, matmul, baddbmm): 2·M·N·K forward; backward 2x forward
  (dX = dY·Wᵀ and dW = Xᵀ·dY); 1x where the weight is frozen, dX alone (`input_gradient_only`, applied by the
  planner to the products `passes.sharding.graph.frozen_weight_matmuls` finds). A bias add rides in the GEMM
  epilogue and is not counted.
- grouped matmuls of a mixture of experts (`aten._grouped_mm`, and `transformers::grouped_mm_fallback`
  that Hugging Face's "grouped_mm" experts trace to on CPU and meta): x [S, K] holds the routed
  (token, expert) pairs sorted by expert, w [E, K, N] every expert's matrix; each row meets its own
  expert only, so 2·S·K·N forward (S = tokens x experts per token: the top-k of E, not all E), the
  whole weight read once; backward 2x forward.
- attention (scaled_dot_product_attention and its fused variants): forward 4·b·h·sq·sk·d
  (QKᵀ and PV), half of that when `is_causal`; backward 2.5x forward. An explicit mask does
  not halve anything: the kernel computes every score and masks afterwards. Bytes are those
  of a fused kernel, which never writes the sq x sk scores.
- elementwise ops: 1 FLOP per output element; normalisations and softmax a few per element
  (stated at each). Bytes: every tensor input read once, every output written once; the
  backward reads the output gradient and the saved inputs and writes one gradient per
  floating input.
- views and metadata ops (view, transpose, expand, slice, getitem, ...): free, no kernel.
  Reshape and contiguous are free when they can return a view, and a copy otherwise; a dtype
  conversion is free when the dtype does not change.
- nodes with no floating output have no backward.
- autopar's fused Triton ops (`autopar::flash_attention`, `autopar::rms_norm`,
  `autopar::layer_norm`, `autopar::linear_cross_entropy`) are registered by name, so pricing
  never imports Triton: attention as above; a norm is one read/write pass plus its row statistics;
  the loss is the head's GEMMs and softmax without the tokens x vocab logits (see each entry).

Bytes use the element sizes of the graph's real dtypes. An op without an entry is priced
like an elementwise op and its target recorded in `UNKNOWN_OPS`, so reports can list what was
guessed.

`estimate_compute_time` is a roofline: the larger of FLOPs over the achievable rate and bytes
over the achievable memory bandwidth, plus a fixed launch overhead per kernel. The achievable
matrix rate depends on the kernel that runs (`cost_model.kernels`): a GEMM's on its shape and
dtype (tile and wave quantization on the device's SMs, anchored on measured GEMMs), a fused
attention kernel's on its own forward and backward efficiencies; other ops run at the vector
rate.

The optimizer step is priced apart from the ops (`cost_model.optimizer`, whose names this module
re-exports): `optimizer_step_time_s(estimator, device, ...)` asks the estimator (a profiled one
measured it) and otherwise uses the analytic `estimate_adamw_step_time`, a memory-bound estimate
of eager AdamW on the device.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.cost_model.devices import DeviceSpec, DType
from autopar.cost_model.kernels import local_shape
from autopar.cost_model.optimizer import (  # the optimizer's pricing, kept importable from here
    ADAMW_BYTES_PER_PARAM_BYTE,
    ADAMW_KERNELS_PER_TENSOR,
    FOREACH_TENSORS_PER_LAUNCH,
    estimate_adamw_step_time,
    estimate_optimizer_step_time,
    optimizer_step_time_s,
)

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class OpCost:
    """FLOPs and bytes of one op, forward and backward (bytes: tensors read plus written).

    `gemm` is a matrix product's (batch, m, n, k), whose efficiency depends on its shape; `attention` names the
    fused attention kernel that runs the op (its efficiencies are the device's, `DeviceSpec.attention_kernel`).
    """

    flops: float
    bytes_accessed: float
    backward_flops: float
    backward_bytes: float
    is_matmul: bool = False
    is_view: bool = False
    gemm: tuple[int, int, int, int] | None = None
    attention: str | None = None
    weight_gradient: bool = True  # a GEMM's backward computes dW (False: its weight is frozen, dX only)


def input_gradient_only(cost: OpCost) -> OpCost:
    """The cost of a matrix product whose weight takes no gradient (a frozen parameter): its backward is the one
    GEMM dX = dY·Wᵀ, of the forward's FLOPs, reading dY and W and writing dX (the forward's bytes), where a
    trained weight's backward adds dW = Xᵀ·dY (`matmul_cost`). Other costs are returned as they are."""
    if not cost.is_matmul or cost.gemm is None or cost.attention is not None:
        return cost
    return dataclasses.replace(
        cost, backward_flops=cost.flops, backward_bytes=cost.bytes_accessed, weight_gradient=False
    )


FREE = OpCost(0.0, 0.0, 0.0, 0.0, is_matmul=False, is_view=True)

_REGISTRY: dict[object, Callable[[fx.Node], OpCost]] = {}
UNKNOWN_OPS: set[str] = set()  # str(target) of every op priced by the elementwise fallback


def register_op_cost(*targets):
    """Decorator: register `fn(node) -> OpCost` as the cost of each target in `targets`.

    A target is an op overload (`aten.mm.default`) or the qualified name of an op's default
    overload (`"autopar::flash_attention"`): a name prices an op whose module registers it later,
    so that importing the cost model does not import that module (the Triton kernels).
    """

    def wrap(fn: Callable[[fx.Node], OpCost]) -> Callable[[fx.Node], OpCost]:
        for target in targets:
            _REGISTRY[target] = fn
        return fn

    return wrap


def _overloads(*names: str) -> list:
    """ATen overloads by "packet.overload" name, skipping the ones this torch build lacks."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


# ------------------------------------------------------------------------------------ reading nodes


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors in a meta value: a node's `meta["val"]` (tensor, tuple, None) or a python value."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _input_tensors(node: fx.Node) -> list[torch.Tensor]:
    """Meta tensors of every tensor argument, in pytree order of (args, kwargs)."""
    found = []
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            found += tensors_of(a)
    return found


def node_arg(node: fx.Node, name: str, default=None):
    """Argument `name` of a call to an OpOverload, positional or keyword; a node stands for its meta value."""
    if name in node.kwargs:
        value = node.kwargs[name]
    else:
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        index = names.index(name) if name in names else None
        value = node.args[index] if index is not None and index < len(node.args) else default
    return value.meta.get("val") if isinstance(value, fx.Node) else value


def total_bytes(ts: Iterable[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def total_numel(ts: Iterable[torch.Tensor]) -> float:
    return float(sum(t.numel() for t in ts))


def _floating(ts: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in ts if t.dtype.is_floating_point or t.dtype.is_complex]


# ---------------------------------------------------------------------------------- entry point


def estimate_node_cost(node: fx.Node) -> OpCost:
    """Forward and backward FLOPs and bytes of one fx node (see the module docstring for the conventions)."""
    if node.op != "call_function" or not tensors_of(node):
        return FREE  # placeholders, outputs, asserts and symbolic-size ops launch no kernel
    fn = _REGISTRY.get(node.target)
    if fn is None and isinstance(node.target, torch._ops.OpOverload):
        fn = _REGISTRY.get(node.target.name())
    if fn is None:
        UNKNOWN_OPS.add(str(node.target))
        return elementwise_cost(node)
    return fn(node)


def elementwise_cost(node: fx.Node, flops_per_element: float = 1.0, backward_flops_per_element: float | None = None):
    """Inputs read once, outputs written once; backward reads dY and saved inputs, writes dX per floating input."""
    ins, outs = _input_tensors(node), tensors_of(node)
    flops = flops_per_element * total_numel(outs)
    moved = total_bytes(ins) + total_bytes(outs)
    if not _floating(outs):
        return OpCost(flops, moved, 0.0, 0.0)
    bwd_per = flops_per_element if backward_flops_per_element is None else backward_flops_per_element
    float_ins = total_bytes(_floating(ins))
    return OpCost(flops, moved, bwd_per * total_numel(outs), total_bytes(outs) + 2 * float_ins)


def _copy_cost(node: fx.Node) -> OpCost:
    ins, outs = _input_tensors(node)[:1], tensors_of(node)[:1]
    moved = total_bytes(ins) + total_bytes(outs)
    return OpCost(0.0, moved, 0.0, moved if _floating(outs) else 0.0)


# ------------------------------------------------------------------------------ views and copies

_VIEW_OPS = _overloads(
    "view.default",
    "view.dtype",
    "_unsafe_view.default",
    "transpose.int",
    "permute.default",
    "unsqueeze.default",
    "squeeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "expand.default",
    "expand_as.default",
    "slice.Tensor",
    "select.int",
    "split.Tensor",
    "split_with_sizes.default",
    "unbind.int",
    "chunk.default",
    "narrow.default",
    "alias.default",
    "t.default",
    "detach.default",
    "_assert_tensor_metadata.default",
    "as_strided.default",
    "view_as.default",
    "unflatten.int",
    "diagonal.default",
    "movedim.int",
    "lift_fresh.default",
)


@register_op_cost(operator.getitem, *_VIEW_OPS)
def _free(node: fx.Node) -> OpCost:
    return FREE


def _can_view(src: torch.Tensor, shape) -> bool:
    """Whether `src`'s layout allows a view of `shape` (else reshape copies); decided on the meta device."""
    probe = torch.empty_strided(tuple(src.shape), tuple(src.stride()), dtype=src.dtype, device="meta")
    try:
        probe.view(tuple(shape))
    except RuntimeError:
        return False
    return True


@register_op_cost(*_overloads("reshape.default", "flatten.using_ints", "reshape_as.default"))
def _reshape(node: fx.Node) -> OpCost:
    ins, outs = _input_tensors(node), tensors_of(node)
    if not ins or not outs or _can_view(ins[0], outs[0].shape):
        return FREE
    return _copy_cost(node)


@register_op_cost(aten.contiguous.default)
def _contiguous(node: fx.Node) -> OpCost:
    ins = _input_tensors(node)
    return FREE if not ins or ins[0].is_contiguous() else _copy_cost(node)


@register_op_cost(*_overloads("to.dtype", "to.dtype_layout", "to.device", "to.other", "type_as.default"))
def _to(node: fx.Node) -> OpCost:
    ins, outs = _input_tensors(node), tensors_of(node)
    same = ins and outs and ins[0].dtype == outs[0].dtype and ins[0].device == outs[0].device
    return FREE if same else _copy_cost(node)


@register_op_cost(*_overloads("_to_copy.default", "clone.default", "copy.default", "lift_fresh_copy.default"))
def _copy(node: fx.Node) -> OpCost:
    return _copy_cost(node)


@register_op_cost(
    *_overloads(
        "cat.default",
        "stack.default",
        "pad.default",
        "constant_pad_nd.default",
        "index.Tensor",
        "gather.default",
        "index_select.default",
        "repeat.default",
        "roll.default",
        "flip.default",
        "tril.default",
        "triu.default",
        "masked_fill.Scalar",
        "masked_fill.Tensor",
        "where.self",
        "where.ScalarSelf",
        "where.ScalarOther",
        "where.Scalar",
        "expand_copy.default",
        "scatter.src",
        "scatter.value",
        "index_put.default",
    )
)
def _data_movement(node: fx.Node) -> OpCost:
    """Gathers, selections and concatenations: bytes, no arithmetic."""
    return elementwise_cost(node, flops_per_element=0.0)


@register_op_cost(
    *_overloads(
        "arange.default",
        "arange.start",
        "arange.start_step",
        "full.default",
        "zeros.default",
        "ones.default",
        "empty.memory_format",
        "new_ones.default",
        "new_zeros.default",
        "new_full.default",
        "new_empty.default",
        "zeros_like.default",
        "ones_like.default",
        "full_like.default",
        "empty_like.default",
        "scalar_tensor.default",
        "rand.default",
        "randn.default",
        "randint.default",
        "randint.low",
        "fill.Scalar",
        "fill.Tensor",
    )
)
def _factory(node: fx.Node) -> OpCost:
    """Creating a tensor writes it; it has no inputs worth a gradient."""
    return OpCost(0.0, total_bytes(tensors_of(node)), 0.0, 0.0)


# ---------------------------------------------------------------------------------- elementwise

_ELEMENTWISE_OPS = _overloads(
    "add.Tensor",
    "add.Scalar",
    "sub.Tensor",
    "sub.Scalar",
    "rsub.Tensor",
    "rsub.Scalar",
    "mul.Tensor",
    "mul.Scalar",
    "div.Tensor",
    "div.Scalar",
    "div.Tensor_mode",
    "div.Scalar_mode",
    "neg.default",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "rsqrt.default",
    "sqrt.default",
    "exp.default",
    "log.default",
    "log1p.default",
    "expm1.default",
    "cos.default",
    "sin.default",
    "tanh.default",
    "sigmoid.default",
    "silu.default",
    "gelu.default",
    "relu.default",
    "leaky_relu.default",
    "erf.default",
    "abs.default",
    "sign.default",
    "reciprocal.default",
    "square.default",
    "clamp.default",
    "clamp.Tensor",
    "clamp_min.default",
    "clamp_max.default",
    "minimum.default",
    "maximum.default",
    "lerp.Scalar",
    "addcmul.default",
    "addcdiv.default",
    "floor_divide.default",
    "remainder.Scalar",
    "remainder.Tensor",
    "floor.default",
    "ceil.default",
    "round.default",
    "trunc.default",
    "diff.default",
    "eq.Tensor",
    "eq.Scalar",
    "ne.Tensor",
    "ne.Scalar",
    "lt.Tensor",
    "lt.Scalar",
    "le.Tensor",
    "le.Scalar",
    "gt.Tensor",
    "gt.Scalar",
    "ge.Tensor",
    "ge.Scalar",
    "__and__.Tensor",
    "__or__.Tensor",
    "__xor__.Tensor",
    "bitwise_and.Tensor",
    "bitwise_or.Tensor",
    "bitwise_not.default",
    "logical_and.default",
    "logical_or.default",
    "logical_not.default",
    "isnan.default",
    "isinf.default",
    "bernoulli.p",
)


@register_op_cost(*_ELEMENTWISE_OPS)
def _elementwise(node: fx.Node) -> OpCost:
    return elementwise_cost(node)


@register_op_cost(*_overloads("dropout.default", "native_dropout.default"))
def _dropout(node: fx.Node) -> OpCost:
    """Draw a mask and scale: one FLOP per element; the backward applies the saved mask to dY."""
    ins, outs = _input_tensors(node)[:1], tensors_of(node)[:1]
    mask = total_numel(outs)  # one byte per element
    moved = total_bytes(ins) + total_bytes(outs) + mask
    return OpCost(total_numel(outs), moved, total_numel(outs), 2 * total_bytes(outs) + mask)


# ------------------------------------------------------------------------- reductions and norms


@register_op_cost(
    *_overloads(
        "mean.dim",
        "mean.default",
        "sum.dim_IntList",
        "sum.default",
        "amax.default",
        "amin.default",
        "max.dim",
        "min.dim",
        "argmax.default",
        "argmin.default",
        "cumsum.default",
        "prod.default",
        "var.correction",
        "std.correction",
        "any.default",
        "any.dim",
        "all.default",
        "logsumexp.default",
        "norm.ScalarOpt_dim",
    )
)
def _reduction(node: fx.Node) -> OpCost:
    """One FLOP per input element; the backward broadcasts dY back to the input's size."""
    ins, outs = _input_tensors(node)[:1], tensors_of(node)
    moved = total_bytes(ins) + total_bytes(outs)
    if not _floating(outs):
        return OpCost(total_numel(ins), moved, 0.0, 0.0)
    return OpCost(total_numel(ins), moved, total_numel(ins), total_bytes(outs[:1]) + 2 * total_bytes(ins))


def norm_cost(node: fx.Node, flops_per_element: float) -> OpCost:
    """Normalisation over the last dims; the backward is about twice the forward arithmetic."""
    x, out = _input_tensors(node)[0], tensors_of(node)[0]
    affine = [t for t in (node_arg(node, "weight"), node_arg(node, "bias")) if isinstance(t, torch.Tensor)]
    n = float(x.numel())
    moved = total_bytes([x, out, *affine])
    # backward reads x, dY and the affine parameters, writes dX and the parameters' gradients
    return OpCost(
        flops_per_element * n, moved, 2 * flops_per_element * n, 3 * total_bytes([x]) + 2 * total_bytes(affine)
    )


@register_op_cost(*_overloads("layer_norm.default", "native_layer_norm.default"))
def _layer_norm(node: fx.Node) -> OpCost:
    """Mean, variance, normalise, scale, shift: 5 FLOPs per element."""
    return norm_cost(node, 5.0)


@register_op_cost(*_overloads("rms_norm.default", "_fused_rms_norm.default"))
def _rms_norm(node: fx.Node) -> OpCost:
    """Square, mean, normalise, scale: 4 FLOPs per element."""
    return norm_cost(node, 4.0)


@register_op_cost(*_overloads("_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int"))
def _softmax(node: fx.Node) -> OpCost:
    """Max, subtract, exp, sum, divide: 5 FLOPs per element; backward dX = Y·(dY - sum(dY·Y)): 4, reading Y and dY."""
    x, out = _input_tensors(node)[0], tensors_of(node)[0]
    n = float(out.numel())
    return OpCost(5 * n, total_bytes([x, out]), 4 * n, 3 * total_bytes([out]))


@register_op_cost(aten.cross_entropy_loss.default)
def _cross_entropy(node: fx.Node) -> OpCost:
    """log_softmax over the logits then a gather: 5 FLOPs per logit; backward softmax - one_hot, 3 per logit.

    Eager cross-entropy writes the log-probabilities and reads them back (2 logit-sized passes);
    the backward writes the gradient of the log-probabilities and then of the logits (4 passes).
    """
    logits, target = _input_tensors(node)[:2]
    n, lb = float(logits.numel()), total_bytes([logits])
    return OpCost(5 * n, 2 * lb + total_bytes([target]), 3 * n, 4 * lb + total_bytes([target]))


@register_op_cost(aten.nll_loss_forward.default)
def _nll_loss(node: fx.Node) -> OpCost:
    """Gather one log-probability per row; the backward zero-fills a gradient as large as the input."""
    x, target = _input_tensors(node)[:2]
    rows = float(target.numel())
    picked = rows * x.element_size()
    return OpCost(rows, total_bytes([target]) + picked, rows, total_bytes([x, target]))


@register_op_cost(aten.embedding.default)
def _embedding(node: fx.Node) -> OpCost:
    """Gather rows: read and write them. Backward zero-fills the table's gradient and scatter-adds dY into it."""
    weight, indices = _input_tensors(node)[:2]
    out = tensors_of(node)[0]
    fwd = total_bytes([indices]) + 2 * total_bytes([out])
    if not weight.dtype.is_floating_point:
        return OpCost(0.0, fwd, 0.0, 0.0)
    return OpCost(0.0, fwd, float(out.numel()), total_bytes([weight, indices]) + 2 * total_bytes([out]))


# ------------------------------------------------------------------------------------ matmuls


def gemm_shape(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of the product: a weight (b of at most 2 dims) folds every leading dim of a into m."""
    k = int(a.shape[-1]) if a.ndim else 1
    n = int(out.shape[-1]) if out.ndim else 1
    if b.ndim <= 2 or out.ndim < 3:
        return 1, max(int(out.numel()) // max(n, 1), 1), n, k
    batch = int(out.numel()) // (int(out.shape[-2]) * n) if out.numel() else 1
    return batch, int(out.shape[-2]), n, k


def matmul_cost(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, extra: Iterable[torch.Tensor] = ()) -> OpCost:
    """2·(output elements)·K FLOPs, K the contracted size; backward twice that (dX and dW)."""
    k = a.shape[-1] if a.ndim else 1
    flops = 2.0 * out.numel() * k
    operands = total_bytes([a, b])
    moved = operands + total_bytes(extra) + total_bytes([out])
    # each backward GEMM reads dY and one operand and writes the other operand's gradient
    return OpCost(
        flops, moved, 2 * flops, 2 * (operands + total_bytes([out])), is_matmul=True, gemm=gemm_shape(a, b, out)
    )


@register_op_cost(aten.linear.default)
def _linear(node: fx.Node) -> OpCost:
    """x [..., K] · Wᵀ with W [N, K]."""
    x, w, out = node_arg(node, "input"), node_arg(node, "weight"), tensors_of(node)[0]
    bias = node_arg(node, "bias")
    return matmul_cost(x, w, out, [bias] if isinstance(bias, torch.Tensor) else [])


@register_op_cost(*_overloads("addmm.default", "baddbmm.default"))
def _addmm(node: fx.Node) -> OpCost:
    first = "mat1" if node.target == aten.addmm.default else "batch1"
    second = "mat2" if node.target == aten.addmm.default else "batch2"
    a, b, out = node_arg(node, first), node_arg(node, second), tensors_of(node)[0]
    return matmul_cost(a, b, out, [node_arg(node, "self")])


@register_op_cost(*_overloads("mm.default", "bmm.default", "matmul.default"))
def _mm(node: fx.Node) -> OpCost:
    a, b = _input_tensors(node)[:2]
    return matmul_cost(a, b, tensors_of(node)[0])


@register_op_cost(*_overloads("_grouped_mm.default"), "transformers::grouped_mm_fallback")
def _grouped_mm(node: fx.Node) -> OpCost:
    """x [S, K] · w[e] for the rows of expert e, w [E, K, N]: 2·S·K·N (see the module docstring)."""
    x, w = _input_tensors(node)[:2]
    return matmul_cost(x, w, tensors_of(node)[0])


# the kernels attention runs as (their efficiencies are the device's `attention_efficiency`): PyTorch's
# scaled_dot_product_attention (its flash backend, FlashAttention-2, on GPUs) and autopar's Triton kernel
SDPA_KERNEL = "sdpa"
TRITON_KERNEL = "triton"

_SDPA_OPS = _overloads(
    "scaled_dot_product_attention.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
)


@register_op_cost(*_SDPA_OPS)
def _sdpa(node: fx.Node) -> OpCost:
    """q [..., h, sq, d], k [..., hk, sk, d], v [..., hk, sk, dv]: 2·b·h·sq·sk·(d + dv), halved when causal."""
    q, k, v = (node_arg(node, name) for name in ("query", "key", "value"))
    out = tensors_of(node)[0]
    mask = node_arg(node, "attn_mask", node_arg(node, "attn_bias"))
    sq, d, sk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    heads_times_batch = q.numel() / (sq * d)
    flops = 2.0 * heads_times_batch * sq * sk * (d + dv)
    if node_arg(node, "is_causal", False):
        flops *= 0.5
    mask_bytes = total_bytes([mask]) if isinstance(mask, torch.Tensor) else 0.0
    qkv = total_bytes([q, k, v])
    # backward reads q, k, v, O, dO (and the mask) and writes dq, dk, dv
    bwd_bytes = 2 * qkv + 2 * total_bytes([out]) + mask_bytes
    return OpCost(
        flops, qkv + mask_bytes + total_bytes([out]), 2.5 * flops, bwd_bytes, is_matmul=True, attention=SDPA_KERNEL
    )


# ------------------------------------------------------------------------------------- timing


def estimate_compute_time(
    cost: OpCost, device: DeviceSpec, dtype: DType, *, divisor: float = 1.0, backward: bool = False
) -> float:
    """Roofline seconds of `cost` on `device`: max(FLOPs / achievable rate, bytes / achievable bandwidth) + launch.

    Args:
        cost: the op's FLOPs and bytes.
        device: the device it runs on.
        dtype: the format its matmuls run in (selects the matrix peak).
        divisor: how many devices split the op's work evenly (FLOPs and bytes are divided by it).
        backward: price the backward instead of the forward.

    Non-matmul work is priced at the vector peak without an efficiency factor: such ops are
    memory bound by an order of magnitude, so the byte term decides.
    """
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    if cost.is_view:
        return 0.0
    flops = (cost.backward_flops if backward else cost.flops) / divisor
    moved = (cost.backward_bytes if backward else cost.bytes_accessed) / divisor
    if flops == 0 and moved == 0:
        return 0.0
    if cost.is_matmul:
        rate = device.peak_matmul_flops(dtype) * _matmul_share(cost, device, dtype, divisor, backward)
    else:
        rate = device.vector_flops_per_s
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    return max(flops / rate, moved / bandwidth) + device.kernel_overhead_s


def _matmul_share(cost: OpCost, device: DeviceSpec, dtype: DType, divisor: float, backward: bool) -> float:
    """The share of the matrix peak the op runs at: its attention kernel's, its GEMM shape's, or the plateau.

    A GEMM's backward is two GEMMs of the forward's FLOPs each, dX (m x k, contracting n) and dW (k x n,
    contracting m): their harmonic mean; dX's alone where the weight is frozen (`input_gradient_only`).
    """
    if cost.attention is not None:
        kernel = device.attention_kernel(cost.attention)
        if kernel is not None:
            return kernel.backward if backward else kernel.forward
    if cost.gemm is None:
        return device.matmul_efficiency
    batch, m, n, k = local_shape(cost.gemm, divisor)
    if not backward:
        return device.matmul_efficiency_at(dtype, (batch, m, n, k))
    dx = device.matmul_efficiency_at(dtype, (batch, m, k, n))
    if not cost.weight_gradient:
        return dx
    dw = device.matmul_efficiency_at(dtype, (batch, k, n, m))
    return 2.0 / (1.0 / dx + 1.0 / dw)


class ComputeEstimator(Protocol):
    """Time of one node's forward or backward on one device, its work split `divisor` ways."""

    def forward_time_s(self, node: fx.Node, divisor: float) -> float: ...

    def backward_time_s(self, node: fx.Node, divisor: float) -> float: ...


_TORCH_FORMATS = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}


class AnalyticEstimator:
    """The roofline estimator: a pure function of the node's shapes and the DeviceSpec.

    Matmuls are priced in the format their tensors are in: a bf16 graph runs bf16 math, an
    fp32 graph fp32 math (nothing autocasts it). `dtype` decides how fp32 matmuls run (FP32,
    or TF32 when it is TF32) and stands in for nodes with no floating tensor.
    """

    def __init__(self, device: DeviceSpec, dtype: DType | str):
        self.device = device
        self.dtype = DType.coerce(dtype)
        self._costs: dict[fx.Node, OpCost] = {}

    def cost(self, node: fx.Node) -> OpCost:
        found = self._costs.get(node)
        if found is None:
            found = self._costs[node] = estimate_node_cost(node)
        return found

    def matmul_dtype(self, node: fx.Node) -> DType:
        floats = [t.dtype for t in tensors_of(node) if t.dtype in _TORCH_FORMATS]
        if not floats:
            return self.dtype
        fmt = _TORCH_FORMATS[floats[0]]
        return DType.TF32 if fmt == DType.FP32 and self.dtype == DType.TF32 else fmt

    def forward_time_s(self, node: fx.Node, divisor: float) -> float:
        return estimate_compute_time(self.cost(node), self.device, self.matmul_dtype(node), divisor=divisor)

    def backward_time_s(self, node: fx.Node, divisor: float) -> float:
        cost = self.cost(node)
        return estimate_compute_time(cost, self.device, self.matmul_dtype(node), divisor=divisor, backward=True)

    def input_gradient_time_s(self, node: fx.Node, divisor: float) -> float:
        """The backward of a matrix product whose weight is frozen: dX only (`input_gradient_only`)."""
        cost = input_gradient_only(self.cost(node))
        return estimate_compute_time(cost, self.device, self.matmul_dtype(node), divisor=divisor, backward=True)

    def optimizer_step_time_s(self, num_tensors: int, num_param_bytes: float) -> float:
        """Seconds of one AdamW step over `num_tensors` local parameter tensors of `num_param_bytes` in all."""
        return estimate_adamw_step_time(num_tensors, num_param_bytes, self.device)


__all__ = [
    "ADAMW_BYTES_PER_PARAM_BYTE",
    "ADAMW_KERNELS_PER_TENSOR",
    "FOREACH_TENSORS_PER_LAUNCH",
    "FREE",
    "SDPA_KERNEL",
    "TRITON_KERNEL",
    "UNKNOWN_OPS",
    "AnalyticEstimator",
    "ComputeEstimator",
    "OpCost",
    "estimate_adamw_step_time",
    "estimate_compute_time",
    "estimate_node_cost",
    "estimate_optimizer_step_time",
    "gemm_shape",
    "input_gradient_only",
    "matmul_cost",
    "node_arg",
    "norm_cost",
    "optimizer_step_time_s",
    "register_op_cost",
    "tensors_of",
    "total_bytes",
    "total_numel",
]

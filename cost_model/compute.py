"""Compute cost per ATen op: FLOPs and bytes from the fx node's shapes, and roofline time.

`estimate_node_cost(node)` reads `node.meta["val"]` of the node and of its tensor arguments and
returns forward and backward FLOPs and bytes. Per-op knowledge lives in one registry, filled by
`@register_op_cost(*targets)`; views and metadata ops are free; an op without an entry is priced
like an elementwise op (one FLOP per output element, its inputs and outputs moved once) and
recorded in `UNKNOWN_OPS` so reports can list it.

`estimate_compute_time` is a roofline: the larger of FLOPs over the achievable matrix (or
vector) rate and bytes over the achievable memory bandwidth, plus a fixed launch overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.cost_model.devices import DeviceSpec, DType

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class OpCost:
    """FLOPs and bytes of one op (forward, and its backward)."""

    flops: float
    bytes_accessed: float
    backward_flops: float
    backward_bytes: float
    is_matmul: bool = False
    is_view: bool = False


FREE = OpCost(0.0, 0.0, 0.0, 0.0, is_view=True)
_REGISTRY: dict[object, Callable[[fx.Node], OpCost]] = {}
UNKNOWN_OPS: set[str] = set()


def register_op_cost(*targets):
    """Register `fn(node) -> OpCost` for the given ATen targets."""

    def wrap(fn):
        for t in targets:
            _REGISTRY[t] = fn
        return fn

    return wrap


def _vals(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def _tensor_args(node: fx.Node) -> list[torch.Tensor]:
    out = []
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            out += _vals(a)
    return out


def _nbytes(ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def _numel(ts) -> float:
    return float(sum(t.numel() for t in ts))


def estimate_node_cost(node: fx.Node) -> OpCost:
    """Forward and backward FLOPs and bytes of one fx node."""
    if node.op != "call_function":
        return FREE
    fn = _REGISTRY.get(node.target)
    if fn is None:
        UNKNOWN_OPS.add(str(node.target))
        return _elementwise(node)
    return fn(node)


def _elementwise(node: fx.Node, flops_per_element: float = 1.0) -> OpCost:
    ins, outs = _tensor_args(node), _vals(node)
    flops = flops_per_element * _numel(outs)
    moved = _nbytes(ins) + _nbytes(outs)
    # backward: read the output gradient (and inputs it needs), write one gradient per input
    return OpCost(flops, moved, flops, moved + _nbytes(ins) - _nbytes(outs) + _nbytes(outs))


_VIEWS = [
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.alias.default, aten.t.default,
    aten.detach.default, aten._assert_tensor_metadata.default, aten.narrow.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.lift_fresh_copy.default, aten.to.device,
]  # fmt: skip
try:
    import operator

    _VIEWS.append(operator.getitem)
except ImportError:  # pragma: no cover
    pass


@register_op_cost(*_VIEWS)
def _free(node):
    return FREE


@register_op_cost(aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.contiguous.default,
                  aten.clone.default, aten.type_as.default)  # fmt: skip
def _copy(node):
    ins, outs = _tensor_args(node), _vals(node)
    if ins and outs and ins[0].dtype == outs[0].dtype and node.target != aten.clone.default:
        if node.target != aten.contiguous.default or ins[0].is_contiguous():
            return FREE
    moved = _nbytes(ins[:1]) + _nbytes(outs)
    return OpCost(0.0, moved, 0.0, moved)


def _matmul_cost(m: float, n: float, k: float, ins, outs) -> OpCost:
    flops = 2.0 * m * n * k
    moved = _nbytes(ins) + _nbytes(outs)
    # backward: dX = dY W^T and dW = X^T dY, each as large as the forward product
    return OpCost(flops, moved, 2 * flops, 2 * moved, is_matmul=True)


@register_op_cost(aten.linear.default)
def _linear(node):
    ins, outs = _tensor_args(node), _vals(node)
    x, w = ins[0], ins[1]
    m = x.numel() / x.shape[-1]
    return _matmul_cost(m, w.shape[0], w.shape[1], ins, outs)


@register_op_cost(aten.addmm.default)
def _addmm(node):
    ins, outs = _tensor_args(node), _vals(node)
    x, w = ins[1], ins[2]
    return _matmul_cost(x.shape[0], w.shape[1], x.shape[1], ins, outs)


@register_op_cost(aten.mm.default)
def _mm(node):
    ins, outs = _tensor_args(node), _vals(node)
    a, b = ins[0], ins[1]
    return _matmul_cost(a.shape[0], b.shape[1], a.shape[1], ins, outs)


@register_op_cost(aten.bmm.default, aten.matmul.default, aten.baddbmm.default)
def _bmm(node):
    ins, outs = _tensor_args(node), _vals(node)
    a, b = (ins[1], ins[2]) if node.target == aten.baddbmm.default else (ins[0], ins[1])
    out = outs[0]
    k = a.shape[-1]
    batch_rows = out.numel() / out.shape[-1]
    return _matmul_cost(batch_rows, out.shape[-1], k, ins, outs) if b.ndim else _elementwise(node)


@register_op_cost(aten.scaled_dot_product_attention.default)
def _sdpa(node):
    ins, outs = _tensor_args(node), _vals(node)
    q, k = ins[0], ins[1]
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    causal = bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
    flops = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    # a fused kernel never writes the sq x sk scores: q, k, v (and the mask) in, the output out
    moved = _nbytes(ins) + _nbytes(outs)
    return OpCost(flops, moved, 2.5 * flops, 2.5 * moved, is_matmul=True)


@register_op_cost(aten.embedding.default)
def _embedding(node):
    outs = _vals(node)
    moved = 2 * _nbytes(outs)  # gather rows: read them, write them
    return OpCost(0.0, moved, _numel(outs), 2 * moved)


@register_op_cost(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def _norm(node):
    return _elementwise(node, flops_per_element=8.0)


@register_op_cost(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def _softmax(node):
    return _elementwise(node, flops_per_element=5.0)


@register_op_cost(aten.cross_entropy_loss.default, aten.nll_loss_forward.default)
def _cross_entropy(node):
    ins = _tensor_args(node)
    logits = ins[0]
    n = float(logits.numel())
    moved = _nbytes(ins[:1])
    # log-softmax over the logits, then a gather; backward writes a gradient as large as the logits
    return OpCost(5 * n, 2 * moved, 3 * n, 2 * moved)


@register_op_cost(aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.exp.default,
                  aten.rsqrt.default, aten.cos.default, aten.sin.default, aten.pow.Tensor_Scalar)  # fmt: skip
def _transcendental(node):
    return _elementwise(node, flops_per_element=4.0)


@register_op_cost(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.cumsum.default, aten.sum.default,
                  aten.mean.default)  # fmt: skip
def _reduction(node):
    ins, outs = _tensor_args(node), _vals(node)
    return OpCost(_numel(ins), _nbytes(ins) + _nbytes(outs), _numel(ins), _nbytes(ins) + _nbytes(outs))


@register_op_cost(aten.arange.default, aten.arange.start, aten.full.default, aten.zeros.default, aten.ones.default,
                  aten.new_ones.default, aten.new_zeros.default, aten.empty.memory_format, aten.scalar_tensor.default)  # fmt: skip
def _factory(node):
    outs = _vals(node)
    return OpCost(0.0, _nbytes(outs), 0.0, 0.0)


class ComputeEstimator(Protocol):
    """Time of one node's forward and backward on one device, its work split `divisor` ways."""

    def forward_time_s(self, node: fx.Node, divisor: float) -> float: ...

    def backward_time_s(self, node: fx.Node, divisor: float) -> float: ...


def estimate_compute_time(cost: OpCost, device: DeviceSpec, dtype: DType, *, divisor: float = 1.0,
                          backward: bool = False) -> float:  # fmt: skip
    """Roofline time of `cost` on `device`: max(FLOPs / achievable rate, bytes / achievable bandwidth) + launch."""
    if cost.is_view:
        return 0.0
    flops = (cost.backward_flops if backward else cost.flops) / divisor
    moved = (cost.backward_bytes if backward else cost.bytes_accessed) / divisor
    if flops == 0 and moved == 0:
        return 0.0
    if cost.is_matmul:
        rate = device.peak_matmul_flops(dtype) * device.matmul_efficiency
    else:
        rate = device.vector_flops_per_s * device.matmul_efficiency
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    return max(flops / rate, moved / bandwidth) + device.kernel_overhead_s


class AnalyticEstimator:
    """The roofline estimator: pure function of the node's shapes and the DeviceSpec."""

    def __init__(self, device: DeviceSpec, dtype: DType | str):
        self.device = device
        self.dtype = DType.coerce(dtype)
        self._cache: dict[str, OpCost] = {}

    def _cost(self, node: fx.Node) -> OpCost:
        key = node.name
        if key not in self._cache:
            self._cache[key] = estimate_node_cost(node)
        return self._cache[key]

    def _dtype(self, node: fx.Node) -> DType:
        vals = _vals(node)
        if vals and vals[0].dtype in (torch.float32, torch.bfloat16, torch.float16):
            # the graph's own dtype, where it is a float: a fp32 model runs fp32 math
            return DType.from_torch(vals[0].dtype) if self.dtype != DType.TF32 else self.dtype
        return self.dtype

    def forward_time_s(self, node: fx.Node, divisor: float) -> float:
        return estimate_compute_time(self._cost(node), self.device, self._dtype(node), divisor=divisor)

    def backward_time_s(self, node: fx.Node, divisor: float) -> float:
        return estimate_compute_time(self._cost(node), self.device, self._dtype(node), divisor=divisor, backward=True)

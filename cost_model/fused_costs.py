"""Costs of autopar's fused Triton ops, registered by name so that pricing never imports Triton.

`autopar.triton_kernels` defines these ops; the cost model must not import it. The conventions are
`cost_model.compute`'s (whose registry this module fills; `autopar.cost_model` imports it):
attention as the unfused op, a norm as one read/write pass plus its row statistics, the loss as
the head's GEMMs and softmax without the tokens x vocab logits (see each entry).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from autopar.cost_model.compute import (
    TRITON_KERNEL,
    OpCost,
    node_arg,
    norm_cost,
    register_op_cost,
    tensors_of,
    total_bytes,
    total_numel,
)


@register_op_cost("autopar::flash_attention")
def _flash_attention(node: fx.Node) -> OpCost:
    """q [b, h, sq, d], k and v [b, hk, sk, d]: 4·b·h·sq·sk·d forward (QKᵀ and PV), halved when causal; 2.5x backward.

    Bytes never include the sq x sk scores: the forward reads q, k, v and writes O and the fp32
    log-sum-exp per row; the backward reads q, k, v, O, dO and the LSE, writes dq, dk, dv, and
    writes then reads delta = rowsum(dO·O), one LSE-sized array.
    """
    q, k, v = (node_arg(node, name) for name in ("q", "k", "v"))
    out, lse = tensors_of(node)[:2]
    sq, d, sk = q.shape[-2], q.shape[-1], k.shape[-2]
    flops = 4.0 * (q.numel() / (sq * d)) * sq * sk * d
    if node_arg(node, "causal", False):
        flops *= 0.5
    qkv, o, stats = total_bytes([q, k, v]), total_bytes([out]), total_bytes([lse])
    return OpCost(
        flops, qkv + o + stats, 2.5 * flops, 2 * qkv + 2 * o + 3 * stats, is_matmul=True, attention=TRITON_KERNEL
    )


def _with_row_stats(cost: OpCost, stats: list[torch.Tensor]) -> OpCost:
    """A fused norm also writes its fp32 row statistics in the forward and reads them in the backward."""
    extra = total_bytes(stats)
    return replace(cost, bytes_accessed=cost.bytes_accessed + extra, backward_bytes=cost.backward_bytes + extra)


@register_op_cost("autopar::rms_norm")
def _fused_rms_norm(node: fx.Node) -> OpCost:
    """One pass over x: read x and the weight, write y and rstd; FLOPs as `aten.rms_norm` (4 per element)."""
    return _with_row_stats(norm_cost(node, 4.0), tensors_of(node)[1:])


@register_op_cost("autopar::layer_norm")
def _fused_layer_norm(node: fx.Node) -> OpCost:
    """One pass over x: read x, weight and bias, write y, mean and rstd; FLOPs as `aten.layer_norm` (5 per element)."""
    return _with_row_stats(norm_cost(node, 5.0), tensors_of(node)[1:])


@register_op_cost("autopar::linear_cross_entropy")
def _linear_cross_entropy(node: fx.Node) -> OpCost:
    """hidden [..., H] (N tokens), weight [V, H]: the LM head's GEMMs and the softmax, without the N x V logits.

    The kernel computes the gradients during its forward, so the forward holds all the work: the
    head GEMM 2·N·V·H and the softmax and loss 5·N·V, and, for each input whose gradient it was asked
    for, softmax - onehot (3·N·V, once) and one gradient GEMM of 2·N·V·H (dH = dZ·W, dW = dZᵀ·H).
    The backward only scales the saved gradients by the loss's gradient.

    Bytes: hidden, weight and labels read, the loss and the gradients written; none of the logits.
    (The chunked implementation passes each chunk's logits through memory and re-reads the weight
    per chunk; this prices the fused op, not those transients.)
    """
    hidden, weight, labels = (node_arg(node, name) for name in ("hidden", "weight", "labels"))
    grads = [g for g in tensors_of(node)[1:] if g.numel()]  # empty when a gradient was not asked for
    tokens, vocab = hidden.numel() / hidden.shape[-1], weight.shape[0]
    logits = tokens * vocab
    flops = 2.0 * logits * hidden.shape[-1] + 5.0 * logits
    if grads:
        flops += 3.0 * logits + len(grads) * 2.0 * logits * hidden.shape[-1]
    moved = total_bytes([hidden, weight, labels]) + total_bytes(tensors_of(node)[:1]) + total_bytes(grads)
    gemm = (1, max(int(tokens), 1), int(vocab), int(hidden.shape[-1]))
    return OpCost(flops, moved, total_numel(grads), 2 * total_bytes(grads), is_matmul=True, gemm=gemm)

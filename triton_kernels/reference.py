"""Pure-PyTorch references for the Triton kernels of this package.

Each function computes what its kernel computes, in the plain, memory-hungry way (the full score matrix, the
full logits), in whatever dtype it is given. Tests call them on float64 copies of the kernel's inputs; they are
also the fallback to read when a kernel's semantics are in doubt. Autograd differentiates them as usual.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "attention_reference",
    "layer_norm_reference",
    "linear_cross_entropy_reference",
    "rms_norm_reference",
]


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention with SDPA's semantics, plus the log-sum-exp of each row of scaled scores.

    Args:
        q: ``(batch, heads_q, seq_q, head_dim)``.
        k: ``(batch, heads_kv, seq_k, head_dim)``, ``heads_q % heads_kv == 0``; query head ``h`` uses key/value
            head ``h // (heads_q // heads_kv)``.
        v: same shape as ``k``.
        causal: top-left aligned causal mask, ``torch.ones(seq_q, seq_k).tril()``, as SDPA's ``is_causal``.
        scale: score multiplier; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        ``(out, lse)``: ``out`` like ``q``; ``lse`` ``(batch, heads_q, seq_q)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    # repeat_interleave maps query head h to key/value head h // group, the kernel's grouping.
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out, lse


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim."""
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * rstd * weight


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, with the biased variance."""
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps) * weight
    return y if bias is None else y + bias


def linear_cross_entropy_reference(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` over the tokens whose label is not ignored.

    Materialises the full ``tokens x vocab`` logits. When every label is ignored the mean is ``0 / 0 = nan``,
    as in ``F.cross_entropy``.
    """
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    token_loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, safe_labels[:, None]).squeeze(1)
    return torch.where(valid, token_loss, torch.zeros_like(token_loss)).sum() / valid.sum()

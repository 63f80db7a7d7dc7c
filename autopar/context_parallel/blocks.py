"""Attention between one block of queries and one block of keys, placed by global position, and its gradients.

Context-parallel attention cuts the sequence into segments (runs of consecutive global positions, see
`autopar.context_parallel.layout`) and computes attention one (query segment, key segment) pair at a time.
Under a causal mask a pair is one of:

* visible: every key precedes every query (or no mask): plain attention;
* hidden: every key follows every query: skipped, no work;
* diagonal: the same positions on both sides: SDPA's top-left causal mask;
* partial: any other overlap: an additive mask of that one pair, built from positions (never a mask of the
  whole sequence).

Each pair's forward returns its output and the log-sum-exp (LSE) of its scaled scores; `merge` combines
pairs over key blocks exactly (the online softmax). The backward of a pair takes the *merged* output and LSE
of the query rows, which is what makes the per-pair gradients sum to those of the whole attention
(FlashAttention's recomputation from the LSE). On CPU both directions run PyTorch's CPU flash-attention ops
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the LSE). On CUDA
they run autopar's Triton flash-attention kernel (`autopar.triton_kernels.flash_attention.attention_block_forward`
and its backward), which places the pair by its first query and key positions, so every visibility but hidden
is one call without a mask tensor; CPU runs never load it (without a GPU it would only run interpreted).
Elsewhere (other devices, dtypes or head dims the kernel does not take) the plain reference below runs,
materialising only the pair's scores. The merge is the same on every path.

Grouped-query attention: k and v may have fewer heads than q; query head h reads key/value head
h // (heads_q // heads_kv). A pair expands k and v to the query heads and sums their gradients back.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

from autopar.context_parallel.layout import Segment


class Visibility(Enum):
    VISIBLE = "visible"
    HIDDEN = "hidden"
    DIAGONAL = "diagonal"
    PARTIAL = "partial"


def visibility(q_seg: Segment, k_seg: Segment, causal: bool) -> Visibility:
    """How a causal mask by global position covers the pair (query segment, key segment)."""
    if not causal:
        return Visibility.VISIBLE
    (q_start, q_len), (k_start, k_len) = q_seg, k_seg
    if k_start + k_len - 1 <= q_start:
        return Visibility.VISIBLE
    if k_start > q_start + q_len - 1:
        return Visibility.HIDDEN
    if q_seg == k_seg:
        return Visibility.DIAGONAL
    return Visibility.PARTIAL


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # autopar.triton_kernels.flash_attention's
_KERNEL_MAX_HEAD_DIM = 128


def runs_on_kernel(q: Tensor) -> bool:
    """Whether pairs of `q` run on the Triton kernel: CUDA tensors of a dtype and head dim it takes."""
    return q.device.type == "cuda" and q.dtype in _KERNEL_DTYPES and q.shape[-1] <= _KERNEL_MAX_HEAD_DIM


def _kernel_offsets(q_seg: Segment, k_seg: Segment, vis: Visibility) -> dict:
    # a visible pair skips the mask altogether; diagonal and partial pairs mask by global position
    return {"causal": vis != Visibility.VISIBLE, "q_offset": q_seg[0], "k_offset": k_seg[0]}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs and gradients are summed in at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, q_seg: Segment, k_seg: Segment, causal: bool, scale: float
) -> tuple[Tensor, Tensor] | None:
    """``(out, lse)`` of queries `q` (at `q_seg`) against keys `k`, `v` (at `k_seg`); None when all are hidden.

    Shapes: q ``(batch, heads_q, q_len, head_dim)``, k and v ``(batch, heads_kv, k_len, head_dim)``; out like q,
    lse ``(batch, heads_q, q_len)``.
    """
    vis = visibility(q_seg, k_seg, causal)
    if vis == Visibility.HIDDEN:
        return None
    if runs_on_kernel(q):
        from autopar.triton_kernels.flash_attention import attention_block_forward

        return attention_block_forward(q, k, v, scale=scale, **_kernel_offsets(q_seg, k_seg, vis))
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    mask = _pair_mask(q_seg, k_seg, q) if vis == Visibility.PARTIAL else None
    is_causal = vis == Visibility.DIAGONAL
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        if vis == Visibility.PARTIAL:
            # the CPU op reports lse 0 (not -inf) for a row whose every key is masked, which would give that
            # row's zero output weight in the merge
            no_keys = torch.arange(q_seg[0], q_seg[0] + q_seg[1], device=q.device) < k_seg[0]
            lse = lse.masked_fill(no_keys, float("-inf"))
        return out, lse
    return reference_forward(q, k, v, is_causal, mask, scale)


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_seg: Segment,
    k_seg: Segment,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(dq, dk, dv)`` of the pair, given the merged `out` and `lse` of the query rows; None when all are hidden."""
    vis = visibility(q_seg, k_seg, causal)
    if vis == Visibility.HIDDEN:
        return None
    if runs_on_kernel(q):
        from autopar.triton_kernels.flash_attention import attention_block_backward

        return attention_block_backward(dout, q, k, v, out, lse, scale=scale, **_kernel_offsets(q_seg, k_seg, vis))
    heads_kv = k.shape[1]
    ke, ve = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    mask = _pair_mask(q_seg, k_seg, q) if vis == Visibility.PARTIAL else None
    is_causal = vis == Visibility.DIAGONAL
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    else:
        dq, dk, dv = reference_backward(dout, q, ke, ve, out, lse, is_causal, mask, scale)
    return dq, reduce_heads(dk, heads_kv), reduce_heads(dv, heads_kv)


def merge(a: tuple[Tensor, Tensor] | None, b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Combine two partial ``(out, lse)`` of the same query rows over disjoint keys (exact, the online softmax).

    The result's out is in the accumulation dtype. A row no key reached has lse -inf and contributes nothing.
    """
    out_b, lse_b = b[0].to(accumulation_dtype(b[0].dtype)), b[1].to(accumulation_dtype(b[0].dtype))
    if a is None:
        return out_b, lse_b
    out_a, lse_a = a
    lse = torch.logaddexp(lse_a, lse_b)
    # exp(-inf - -inf) is nan for rows neither side reached; such rows stay zero.
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def expand_heads(kv: Tensor, heads_q: int) -> Tensor:
    """Key/value heads repeated so that query head h meets key/value head h // (heads_q // heads_kv)."""
    group = heads_q // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def reduce_heads(grad: Tensor, heads_kv: int) -> Tensor:
    """The gradient of :func:`expand_heads`: sum over each key/value head's group of query heads."""
    if grad.shape[1] == heads_kv:
        return grad
    return grad.unflatten(1, (heads_kv, grad.shape[1] // heads_kv)).sum(dim=2)


def _pair_mask(q_seg: Segment, k_seg: Segment, like: Tensor) -> Tensor:
    """Additive mask of one pair: 0 where the key's position <= the query's, -inf elsewhere."""
    q_pos = torch.arange(q_seg[0], q_seg[0] + q_seg[1], device=like.device)
    k_pos = torch.arange(k_seg[0], k_seg[0] + k_seg[1], device=like.device)
    keep = k_pos[None, :] <= q_pos[:, None]
    return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill(~keep, float("-inf"))


def _scores(q: Tensor, k: Tensor, is_causal: bool, mask: Tensor | None, scale: float) -> Tensor:
    acc = accumulation_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask.to(acc)
    return scores


def reference_forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain attention of one pair with equal head counts: ``(out, lse)``; lse in the accumulation dtype."""
    scores = _scores(q, k, is_causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ v.to(probs.dtype)).to(q.dtype), lse


def reference_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one pair with equal head counts, recomputing probabilities from the merged `lse`."""
    scores = _scores(q, k, is_causal, mask, scale)
    acc = scores.dtype
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    dout, out = dout.to(acc), out.to(acc)
    dv = probs.transpose(-2, -1) @ dout
    dprobs = dout @ v.to(acc).transpose(-2, -1)
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = dscores @ k.to(acc)
    dk = dscores.transpose(-2, -1) @ q.to(acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

"""Flash attention (FlashAttention-2) forward and backward in Triton.

``flash_attention(q, k, v, causal=..., scale=...)`` computes ``softmax(scale * q @ k^T) @ v`` in the layout of
``torch.nn.functional.scaled_dot_product_attention``: ``(batch, heads, seq, head_dim)``. It never holds the
``seq_q x seq_k`` score matrix in memory:

* forward: one program per (query block, query head, batch) walks the key blocks with an online softmax and
  saves the per-row log-sum-exp (LSE) of the scaled scores;
* backward: a preprocess kernel computes ``delta = rowsum(dO * O)``; a dK/dV kernel owns one key block of one
  key/value head and walks the query blocks of every query head of its group (so grouped-query attention sums
  dK/dV over the group without atomics and without repeating K/V in memory); a dQ kernel owns one query block
  and walks the key blocks. Probabilities are recomputed from the saved LSE.

Semantics match SDPA exactly: ``scale`` defaults to ``1 / sqrt(head_dim)``; ``causal=True`` uses SDPA's
top-left aligned mask ``torch.ones(seq_q, seq_k).tril()``, i.e. query ``i`` attends to keys ``j <= i`` even when
``seq_q != seq_k``; k and v may have fewer heads than q (grouped-query or multi-query attention, SDPA's
``enable_gqa=True``): query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``. No dropout, no
arbitrary mask.

Inputs are fp16, bf16 or fp32 (fp32 matmuls run in IEEE fp32, not TF32); softmax statistics and all
accumulators are fp32. Head dims up to 128 are supported; the head-dim block is padded to a power of two with
masked loads, so 96 (or 80, 40, ...) costs the work of the next power of two.

The op is registered as ``autopar::flash_attention`` (returns ``(out, lse)``) with its backward
``autopar::flash_attention_backward``; ``torch.export``, meta tracing and ``torch.compile`` see each as one node.

Blocks placed by global position (context parallelism): ``attention_block_forward(q, k, v, causal=, scale=,
q_offset=, k_offset=)`` runs one block of queries against one block of keys whose first global positions are the
offsets, masking by position (query ``i`` sees key ``j`` when ``k_offset + j <= q_offset + i``), and returns
``(out, lse)``; a row that sees no key gets output 0 and LSE ``-inf``. ``attention_block_backward`` takes the
merged output and LSE of the query rows, so the blocks of a ring step or of a zig-zag half sum to the whole
attention's gradients. The kernels take the offsets as one runtime integer (``diag = q_offset - k_offset``; 0 is
the top-left causal mask), so no extra compilation per offset.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from autopar.errors import ConfigError

from .flash_attention_kernels import (
    INTERPRET,
    PREPROCESS_BLOCK_M,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
    attn_fwd_kernel,
)

__all__ = ["flash_attention", "attention_block_forward", "attention_block_backward", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise :class:`autopar.errors.ConfigError` (a ValueError) unless q, k, v fit the kernel."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ConfigError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ConfigError(
                f"flash_attention: {name} must be 4-D (batch, heads, seq, head_dim) as in SDPA, got shape "
                f"{tuple(t.shape)}; transpose (batch, seq, heads, head_dim) inputs with .transpose(1, 2)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ConfigError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"flash_attention: dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ConfigError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ConfigError(
            f"flash_attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch, heads_q, _, head_dim = q.shape
    batch_k, heads_kv, seq_k, head_dim_k = k.shape
    if batch_k != batch:
        raise ConfigError(f"flash_attention: q has batch {batch} but k and v have batch {batch_k}")
    if head_dim_k != head_dim:
        raise ConfigError(f"flash_attention: q has head_dim {head_dim} but k and v have head_dim {head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ConfigError(f"flash_attention: head_dim {head_dim} is not supported; it must be in 1..{MAX_HEAD_DIM}")
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv != 0:
        raise ConfigError(
            f"flash_attention: the {heads_q} heads of q must be a positive multiple of the {heads_kv} heads of k "
            "and v (grouped-query attention shares each key/value head among heads_q // heads_kv query heads)"
        )
    if seq_k < 1:
        raise ConfigError("flash_attention: k and v have sequence length 0; attention over no keys is undefined")


def _check_runnable(t: Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRET:
        raise ConfigError(
            f"Triton kernels run on CUDA tensors; got a tensor on {t.device}. On a machine without a GPU set "
            "TRITON_INTERPRET=1 before importing autopar.triton_kernels to run them in the Triton interpreter."
        )


def _last_dim_contiguous(t: Tensor) -> Tensor:
    # The kernels address the head dim with unit stride; every other stride is passed through.
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get IEEE fp32 products so fp32 means fp32; 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _head_dim_pad(head_dim: int) -> int:
    # tl.dot needs every block dim to be a power of two and at least 16.
    return max(16, triton.next_power_of_2(head_dim))


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, diag: int = 0) -> tuple[Tensor, Tensor]:
    _check_runnable(q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), heads_q, batch)

    attn_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        heads_q,
        heads_q // heads_kv,
        seq_q,
        seq_k,
        scale * _LOG2E,
        diag,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_head_dim_pad(head_dim),
        IS_CAUSAL=causal,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out, lse


def _backward(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    diag: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_runnable(q)
    q, k, v, out, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, out, grad_out))
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    dlse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim))
    attn_bwd_preprocess_kernel[(triton.cdiv(seq_q, PREPROCESS_BLOCK_M), heads_q, batch)](
        out,
        grad_out,
        dlse if dlse is not None else delta,
        delta,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        heads_q,
        seq_q,
        HAS_DLSE=dlse is not None,
        BLOCK_M=PREPROCESS_BLOCK_M,
        **common,
    )
    common.update(IS_CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    qkv_strides += (v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    sizes = (heads_q, heads_q // heads_kv, seq_q, seq_k, scale * _LOG2E, scale, diag)

    def dkdv_grid(meta):
        return (triton.cdiv(seq_k, meta["BLOCK_N"]), heads_kv, batch)

    attn_bwd_dkdv_kernel[dkdv_grid](
        q, k, v, grad_out, lse, delta, dk, dv, *qkv_strides, dk.stride(0), dk.stride(1), dk.stride(2), *sizes, **common
    )

    def dq_grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), heads_q, batch)

    attn_bwd_dq_kernel[dq_grid](
        q, k, v, grad_out, lse, delta, dq, *qkv_strides, dq.stride(0), dq.stride(1), dq.stride(2), *sizes, **common
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("autopar::flash_attention", mutates_args=())
def _flash_attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention output ``(batch, heads_q, seq_q, head_dim)`` and fp32 LSE ``(batch, heads_q, seq_q)``."""
    _check_inputs(q, k, v)
    return _forward(q, k, v, causal, scale)


@_flash_attention_op.register_fake
def _flash_attention_fake(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    _check_inputs(q, k, v)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("autopar::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention, recomputed from the saved output and LSE."""
    return _backward(grad_out, grad_lse, q, k, v, out, lse, causal, scale)


@_flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.scale = scale


def _flash_attention_autograd(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _flash_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_flash_attention_op.register_autograd(_flash_attention_autograd, setup_context=_setup_context)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None) -> Tensor:
    """Scaled dot-product attention with SDPA's semantics, as one fused Triton kernel per direction.

    Args:
        q: queries, ``(batch, heads_q, seq_q, head_dim)``, fp16, bf16 or fp32, on a CUDA device (or any device
            under ``TRITON_INTERPRET=1``).
        k: keys, ``(batch, heads_kv, seq_k, head_dim)``; ``heads_q`` must be a multiple of ``heads_kv``
            (``heads_kv == heads_q`` is ordinary multi-head attention, ``heads_kv == 1`` multi-query attention).
        v: values, same shape as ``k``.
        causal: apply SDPA's ``is_causal`` mask, aligned to the top-left corner: query ``i`` sees keys
            ``0..i`` whatever ``seq_q`` and ``seq_k`` are (the same as ``torch.ones(seq_q, seq_k).tril()``).
        scale: multiplier of ``q @ k^T`` before the softmax; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        ``(batch, heads_q, seq_q, head_dim)`` in the dtype of ``q``; differentiable in ``q``, ``k`` and ``v``.

    Raises:
        autopar.errors.ConfigError: (a ``ValueError``) for shapes, dtypes or devices the kernel does not take.
    """
    _check_inputs(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _flash_attention_op(q, k, v, bool(causal), float(scale))[0]


# ----------------------------------------------------------------------------------------------------------------
# Blocks placed by global position (context parallelism)
# ----------------------------------------------------------------------------------------------------------------


def attention_block_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, q_offset: int = 0, k_offset: int = 0
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block of queries against one block of keys, each placed by its global positions.

    A ring step or a zig-zag half holds a run of consecutive positions on each side: queries from `q_offset`,
    keys from `k_offset`. Under `causal`, query ``i`` sees key ``j`` when ``k_offset + j <= q_offset + i``, so
    one call serves a diagonal block (equal offsets), a block wholly before the queries (every key visible; pass
    ``causal=False`` to skip the mask's cost) and any partial overlap. A row that sees no key gets output 0 and
    LSE ``-inf``, which a log-sum-exp merge gives no weight.

    Args:
        q, k, v: as in :func:`flash_attention` (``(batch, heads, seq, head_dim)``, grouped-query heads allowed).
        causal: mask by global position as above; False: every key is visible.
        scale: multiplier of ``q @ k^T``.
        q_offset, k_offset: global position of the first query and of the first key.

    Returns:
        ``out`` in q's dtype and ``lse`` (fp32, ``(batch, heads_q, seq_q)``, natural log) of the scaled scores.
        Not differentiable: a caller merging blocks runs :func:`attention_block_backward` itself.
    """
    _check_inputs(q, k, v)
    return _forward(q, k, v, bool(causal), float(scale), int(q_offset) - int(k_offset))


def attention_block_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block (the mask of :func:`attention_block_forward`), given `out` and `lse`.

    Pass the *merged* output and LSE of the query rows over every key block: then each block's gradients are its
    share of the whole attention's, and summing them over the key blocks gives the exact gradients
    (FlashAttention's recomputation of the probabilities from the LSE). dk and dv have k's heads (grouped-query
    heads are summed in the kernel).
    """
    _check_inputs(q, k, v)
    lse = lse.to(torch.float32)
    return _backward(
        grad_out.to(q.dtype), None, q, k, v, out, lse, bool(causal), float(scale), int(q_offset) - int(k_offset)
    )

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
import triton.language as tl
from torch import Tensor

from autopar.errors import ConfigError

from . import kernels_interpreted

__all__ = ["flash_attention", "attention_block_forward", "attention_block_backward", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = 1.4426950408889634
# Triton picks the interpreter when a kernel is decorated, so this must run before the kernels below are defined.
_INTERPRET = kernels_interpreted()


def _configs(
    gpu_16bit: list[tuple[int, int, int, int]], gpu_fp32: list[tuple[int, int, int, int]], interpret: tuple[int, int]
) -> tuple[list[triton.Config], dict]:
    """Autotune configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` and the pruning that picks them by dtype.

    fp32 tiles are twice the bytes and IEEE fp32 products do not run on tensor cores, so fp32 gets its own small
    blocks. The interpreter gets one small fixed config: it runs programs one after another in numpy, so tuning
    would only cost time; its blocks are small and unequal (BLOCK_M != BLOCK_N) so that the tests exercise the
    block-edge and causal-diagonal logic the GPU configs rely on.
    """
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": interpret[0], "BLOCK_N": interpret[1]}, num_warps=1, num_stages=1)], {}
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu_16bit]
    fp32 = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu_fp32]
    fp32_ids = {id(c) for c in fp32}

    def prune(configs, named_args, **kwargs):
        want_fp32 = named_args["q_ptr"].dtype == torch.float32
        return [c for c in configs if (id(c) in fp32_ids) == want_fp32] or configs

    return configs + fp32, {"early_config_prune": prune}


# GPU configs were chosen by compiling for sm_90 and keeping those that fit in registers at head dim 128 (or spill
# least); the autotuner picks among them per shape.
_FWD_CONFIGS, _FWD_PRUNE = _configs(
    [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)], [(32, 32, 4, 2), (32, 16, 4, 2)], (32, 16)
)
# dK/dV keeps a key block resident and streams query blocks: short query blocks.
_DKDV_CONFIGS, _DKDV_PRUNE = _configs(
    [(32, 64, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3)], [(16, 32, 4, 2), (16, 16, 4, 2)], (16, 32)
)
# dQ keeps a query block resident and streams key blocks: the mirror image.
_DQ_CONFIGS, _DQ_PRUNE = _configs(
    [(64, 64, 8, 3), (64, 32, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)], [(32, 32, 4, 2), (32, 16, 4, 2)], (32, 16)
)
_PREPROCESS_BLOCK_M = 16 if _INTERPRET else 128
_TUNE_KEY = ["seq_q", "seq_k", "HEAD_DIM", "IS_CAUSAL"]
# The interpreter multiplies bf16 tiles as their raw int16 bit patterns (numpy has no bf16), so there bf16 operands
# are widened to fp32 first: exact, and the products of bf16 values are exact in fp32 as on tensor cores.
_WIDEN_BF16_DOT = tl.constexpr(_INTERPRET)


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32."""
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    lo,
    hi,
    seq_k,
    qk_scale_log2,
    diag,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of one query block over key blocks ``[lo, hi)``.

    Only blocks that straddle the causal diagonal or the end of the keys pay for the score mask (``MASKED``);
    the bulk of the blocks below the diagonal skip it. Causal: query row ``i`` sees key ``j`` when
    ``j <= i + diag`` (``diag`` is the query block's first global position minus the key block's).
    """
    d_mask = offs_d[None, :] < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_k) & d_mask
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        # Scores in the log2 domain, so the exponentials below are exp2 (one instruction on the GPU).
        s = _mma(q, tl.trans(k), DOT_PRECISION) * qk_scale_log2
        if MASKED:
            keep = offs_n[None, :] < seq_k
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASKED:
            # A row that has seen no key yet (diag < 0 puts keys after it) keeps m = -inf; subtracting 0 instead
            # of -inf leaves its alpha and p at exp2(-inf) = 0 rather than nan. (m itself stays -inf, so the row's
            # first real scores set it.) Unmasked blocks give every row a finite score.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by=_FWD_PRUNE)
@triton.jit
def _attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads_q,
    group_size,
    seq_q,
    seq_k,
    qk_scale_log2,
    diag,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_base = q_ptr + batch * stride_qb + head.to(tl.int64) * stride_qh
    k_base = k_ptr + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    row_mask = offs_m[:, None] < seq_q
    io_mask = row_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=io_mask, other=0.0)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # Key blocks in [0, hi_full) need no mask: they end before seq_k and, if causal, at or before the first row's
    # last visible key (start_m + diag).
    if IS_CAUSAL:
        hi_full = (tl.maximum(tl.minimum(seq_k, start_m + diag + 1), 0) // BLOCK_N) * BLOCK_N
        hi = tl.maximum(tl.minimum(seq_k, start_m + BLOCK_M + diag), 0)
    else:
        hi_full = (seq_k // BLOCK_N) * BLOCK_N
        hi = seq_k
    acc, l_i, m_i = _attn_fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        0,
        hi_full,
        seq_k,
        qk_scale_log2,
        diag,
        False,
        IS_CAUSAL,
        HEAD_DIM,
        BLOCK_N,
        DOT_PRECISION,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        hi_full,
        hi,
        seq_k,
        qk_scale_log2,
        diag,
        True,
        IS_CAUSAL,
        HEAD_DIM,
        BLOCK_N,
        DOT_PRECISION,
    )

    # A row that saw no key (causal with diag < 0) has l = 0: its output is 0 and its LSE -inf, so that a merge
    # over key blocks gives it no weight.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_base = o_ptr + batch * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=io_mask)
    # The LSE is saved in natural-log units (what torch.logsumexp of the scaled scores gives).
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    lse_base = lse_ptr + (batch * num_heads_q + head) * seq_q
    tl.store(lse_base + offs_m, lse, mask=offs_m < seq_q)


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr,
    do_ptr,
    dlse_ptr,
    delta_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    num_heads_q,
    seq_q,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta = rowsum(dO * O) - dLSE``: the row term of the softmax backward, shared by the dK/dV and dQ kernels.

    A gradient flowing into the LSE output adds ``p * dLSE`` to dS, which is the same as lowering delta by dLSE.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    o_base = o_ptr + batch * stride_ob + head.to(tl.int64) * stride_oh
    do_base = do_ptr + batch * stride_dob + head.to(tl.int64) * stride_doh
    o = tl.load(o_base + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row_base = (batch * num_heads_q + head) * seq_q
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
    tl.store(delta_ptr + row_base + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qm,
    stride_dom,
    offs_n,
    offs_d,
    lo,
    hi,
    seq_q,
    qk_scale_log2,
    diag,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one key block's dK (unscaled) and dV over query blocks ``[lo, hi)`` of one query head.

    Works on transposed tiles (keys on the row axis) so the key block stays the resident operand. Query rows past
    seq_q load q = dO = lse = delta = 0 and so contribute exactly zero; only the causal mask needs a ``where``.
    """
    d_mask = offs_d[None, :] < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_valid = offs_m < seq_q
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_valid[:, None] & d_mask, other=0.0)
        do = tl.load(
            do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=m_valid[:, None] & d_mask, other=0.0
        )
        lse_log2 = tl.load(lse_base + offs_m, mask=m_valid, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=m_valid, other=0.0)
        s_t = _mma(k, tl.trans(q), DOT_PRECISION) * qk_scale_log2
        p_t = tl.exp2(s_t - lse_log2[None, :])
        if MASKED:
            # Masked scores can exceed the LSE (it excludes them), so p_t may be inf there; where() drops it.
            p_t = tl.where(offs_m[None, :] + diag >= offs_n[:, None], p_t, 0.0)
        dv += _mma(p_t.to(do.dtype), do, DOT_PRECISION)
        dp_t = _mma(v, tl.trans(do), DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _mma(ds_t.to(q.dtype), q, DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY, prune_configs_by=_DKDV_PRUNE)
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    num_heads_q,
    group_size,
    seq_q,
    seq_k,
    qk_scale_log2,
    sm_scale,
    diag,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
    k_base = k_ptr + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    # Causal: query rows below start_n - diag never see this block; query blocks in [lo, mid) start before the
    # row that sees the block's last key, straddle the diagonal and need the mask; blocks in [mid, seq_q) see every
    # key of the block. (When seq_q < lo both ranges are empty, since mid = seq_q then.)
    if IS_CAUSAL:
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(((tl.maximum(start_n + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, seq_q)
    else:
        lo = 0
        mid = 0
    for g in range(0, group_size):
        head = (kv_head * group_size + g).to(tl.int64)
        q_base = q_ptr + batch * stride_qb + head * stride_qh
        do_base = do_ptr + batch * stride_dob + head * stride_doh
        row_base = (batch * num_heads_q + head) * seq_q
        dk, dv = _attn_bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_ptr + row_base,
            delta_ptr + row_base,
            stride_qm,
            stride_dom,
            offs_n,
            offs_d,
            lo,
            mid,
            seq_q,
            qk_scale_log2,
            diag,
            True,
            HEAD_DIM,
            BLOCK_M,
            DOT_PRECISION,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_ptr + row_base,
            delta_ptr + row_base,
            stride_qm,
            stride_dom,
            offs_n,
            offs_d,
            mid,
            seq_q,
            seq_q,
            qk_scale_log2,
            diag,
            False,
            HEAD_DIM,
            BLOCK_M,
            DOT_PRECISION,
        )
    dk *= sm_scale
    dk_offs = batch * stride_dkb + kv_head.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    tl.store(dk_ptr + dk_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    # dV shares dK's (contiguous) layout.
    tl.store(dv_ptr + dk_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    q,
    do,
    lse_log2,
    delta,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    lo,
    hi,
    seq_k,
    qk_scale_log2,
    diag,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query block's dQ (unscaled) over key blocks ``[lo, hi)``; the masks mirror the forward."""
    d_mask = offs_d[None, :] < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_k) & d_mask
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _mma(q, tl.trans(k), DOT_PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse_log2[:, None])
        if MASKED:
            keep = offs_n[None, :] < seq_k
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag)
            p = tl.where(keep, p, 0.0)
        dp = _mma(do, tl.trans(v), DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _mma(ds.to(k.dtype), k, DOT_PRECISION)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by=_DQ_PRUNE)
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    num_heads_q,
    group_size,
    seq_q,
    seq_k,
    qk_scale_log2,
    sm_scale,
    diag,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_valid = offs_m < seq_q
    io_mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_base = q_ptr + batch * stride_qb + head.to(tl.int64) * stride_qh
    do_base = do_ptr + batch * stride_dob + head.to(tl.int64) * stride_doh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=io_mask, other=0.0)
    row_base = (batch * num_heads_q + head) * seq_q
    lse_log2 = tl.load(lse_ptr + row_base + offs_m, mask=m_valid, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=m_valid, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if IS_CAUSAL:
        hi_full = (tl.maximum(tl.minimum(seq_k, start_m + diag + 1), 0) // BLOCK_N) * BLOCK_N
        hi = tl.maximum(tl.minimum(seq_k, start_m + BLOCK_M + diag), 0)
    else:
        hi_full = (seq_k // BLOCK_N) * BLOCK_N
        hi = seq_k
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        0,
        hi_full,
        seq_k,
        qk_scale_log2,
        diag,
        False,
        IS_CAUSAL,
        HEAD_DIM,
        BLOCK_N,
        DOT_PRECISION,
    )
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        hi_full,
        hi,
        seq_k,
        qk_scale_log2,
        diag,
        True,
        IS_CAUSAL,
        HEAD_DIM,
        BLOCK_N,
        DOT_PRECISION,
    )
    dq *= sm_scale
    dq_base = dq_ptr + batch * stride_dqb + head.to(tl.int64) * stride_dqh
    tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=io_mask)


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
    if t.device.type != "cuda" and not _INTERPRET:
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

    _attn_fwd_kernel[grid](
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
    _attn_bwd_preprocess_kernel[(triton.cdiv(seq_q, _PREPROCESS_BLOCK_M), heads_q, batch)](
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
        BLOCK_M=_PREPROCESS_BLOCK_M,
        **common,
    )
    common.update(IS_CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    qkv_strides += (v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    sizes = (heads_q, heads_q // heads_kv, seq_q, seq_k, scale * _LOG2E, scale, diag)

    def dkdv_grid(meta):
        return (triton.cdiv(seq_k, meta["BLOCK_N"]), heads_kv, batch)

    _attn_bwd_dkdv_kernel[dkdv_grid](
        q, k, v, grad_out, lse, delta, dk, dv, *qkv_strides, dk.stride(0), dk.stride(1), dk.stride(2), *sizes, **common
    )

    def dq_grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), heads_q, batch)

    _attn_bwd_dq_kernel[dq_grid](
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

"""The Triton kernels of flash attention: the autotune configs, the forward kernel, and the backward's
preprocess, dK/dV and dQ kernels. `flash_attention.py` checks inputs, launches these and registers the ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kernels_interpreted

# Triton picks the interpreter when a kernel is decorated, so this must run before the kernels below are defined.
INTERPRET = kernels_interpreted()


def _configs(
    gpu_16bit: list[tuple[int, int, int, int]], gpu_fp32: list[tuple[int, int, int, int]], interpret: tuple[int, int]
) -> tuple[list[triton.Config], dict]:
    """Autotune configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` and the pruning that picks them by dtype.

    fp32 tiles are twice the bytes and IEEE fp32 products do not run on tensor cores, so fp32 gets its own small
    blocks. The interpreter gets one small fixed config: it runs programs one after another in numpy, so tuning
    would only cost time; its blocks are small and unequal (BLOCK_M != BLOCK_N) so that the tests exercise the
    block-edge and causal-diagonal logic the GPU configs rely on.
    """
    if INTERPRET:
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
PREPROCESS_BLOCK_M = 16 if INTERPRET else 128
_TUNE_KEY = ["seq_q", "seq_k", "HEAD_DIM", "IS_CAUSAL"]
# The interpreter multiplies bf16 tiles as their raw int16 bit patterns (numpy has no bf16), so there bf16 operands
# are widened to fp32 first: exact, and the products of bf16 values are exact in fp32 as on tensor cores.
_WIDEN_BF16_DOT = tl.constexpr(INTERPRET)


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
def attn_fwd_kernel(
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
def attn_bwd_preprocess_kernel(
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
def attn_bwd_dkdv_kernel(
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
def attn_bwd_dq_kernel(
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

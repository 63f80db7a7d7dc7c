"""Fused RMSNorm and LayerNorm over the last dim, forward and backward, in Triton.

Each row of ``n_cols`` elements is one block of ``next_power_of_2(n_cols)`` lanes (masked past the end), so a
row is read once, normalised in fp32 registers and written once. The forward saves the per-row statistics
(``rstd``, and ``mean`` for LayerNorm) in fp32; the backward reads them instead of recomputing the reductions.
Weight and bias gradients are sums over rows: each backward program walks a contiguous run of rows, keeps its
partial sums in fp32 registers and writes one partial row; a ``sum(0)`` over the partials finishes them, so no
atomics and a deterministic result.

Rows up to ``MAX_COLS`` elements are supported. Semantics match ``torch.nn.functional.rms_norm`` and
``torch.nn.functional.layer_norm`` with ``normalized_shape = (n_cols,)`` (biased variance, eps inside the
square root); x, weight and bias share one dtype (fp16, bf16 or fp32) and the output has it too.

Registered as ``autopar::rms_norm`` / ``autopar::rms_norm_backward`` and ``autopar::layer_norm`` /
``autopar::layer_norm_backward``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from autopar.errors import ConfigError

from . import kernels_interpreted

__all__ = ["MAX_COLS", "layer_norm", "rms_norm"]

MAX_COLS = 32768
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Triton picks the interpreter when a kernel is decorated, so this must run before the kernels below are defined.
_INTERPRET = kernels_interpreted()


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    """``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * w``; partial ``dw = sum(dy * xhat)``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    # int64 bounds make the loop index int64, so row * stride cannot overflow on large inputs.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / n_cols))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / n_cols
    # Centre before squaring (two-pass variance): E[x^2] - E[x]^2 cancels catastrophically for large means.
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
    y = xc * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * w``; partial dw and db."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    # int64 bounds make the loop index int64, so row * stride cannot overflow on large inputs.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        # Masked lanes must not enter the row means: there x = 0 would give xhat = -mean * rstd.
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        dx = rstd * (g - tl.sum(g, 0) / n_cols - xhat * (tl.sum(g * xhat, 0) / n_cols))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)
    tl.store(db_partial_ptr + pid.to(tl.int64) * n_cols + cols, db, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _check_inputs(name: str, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> None:
    """Raise :class:`autopar.errors.ConfigError` (a ValueError) unless x, weight (and bias) fit the kernels."""
    for arg, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, Tensor):
            raise ConfigError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1:
        raise ConfigError(f"{name}: x must have at least one dim (normalised over the last), got a scalar")
    n_cols = x.shape[-1]
    if not 1 <= n_cols <= MAX_COLS:
        raise ConfigError(f"{name}: the last dim of x is {n_cols}; the fused kernel takes 1..{MAX_COLS}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"{name}: dtype {x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.shape != (n_cols,):
            raise ConfigError(f"{name}: {arg} must have shape ({n_cols},) to match x's last dim, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise ConfigError(f"{name}: {arg} has dtype {t.dtype} but x has {x.dtype}; cast one to the other")
        if t.device != x.device:
            raise ConfigError(f"{name}: {arg} is on {t.device} but x is on {x.device}")


def _check_runnable(t: Tensor) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise ConfigError(
            f"Triton kernels run on CUDA tensors; got a tensor on {t.device}. Set TRITON_INTERPRET=1 before "
            "importing autopar.triton_kernels to run them in the Triton interpreter."
        )


def _rows(x: Tensor) -> Tensor:
    """``x`` as a 2-D ``(rows, n_cols)`` view (a copy only if the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_warps(block: int) -> int:
    # About eight fp32 elements of each row tensor per thread, from one warp for short rows to 16 for 32k.
    return 1 if _INTERPRET else min(max(block // 256, 1), 16)


@functools.cache
def _num_partials(device: torch.device) -> int:
    """How many programs share the rows in the backward: enough to fill the GPU, few enough to sum cheaply."""
    if _INTERPRET or device.type != "cuda":
        # Several programs, so the tests cover the cross-program reduction; few, because they run one by one.
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _row_split(n_rows: int, device: torch.device) -> tuple[int, int]:
    """``(num_programs, rows_per_program)`` for the backward."""
    rows_per_program = triton.cdiv(n_rows, min(_num_partials(device), n_rows))
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


def _rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_runnable(x)
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_fwd_kernel[(n_rows,)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), n_cols, eps, BLOCK=block, num_warps=_num_warps(block)
        )
    return y.view(x.shape), rstd


def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    _check_runnable(x)
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    num_programs, rows_per_program = _row_split(n_rows, x.device)
    dw_partial = torch.empty((num_programs, n_cols), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_bwd_kernel[(num_programs,)](
        dy2,
        x2,
        weight,
        rstd,
        dx,
        dw_partial,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


def _layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_runnable(x)
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        block = triton.next_power_of_2(n_cols)
        _layer_norm_fwd_kernel[(n_rows,)](
            x2,
            weight,
            weight if bias is None else bias,
            y,
            mean,
            rstd,
            x2.stride(0),
            y.stride(0),
            n_cols,
            eps,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return y.view(x.shape), mean, rstd


def _layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    _check_runnable(x)
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight), torch.zeros_like(weight)
    num_programs, rows_per_program = _row_split(n_rows, x.device)
    dw_partial = torch.empty((num_programs, n_cols), dtype=torch.float32, device=x.device)
    db_partial = torch.empty_like(dw_partial)
    block = triton.next_power_of_2(n_cols)
    _layer_norm_bwd_kernel[(num_programs,)](
        dy2,
        x2,
        weight,
        mean,
        rstd,
        dx,
        dw_partial,
        db_partial,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("autopar::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm output (like x) and the fp32 ``rstd`` of each row (``x.numel() // x.shape[-1]``)."""
    _check_inputs("rms_norm", x, weight)
    return _rms_norm_forward(x, weight, eps)


@_rms_norm_op.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_inputs("rms_norm", x, weight)
    return x.new_empty(x.shape), x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)


@torch.library.custom_op("autopar::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients ``(dx, dweight)`` of RMSNorm from the saved ``rstd``."""
    return _rms_norm_backward(grad_y, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad_y, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_autograd(ctx, grad_y: Tensor, _grad_rstd: Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(grad_y, x, weight, rstd)
    return dx, dw, None


_rms_norm_op.register_autograd(_rms_norm_autograd, setup_context=_rms_norm_setup_context)


@torch.library.custom_op("autopar::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm output (like x) and the fp32 ``mean`` and ``rstd`` of each row."""
    _check_inputs("layer_norm", x, weight, bias)
    return _layer_norm_forward(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _layer_norm_fake(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_inputs("layer_norm", x, weight, bias)
    n_rows = x.numel() // x.shape[-1]
    stats = x.new_empty((n_rows,), dtype=torch.float32)
    return x.new_empty(x.shape), stats, stats.new_empty((n_rows,))


@torch.library.custom_op("autopar::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    grad_y: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dx, dweight, dbias)`` of LayerNorm from the saved statistics."""
    return _layer_norm_backward(grad_y, x, weight, mean, rstd)


@_layer_norm_backward_op.register_fake
def _layer_norm_backward_fake(grad_y, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _layer_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None


def _layer_norm_autograd(ctx, grad_y: Tensor, _grad_mean: Tensor | None, _grad_rstd: Tensor | None):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward_op(grad_y, x, weight, mean, rstd)
    return dx, dw, db if ctx.has_bias else None, None


_layer_norm_op.register_autograd(_layer_norm_autograd, setup_context=_layer_norm_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight``, as ``F.rms_norm(x, (n,), weight, eps)``.

    Args:
        x: ``(..., n)`` with ``1 <= n <= MAX_COLS``; fp16, bf16 or fp32.
        weight: ``(n,)``, x's dtype and device.
        eps: added to the mean square before the square root.

    Returns:
        Like ``x``; differentiable in ``x`` and ``weight``.
    """
    _check_inputs("rms_norm", x, weight)
    return _rms_norm_op(x, weight, float(eps))[0]


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim, as ``F.layer_norm(x, (n,), weight, bias, eps)``.

    Args:
        x: ``(..., n)`` with ``1 <= n <= MAX_COLS``; fp16, bf16 or fp32.
        weight: ``(n,)``, x's dtype and device.
        bias: ``(n,)`` or ``None`` for no bias.
        eps: added to the (biased) variance before the square root.

    Returns:
        Like ``x``; differentiable in ``x``, ``weight`` and ``bias``.
    """
    _check_inputs("layer_norm", x, weight, bias)
    return _layer_norm_op(x, weight, bias, float(eps))[0]

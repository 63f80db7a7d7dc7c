"""Fused linear + cross-entropy that never holds the full ``tokens x vocab`` logits.

``linear_cross_entropy(hidden, weight, labels)`` equals ``F.cross_entropy(hidden @ weight.T, labels)`` (mean over
the tokens whose label is not ``ignore_index``), but walks the tokens in chunks. For each chunk:

1. ``logits = hidden_chunk @ weight.T`` (a torch matmul, in the input dtype, into one reused buffer);
2. ``_cross_entropy_kernel``, one program per token, streams its row of logits twice: an online max / sum-exp
   gives the log-sum-exp and the token's loss, then the row is overwritten in place with the gradient of the mean
   loss with respect to the logits, ``(softmax - onehot(label)) / num_valid_tokens`` (zero for ignored tokens);
3. ``grad_hidden_chunk = grad_logits @ weight`` and ``grad_weight += grad_logits.T @ hidden_chunk``.

So the gradients are computed during the forward (when autograd will need them) and the backward only multiplies
them by the incoming scalar gradient. Memory beyond inputs and gradients is one ``chunk x vocab`` logits buffer in
the input dtype and an fp32 ``vocab x hidden`` accumulator for ``grad_weight`` (for 16-bit inputs each chunk's
product is rounded once and summed in fp32, formed a vocabulary slice at a time so that it is never larger than
the logits chunk), plus the ``grad_weight`` result: ``O(chunk x vocab + vocab x hidden)``, never
``O(tokens x vocab)``.

Labels outside ``[0, vocab)`` other than ``ignore_index`` are not checked (a check would cost a device-to-host
sync): their loss is undefined, though no out-of-bounds memory is read. When every label is ignored the loss is
``0 / 0 = nan`` and the gradients are zero, as with ``F.cross_entropy``. The loss has the input dtype, like
``F.cross_entropy`` of logits in that dtype; it is accumulated in fp32.

Registered as ``autopar::linear_cross_entropy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from autopar.errors import ConfigError

from . import kernels_interpreted

__all__ = ["linear_cross_entropy"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Triton picks the interpreter when a kernel is decorated, so this must run before the kernels below are defined.
_INTERPRET = kernels_interpreted()
# The interpreter's block is small so that the tests' small vocabularies still span several blocks.
_BLOCK_V = 32 if _INTERPRET else 4096
_NUM_WARPS = 1 if _INTERPRET else 8


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,
    labels_ptr,
    loss_ptr,
    inv_count_ptr,
    stride_row,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Loss of one token; with ``WRITE_GRAD`` its row of logits is replaced by the gradient of the mean loss."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: online log-sum-exp. Every block holds at least one real logit, so m is finite after the first.
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)

    is_valid = label != ignore_index
    # Read the target logit before pass 2 overwrites the row; the mask keeps a bad label from reading out of bounds.
    target = tl.load(row_ptr + label, mask=is_valid & (label >= 0) & (label < n_cols), other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(is_valid, lse - target, 0.0))

    if WRITE_GRAD:
        # where(), not a product: with no valid token in the batch inv_count is inf, and ignored rows must get 0.
        scale = tl.where(is_valid, tl.load(inv_count_ptr), 0.0)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            grad = tl.where(offs == label, p - 1.0, p) * scale
            tl.store(row_ptr + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor) -> None:
    """Raise :class:`autopar.errors.ConfigError` (a ValueError) unless the inputs fit the kernel."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, Tensor):
            raise ConfigError(f"linear_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ConfigError(
            f"linear_cross_entropy: expected hidden (..., hidden_dim) and weight (vocab, hidden_dim), got shapes "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ConfigError(
            f"linear_cross_entropy: hidden has hidden_dim {hidden.shape[-1]} but weight (vocab, hidden_dim) has "
            f"{weight.shape[1]}"
        )
    if weight.shape[0] < 1:
        raise ConfigError("linear_cross_entropy: weight has an empty vocabulary")
    if labels.shape != hidden.shape[:-1]:
        raise ConfigError(
            f"linear_cross_entropy: labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"linear_cross_entropy: labels must be int64 or int32 class indices, got {labels.dtype}")
    if hidden.dtype != weight.dtype or hidden.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"linear_cross_entropy: hidden and weight must share one dtype of {SUPPORTED_DTYPES}, got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if not (hidden.device == weight.device == labels.device):
        raise ConfigError(
            f"linear_cross_entropy: hidden, weight and labels must be on one device, got {hidden.device}, "
            f"{weight.device}, {labels.device}"
        )


def _check_runnable(t: Tensor) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise ConfigError(
            f"Triton kernels run on CUDA tensors; got a tensor on {t.device}. Set TRITON_INTERPRET=1 before "
            "importing autopar.triton_kernels to run them in the Triton interpreter."
        )


def default_chunk_size(num_tokens: int, vocab: int, hidden_dim: int) -> int:
    """Tokens per chunk: about as many that the logits chunk is as large as the whole ``hidden`` input."""
    return max(1, triton.next_power_of_2(triton.cdiv(max(num_tokens, 1), triton.cdiv(vocab, hidden_dim))))


def _accumulate_grad_weight(acc: Tensor, grad_logits: Tensor, hidden_chunk: Tensor, slice_rows: int) -> None:
    """``acc += grad_logits.T @ hidden_chunk`` into the fp32 accumulator.

    16-bit products are rounded once per chunk and then summed in fp32 (a 16-bit running sum would round at every
    chunk). The product is formed a slice of the vocabulary at a time, so its transient is no larger than the
    logits chunk rather than a second ``vocab x hidden`` tensor.
    """
    if acc.dtype == grad_logits.dtype:
        acc.addmm_(grad_logits.t(), hidden_chunk)
        return
    for start in range(0, acc.shape[0], slice_rows):
        end = min(start + slice_rows, acc.shape[0])
        acc[start:end] += grad_logits[:, start:end].t() @ hidden_chunk


def _forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_size: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_runnable(hidden)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    labels1 = labels.reshape(-1).contiguous()
    num_tokens, vocab = hidden2.shape[0], weight.shape[0]
    chunk_size = chunk_size if chunk_size > 0 else default_chunk_size(num_tokens, vocab, hidden2.shape[1])
    # Kept on the device: a Python count would cost a host sync per call.
    num_valid = (labels1 != ignore_index).sum()
    inv_count = 1.0 / num_valid.to(torch.float32)
    token_loss = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = (
        torch.empty(hidden2.shape, dtype=hidden.dtype, device=hidden.device)
        if need_grad_hidden
        else hidden.new_empty(0)
    )
    grad_weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad_weight else None
    logits = torch.empty((min(chunk_size, num_tokens), vocab), dtype=hidden.dtype, device=hidden.device)
    # Vocab rows per grad_weight product: no more elements than the logits chunk.
    slice_rows = max(1, logits.numel() // hidden2.shape[1])
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        hidden_chunk = hidden2[start:end]
        chunk_logits = logits[: end - start]
        torch.mm(hidden_chunk, weight.t(), out=chunk_logits)
        _cross_entropy_kernel[(end - start,)](
            chunk_logits,
            labels1[start:end],
            token_loss[start:end],
            inv_count,
            chunk_logits.stride(0),
            vocab,
            ignore_index,
            WRITE_GRAD=need_grad_hidden or need_grad_weight,
            BLOCK_V=_BLOCK_V,
            num_warps=_NUM_WARPS,
        )
        if need_grad_hidden:
            torch.mm(chunk_logits, weight, out=grad_hidden[start:end])
        if grad_weight_acc is not None:
            _accumulate_grad_weight(grad_weight_acc, chunk_logits, hidden_chunk, slice_rows)
    loss = (token_loss.sum() / num_valid).to(hidden.dtype)
    grad_weight = grad_weight_acc.to(weight.dtype) if grad_weight_acc is not None else weight.new_empty(0)
    return loss, grad_hidden.view(hidden.shape) if need_grad_hidden else grad_hidden, grad_weight


@torch.library.custom_op("autopar::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_size: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean loss and the gradients of it in hidden and weight (empty tensors where not needed)."""
    _check_inputs(hidden, weight, labels)
    return _forward(hidden, weight, labels, ignore_index, chunk_size, need_grad_hidden, need_grad_weight)


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(hidden, weight, labels, ignore_index, chunk_size, need_grad_hidden, need_grad_weight):
    _check_inputs(hidden, weight, labels)
    grad_hidden = hidden.new_empty(hidden.shape if need_grad_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if need_grad_weight else (0,))
    return hidden.new_empty(()), grad_hidden, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    _, _, _, _, _, need_grad_hidden, need_grad_weight = inputs
    _, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.need_grad_hidden = need_grad_hidden
    ctx.need_grad_weight = need_grad_weight


def _linear_cross_entropy_autograd(ctx, grad_loss: Tensor, _grad_gh: Tensor | None, _grad_gw: Tensor | None):
    grad_hidden, grad_weight = ctx.saved_tensors
    dh = grad_hidden * grad_loss.to(grad_hidden.dtype) if ctx.need_grad_hidden else None
    dw = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.need_grad_weight else None
    return dh, dw, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_autograd, setup_context=_setup_context)


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100, chunk_size: int | None = None
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` without the full logits.

    Args:
        hidden: ``(..., hidden_dim)`` final hidden states; fp16, bf16 or fp32.
        weight: ``(vocab, hidden_dim)`` output projection (LM head), hidden's dtype.
        labels: ``hidden.shape[:-1]`` class indices (int64 or int32); ``ignore_index`` marks tokens to skip.
        ignore_index: label value excluded from the loss and from the mean's denominator.
        chunk_size: tokens per chunk; ``None`` picks :func:`default_chunk_size`. Peak extra memory grows with it.

    Returns:
        The scalar mean loss in hidden's dtype; differentiable in ``hidden`` and ``weight``. Gradients are
        computed in the forward, and only for inputs that require them while grad mode is on.
    """
    _check_inputs(hidden, weight, labels)
    grad_on = torch.is_grad_enabled()
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"linear_cross_entropy: chunk_size must be a positive number of tokens, got {chunk_size}")
    return _linear_cross_entropy_op(
        hidden,
        weight,
        labels,
        int(ignore_index),
        0 if chunk_size is None else int(chunk_size),
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )[0]

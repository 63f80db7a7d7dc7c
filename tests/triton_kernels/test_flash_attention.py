"""Tests of ``autopar.triton_kernels.flash_attention``: numerics against float64 references, semantics, the op.

Every numeric test runs the Triton kernels (in the interpreter without a GPU) on fresh seeded random inputs and
compares the output and the gradients of q, k and v with two float64 computations from the same inputs: the
package's pure-PyTorch reference and PyTorch's SDPA math backend (``enable_gqa=True``).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from autopar.triton_kernels import flash_attention
from autopar.triton_kernels.reference import attention_reference

# Tolerance per input dtype, relative: |error| <= tol * max|expected| + tol * |expected|. Scaling the absolute
# part by the largest expected value keeps it meaningful for outputs and gradients of any size (here up to ~10;
# their size grows with the scale, head dim and sequence length). Errors of a wrong mask, a missed block or a
# wrong head group are of the order of the values themselves (>= 1e-1 relative), far above every tolerance.
# - fp32: every product and sum is fp32 (IEEE, not TF32); observed <= 1.5e-6 of the max, a few ulps of sums over
#   up to 128 terms; 1e-5 leaves a 6x margin.
# - fp16: P and dS are rounded to fp16 (unit roundoff 4.9e-4) before their matmuls, as in every flash kernel, and
#   results are rounded to fp16; observed <= 3e-4 of the max; 3e-3 is about 6 roundoffs.
# - bf16: the same roundings at bf16's unit roundoff 3.9e-3 (8x fp16); observed <= 5e-3 of the max; 2e-2 is
#   about 5 roundoffs.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, dtype, scale): every axis of the grid is covered by a
# few cases rather than the full product, which the interpreter could not run in the time budget.
CASES = [
    pytest.param(1, 2, 2, 17, 17, 32, False, torch.float32, None, id="mha-full-17-d32-fp32"),
    pytest.param(2, 4, 2, 50, 50, 64, True, torch.float32, None, id="gqa2-causal-50-d64-fp32"),
    pytest.param(1, 4, 1, 33, 70, 96, True, torch.float32, None, id="mqa-causal-q33-k70-d96-fp32"),
    pytest.param(1, 2, 2, 64, 64, 128, True, torch.float32, 0.37, id="mha-causal-64-d128-fp32-scale"),
    pytest.param(1, 2, 1, 70, 33, 128, True, torch.bfloat16, None, id="mqa-causal-q70-k33-d128-bf16"),
    pytest.param(1, 4, 2, 50, 17, 64, False, torch.bfloat16, None, id="gqa2-full-q50-k17-d64-bf16"),
    pytest.param(1, 2, 2, 1, 50, 64, True, torch.bfloat16, None, id="mha-causal-q1-k50-d64-bf16"),
    pytest.param(1, 6, 2, 40, 40, 96, True, torch.bfloat16, None, id="gqa3-causal-40-d96-bf16"),
    pytest.param(2, 2, 2, 17, 50, 128, False, torch.float16, None, id="mha-full-q17-k50-d128-fp16"),
    pytest.param(1, 6, 2, 40, 40, 96, True, torch.float16, None, id="gqa3-causal-40-d96-fp16"),
    pytest.param(1, 2, 2, 1, 1, 32, True, torch.float16, None, id="mha-causal-1-d32-fp16"),
    pytest.param(1, 4, 1, 50, 1, 32, False, torch.float16, None, id="mqa-full-q50-k1-d32-fp16"),
    pytest.param(1, 2, 1, 23, 23, 40, True, torch.float32, None, id="mqa-causal-23-d40-fp32"),
]


def _assert_close(actual, expected, *, tol, what):
    """``|actual - expected| <= tol * max|expected| + tol * |expected|``, elementwise, and no NaN or inf."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    # torch.testing.assert_close fails on NaN; the isfinite check also rejects inf and says which tensor.
    assert torch.isfinite(actual).all(), f"{what}: non-finite values in the kernel's result"
    # An all-zero expectation (e.g. dq when each query sees a single key) falls back to an absolute tol.
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = tol * scale if scale > 0 else tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=tol, msg=lambda m: f"{what}: {m}")


def _random_qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads_q, seq_q, head_dim), (batch, heads_kv, seq_k, head_dim), (batch, heads_kv, seq_k, head_dim)]
    return [torch.randn(s, generator=gen).to(dtype=dtype, device=device).requires_grad_() for s in shapes]


def _sdpa_math(q, k, v, causal, scale):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def _float64_leaves(*tensors):
    return [t.detach().cpu().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, dtype, scale", CASES)
def test_matches_reference_and_sdpa(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, dtype, scale, device):
    seed = zlib.crc32(repr((batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, dtype)).encode())
    q, k, v = _random_qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, device, seed)
    out = flash_attention(q, k, v, causal=causal, scale=scale)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype=dtype, device=device)
    out.backward(grad_out)
    assert out.dtype == dtype and q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype

    tol = TOLERANCES[dtype]  # see TOLERANCES for the reason of each size
    for name, impl in (("reference", attention_reference), ("sdpa-math", None)):
        q64, k64, v64 = _float64_leaves(q, k, v)
        if impl is None:
            expected = _sdpa_math(q64, k64, v64, causal, scale)
        else:
            expected, _ = impl(q64, k64, v64, causal=causal, scale=scale)
        expected.backward(grad_out.cpu().double())
        _assert_close(out.cpu(), expected, tol=tol, what=f"out vs {name}")
        _assert_close(q.grad.cpu(), q64.grad, tol=tol, what=f"dq vs {name}")
        _assert_close(k.grad.cpu(), k64.grad, tol=tol, what=f"dk vs {name}")
        _assert_close(v.grad.cpu(), v64.grad, tol=tol, what=f"dv vs {name}")


@pytest.mark.parametrize("seq_q, seq_k", [(5, 9), (9, 5)])
def test_reference_uses_sdpa_top_left_causal_alignment(seq_q, seq_k):
    """The reference (and so the kernel) reads ``is_causal`` as SDPA does: ``tril(ones(seq_q, seq_k))``."""
    q, k, v = _random_qkv(1, 2, 2, seq_q, seq_k, 8, torch.float64, "cpu", seed=7)
    expected = _sdpa_math(q, k, v, True, None)
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
    explicit = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out, _ = attention_reference(q, k, v, causal=True)
    # float64 throughout: only summation-order differences of a few ulps remain.
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(explicit, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.integration
def test_lse_output_and_its_gradient(device):
    """The op's second output is the row log-sum-exp of the scaled scores, and gradients flow through it too."""
    q, k, v = _random_qkv(1, 4, 2, 37, 21, 64, torch.float32, device, seed=3)
    scale = 1.0 / math.sqrt(64)
    out, lse = torch.ops.autopar.flash_attention(q, k, v, True, scale)
    gen = torch.Generator().manual_seed(4)
    w_out, w_lse = torch.randn(out.shape, generator=gen).to(device), torch.randn(lse.shape, generator=gen).to(device)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()

    q64, k64, v64 = _float64_leaves(q, k, v)
    out64, lse64 = attention_reference(q64, k64, v64, causal=True, scale=scale)
    ((out64 * w_out.cpu().double()).sum() + (lse64 * w_lse.cpu().double()).sum()).backward()
    tol = TOLERANCES[torch.float32]  # fp32 kernels: see TOLERANCES
    _assert_close(lse.cpu(), lse64, tol=tol, what="lse")
    _assert_close(out.cpu(), out64, tol=tol, what="out")
    for name, ours, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        _assert_close(ours.cpu(), ref, tol=tol, what=name)


@pytest.mark.integration
def test_strided_inputs_and_expanded_grad(device):
    """(batch, seq, heads, dim) tensors viewed as SDPA layout, and the stride-0 gradient that ``sum()`` sends."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 19, h, 32, generator=gen).to(device).transpose(1, 2) for h in (4, 2, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    flash_attention(q, k, v, causal=True).sum().backward()
    q64, k64, v64 = _float64_leaves(q, k, v)
    attention_reference(q64, k64, v64, causal=True)[0].sum().backward()
    tol = TOLERANCES[torch.float32]  # fp32 kernels: see TOLERANCES
    for name, ours, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        _assert_close(ours.cpu(), ref, tol=tol, what=name)


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, message",
    [
        ((1, 6, 8, 32), (1, 4, 8, 32), torch.float16, "multiple of the 4 heads"),
        ((1, 4, 8, 32), (1, 2, 8, 64), torch.float16, "head_dim 32 but k and v have head_dim 64"),
        ((1, 4, 8, 256), (1, 4, 8, 256), torch.float16, "head_dim 256 is not supported"),
        ((1, 4, 8, 32), (2, 4, 8, 32), torch.float16, "batch"),
        ((4, 8, 32), (4, 8, 32), torch.float16, "must be 4-D"),
        ((1, 4, 8, 32), (1, 4, 8, 32), torch.float64, "dtype torch.float64 is not supported"),
        ((1, 4, 8, 32), (1, 4, 0, 32), torch.float16, "sequence length 0"),
    ],
)
def test_rejects_bad_inputs(q_shape, kv_shape, dtype, message):
    q = torch.zeros(q_shape, dtype=dtype, device="meta")
    k = torch.zeros(kv_shape, dtype=dtype, device="meta")
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k.clone())


def test_rejects_mixed_dtypes():
    q = torch.zeros(1, 2, 4, 32, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(q, q.float(), q)


def test_meta_tensors_give_shapes_forward_and_backward():
    q = torch.empty(2, 8, 1000, 96, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 2, 3000, 96, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(2, 2, 3000, 96, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == (2, 8, 1000, 96) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return flash_attention(q, k, v, causal=True)


def test_export_keeps_one_custom_op_node(device):
    q, k, v = (t.detach() for t in _random_qkv(1, 4, 2, 9, 9, 32, torch.float32, device, seed=5))
    exported = torch.export.export(_Attention(), (q, k, v))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.flash_attention.default) == 1
    assert not any("softmax" in str(t) or "bmm" in str(t) for t in targets), "attention must not be decomposed"
    # Running the exported program runs the same kernel: identical bits.
    torch.testing.assert_close(exported.module()(q, k, v), _Attention()(q, k, v), atol=0, rtol=0)


@pytest.mark.integration
def test_opcheck_registration(device):
    """PyTorch's own checker: schema, fake (meta) implementation and autograd registration agree with the kernel."""
    q, k, v = _random_qkv(1, 2, 1, 5, 7, 16, torch.float32, device, seed=9)
    torch.library.opcheck(torch.ops.autopar.flash_attention.default, (q, k, v, True, 0.25))


@pytest.mark.integration
def test_torch_compile_sees_one_op_and_matches_eager(device):
    """Dynamo traces the op as one node (fullgraph: no graph break) and AOT autograd uses its backward formula."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = _random_qkv(1, 4, 2, 20, 20, 32, torch.float32, device, seed=12)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True), backend=counter, fullgraph=True)
    compiled(q, k, v).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    targets = [node.target for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.flash_attention.default) == 1
    for t in (q, k, v):
        t.grad = None
    flash_attention(q, k, v, causal=True).sum().backward()
    for name, compiled_grad, t in zip(("dq", "dk", "dv"), grads, (q, k, v), strict=True):
        # The same kernels run in both: identical bits.
        torch.testing.assert_close(compiled_grad, t.grad, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")

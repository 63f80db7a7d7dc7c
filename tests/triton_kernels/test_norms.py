"""Tests of ``autopar.triton_kernels.norms``: fused RMSNorm and LayerNorm against float64 references and PyTorch.

Each numeric test runs the kernels (in the interpreter without a GPU) on fresh seeded random inputs and compares
the output and the gradients of x, weight (and bias) with the package's reference and with
``F.rms_norm`` / ``F.layer_norm``, both in float64 from the same inputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from autopar.triton_kernels import layer_norm, rms_norm
from autopar.triton_kernels.norms import MAX_COLS
from autopar.triton_kernels.reference import layer_norm_reference, rms_norm_reference

# Tolerance per dtype, relative: |error| <= tol * max(max|expected|, 1) + tol * |expected|. The statistics and
# every sum are fp32, so what is left is the rounding of the result to the input dtype and, for the weight and
# bias gradients, of fp32 sums over all rows (their size grows with the number of rows, hence the scaling by the
# largest expected value). A wrong statistic or a lost row is off by far more (>= 1e-1 relative).
# - fp32: observed <= 1.5e-7 of the max (about one fp32 ulp); 2e-6 is a 10x margin.
# - fp16: one rounding to fp16 (unit roundoff 4.9e-4) of the result; observed <= 5e-4; 2e-3 is 4 roundoffs.
# - bf16: the same at bf16's 3.9e-3; observed <= 4e-3 of the max; 1.6e-2 is 4 roundoffs.
TOLERANCES = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (shape of x, dtype): short and long rows, one element, rows not a power of two, 1-D to 3-D inputs.
CASES = [
    pytest.param((3, 5, 100), torch.float32, id="3d-100-fp32"),
    pytest.param((7, 1000), torch.bfloat16, id="2d-1000-bf16"),
    pytest.param((9, 1), torch.float16, id="2d-1-fp16"),
    pytest.param((2, 3, 4096), torch.float16, id="3d-4096-fp16"),
    pytest.param((3, 16384), torch.bfloat16, id="2d-16k-bf16"),
    pytest.param((33,), torch.float32, id="1d-33-fp32"),
    pytest.param((10, 77), torch.bfloat16, id="2d-77-bf16"),
]


def _assert_close(actual, expected, *, tol, what, floor=1.0):
    """``|actual - expected| <= tol * max(max|expected|, floor) + tol * |expected|``, elementwise; no NaN or inf.

    The floor of 1 is the scale of the terms every result is built from (unit-scale inputs): a one-element row
    makes ``x - mean`` and dx cancel to rounding noise (~1e-13 in float64), which is no scale to measure by.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    # torch.testing.assert_close fails on NaN; the isfinite check also rejects inf and says which tensor.
    assert torch.isfinite(actual).all(), f"{what}: non-finite values in the kernel's result"
    # An all-zero expectation (e.g. dq when each query sees a single key) falls back to an absolute tol.
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, floor)
    atol = tol * scale if scale > 0 else tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=tol, msg=lambda m: f"{what}: {m}")


def _inputs(shape, dtype, device, seed, *, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + offset).to(dtype=dtype, device=device).requires_grad_()
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype=dtype, device=device).requires_grad_()
    bias = (0.5 * torch.randn(n, generator=gen)).to(dtype=dtype, device=device).requires_grad_()
    grad_y = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return x, weight, bias, grad_y


def _float64_leaves(*tensors):
    return [t.detach().cpu().double().requires_grad_() for t in tensors]


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


@pytest.mark.parametrize("shape, dtype", CASES)
def test_rms_norm_matches_reference_and_torch(shape, dtype, device):
    eps = 1e-6
    x, weight, _, grad_y = _inputs(shape, dtype, device, _seed("rms", shape, dtype))
    y = rms_norm(x, weight, eps)
    y.backward(grad_y)
    assert y.dtype == dtype
    tol = TOLERANCES[dtype]  # see TOLERANCES for the reason of each size
    for name, fn in (
        ("reference", rms_norm_reference),
        ("F.rms_norm", lambda x, w, e: F.rms_norm(x, (shape[-1],), w, e)),
    ):
        x64, w64 = _float64_leaves(x, weight)
        expected = fn(x64, w64, eps)
        expected.backward(grad_y.cpu().double())
        _assert_close(y.cpu(), expected, tol=tol, what=f"y vs {name}")
        _assert_close(x.grad.cpu(), x64.grad, tol=tol, what=f"dx vs {name}")
        _assert_close(weight.grad.cpu(), w64.grad, tol=tol, what=f"dweight vs {name}")


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_layer_norm_matches_reference_and_torch(shape, dtype, with_bias, device):
    eps = 1e-5
    # An offset mean checks the centred (two-pass) variance: E[x^2] - E[x]^2 would lose digits to cancellation.
    x, weight, bias, grad_y = _inputs(shape, dtype, device, _seed("ln", shape, dtype, with_bias), offset=3.0)
    bias = bias if with_bias else None
    y = layer_norm(x, weight, bias, eps)
    y.backward(grad_y)
    assert y.dtype == dtype
    tol = TOLERANCES[dtype]  # see TOLERANCES for the reason of each size
    for name, fn in (("reference", layer_norm_reference), ("F.layer_norm", None)):
        x64, w64 = _float64_leaves(x, weight)
        b64 = _float64_leaves(bias)[0] if with_bias else None
        if fn is None:
            expected = F.layer_norm(x64, (shape[-1],), w64, b64, eps)
        else:
            expected = fn(x64, w64, b64, eps)
        expected.backward(grad_y.cpu().double())
        _assert_close(y.cpu(), expected, tol=tol, what=f"y vs {name}")
        _assert_close(x.grad.cpu(), x64.grad, tol=tol, what=f"dx vs {name}")
        _assert_close(weight.grad.cpu(), w64.grad, tol=tol, what=f"dweight vs {name}")
        if with_bias:
            _assert_close(bias.grad.cpu(), b64.grad, tol=tol, what=f"dbias vs {name}")


def test_strided_rows(device):
    """A transposed input (last dim strided in memory) gives what its contiguous copy gives."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=gen).to(device).t()  # (6, 64) with stride 6 along the last dim
    weight = torch.randn(64, generator=gen).to(device)
    assert x.stride(-1) != 1
    tol = TOLERANCES[torch.float32]  # fp32: see TOLERANCES
    expected = F.layer_norm(x.cpu().double(), (64,), weight.cpu().double(), None, 1e-5)
    _assert_close(layer_norm(x, weight, None, 1e-5).cpu(), expected, tol=tol, what="layer_norm")
    expected = F.rms_norm(x.cpu().double(), (64,), weight.cpu().double(), 1e-6)
    _assert_close(rms_norm(x, weight, 1e-6).cpu(), expected, tol=tol, what="rms_norm")


@pytest.mark.parametrize(
    "x_shape, w_shape, w_dtype, message",
    [
        ((4, 8), (7,), torch.float16, r"weight must have shape \(8,\)"),
        ((4, 8), (8,), torch.float32, "weight has dtype torch.float32 but x has torch.float16"),
        ((4, MAX_COLS + 1), (MAX_COLS + 1,), torch.float16, "last dim of x"),
    ],
)
def test_rejects_bad_inputs(x_shape, w_shape, w_dtype, message):
    x = torch.zeros(x_shape, dtype=torch.float16, device="meta")
    w = torch.zeros(w_shape, dtype=w_dtype, device="meta")
    with pytest.raises(ValueError, match=message):
        rms_norm(x, w)
    with pytest.raises(ValueError, match=message):
        layer_norm(x, w, None)


def test_meta_tensors_give_shapes_forward_and_backward():
    x = torch.empty(4, 1024, 8192, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(8192, dtype=torch.bfloat16, device="meta", requires_grad=True)
    b = torch.empty(8192, dtype=torch.bfloat16, device="meta", requires_grad=True)
    for y in (rms_norm(x, w), layer_norm(x, w, b)):
        assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "meta"
        y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape


class _Norms(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.ones(n))
        self.w2 = torch.nn.Parameter(torch.ones(n))
        self.b2 = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return layer_norm(rms_norm(x, self.w1, 1e-6), self.w2, self.b2, 1e-5)


@pytest.mark.integration
def test_export_keeps_one_custom_op_node_each(device):
    model = _Norms(48).to(device)
    x = torch.randn(3, 5, 48, device=device)
    exported = torch.export.export(model, (x,))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.rms_norm.default) == 1
    assert targets.count(torch.ops.autopar.layer_norm.default) == 1
    # Running the exported program runs the same kernels: identical bits.
    torch.testing.assert_close(exported.module()(x), model(x), atol=0, rtol=0)


@pytest.mark.integration
def test_opcheck_registration(device):
    """PyTorch's own checker: schema, fake (meta) implementation and autograd registration agree with the kernels."""
    x, weight, bias, _ = _inputs((3, 20), torch.float32, device, seed=2)
    torch.library.opcheck(torch.ops.autopar.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.autopar.layer_norm.default, (x, weight, bias, 1e-5))
    torch.library.opcheck(torch.ops.autopar.layer_norm.default, (x, weight, None, 1e-5))


def test_torch_compile_sees_one_op_each(device):
    """Dynamo traces each op as one node (fullgraph: no graph break) and AOT autograd uses its backward formula."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _Norms(48).to(device)
    x = torch.randn(3, 48, device=device, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    torch.compile(model, backend=counter, fullgraph=True)(x).sum().backward()
    compiled_grad = x.grad.clone()
    targets = [node.target for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.rms_norm.default) == 1
    assert targets.count(torch.ops.autopar.layer_norm.default) == 1
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(compiled_grad, x.grad, atol=0, rtol=0)  # the same kernels run: identical bits

"""Tests of ``autopar.triton_kernels.cross_entropy``: the fused, chunked linear + cross-entropy.

Each numeric test runs the kernel (in the interpreter without a GPU) on fresh seeded random inputs and compares
the loss and the gradients of hidden and weight with the package's reference and with
``F.cross_entropy(hidden @ weight.T, labels)``, both in float64 from the same inputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.triton_kernels import cross_entropy as ce_module
from autopar.triton_kernels import linear_cross_entropy
from autopar.triton_kernels.reference import linear_cross_entropy_reference

# Tolerance per dtype, relative: |error| <= tol * max|expected| + tol * |expected|. The matmuls run in the
# input dtype (the logits chunk is rounded to it, as F.cross_entropy of 16-bit logits would see them); the
# log-sum-exp, the loss and the grad_weight sums are fp32. A wrong label, row or chunk is off by >= 1e-1.
# - fp32: observed <= 3e-7 of the max; 2e-6 leaves a 6x margin.
# - fp16: the logits, the logits' gradient and the products are rounded to fp16 (unit roundoff 4.9e-4);
#   observed <= 3e-4 of the max; 3e-3 is 6 roundoffs.
# - bf16: the same at bf16's 3.9e-3; observed <= 4.5e-3 of the max; 2.4e-2 is 6 roundoffs.
TOLERANCES = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 2.4e-2}

# (leading shape, hidden_dim, vocab, dtype, chunk_size, every how many tokens is ignored (0: none), ignore_index)
CASES = [
    pytest.param((37,), 48, 301, torch.float32, 16, 5, -100, id="37tok-v301-fp32-chunk16"),
    pytest.param((37,), 48, 301, torch.bfloat16, None, 5, -100, id="37tok-v301-bf16-default-chunk"),
    pytest.param((2, 9), 32, 130, torch.float32, 4, 3, -100, id="2x9tok-v130-fp32-chunk4"),
    pytest.param((13,), 64, 1000, torch.float16, 5, 0, -100, id="13tok-v1000-fp16-none-ignored"),
    pytest.param((20,), 16, 77, torch.bfloat16, 7, 4, 0, id="20tok-v77-bf16-ignore-index-0"),
    pytest.param((6,), 32, 50, torch.float32, 1, 2, -100, id="6tok-v50-fp32-chunk1"),
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


def _inputs(lead_shape, hidden_dim, vocab, dtype, device, seed, ignore_every=0, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead_shape, hidden_dim, generator=gen).to(dtype=dtype, device=device).requires_grad_()
    # Scaled so the logits have unit-order spread, as a trained LM head gives; larger spreads only sharpen softmax.
    weight = (torch.randn(vocab, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype=dtype, device=device)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, lead_shape, generator=gen)
    if ignore_every:
        labels.view(-1)[::ignore_every] = ignore_index
    return hidden, weight, labels.to(device)


def _float64_expected(fn, hidden, weight, labels, ignore_index, scale=1.0):
    h64, w64 = (t.detach().cpu().double().requires_grad_() for t in (hidden, weight))
    loss = fn(h64, w64, labels.cpu(), ignore_index)
    (loss * scale).backward()
    return loss, h64.grad, w64.grad


def _torch_cross_entropy(h, w, labels, ignore_index):
    return F.cross_entropy(h.reshape(-1, h.shape[-1]) @ w.T, labels.reshape(-1), ignore_index=ignore_index)


def _reference(h, w, labels, ignore_index):
    return linear_cross_entropy_reference(h, w, labels, ignore_index=ignore_index)


@pytest.mark.parametrize("lead_shape, hidden_dim, vocab, dtype, chunk_size, ignore_every, ignore_index", CASES)
def test_matches_reference_and_torch(
    lead_shape, hidden_dim, vocab, dtype, chunk_size, ignore_every, ignore_index, device
):
    seed = zlib.crc32(repr((lead_shape, hidden_dim, vocab, dtype, chunk_size)).encode())
    hidden, weight, labels = _inputs(lead_shape, hidden_dim, vocab, dtype, device, seed, ignore_every, ignore_index)
    loss = linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, chunk_size=chunk_size)
    loss.backward()
    assert loss.shape == () and loss.dtype == dtype
    tol = TOLERANCES[dtype]  # see TOLERANCES for the reason of each size
    for name, fn in (("reference", _reference), ("F.cross_entropy", _torch_cross_entropy)):
        ref_loss, ref_dh, ref_dw = _float64_expected(fn, hidden, weight, labels, ignore_index)
        _assert_close(loss.cpu(), ref_loss, tol=tol, what=f"loss vs {name}")
        _assert_close(hidden.grad.cpu(), ref_dh, tol=tol, what=f"dhidden vs {name}")
        _assert_close(weight.grad.cpu(), ref_dw, tol=tol, what=f"dweight vs {name}")


def test_backward_multiplies_by_grad_output(device):
    hidden, weight, labels = _inputs((11,), 16, 40, torch.float32, device, seed=3, ignore_every=4)
    (linear_cross_entropy(hidden, weight, labels, chunk_size=3) * -2.5).backward()
    _, ref_dh, ref_dw = _float64_expected(_torch_cross_entropy, hidden, weight, labels, -100, scale=-2.5)
    tol = TOLERANCES[torch.float32]  # fp32: see TOLERANCES
    _assert_close(hidden.grad.cpu(), ref_dh, tol=tol, what="dhidden")
    _assert_close(weight.grad.cpu(), ref_dw, tol=tol, what="dweight")


def test_all_ignored_gives_nan_loss_and_zero_grads_like_torch(device):
    hidden, weight, labels = _inputs((5,), 8, 20, torch.float32, device, seed=4)
    labels = torch.full_like(labels, -100)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=2)
    loss.backward()
    ref_loss, ref_dh, ref_dw = _float64_expected(_torch_cross_entropy, hidden, weight, labels, -100)
    # F.cross_entropy's mean over zero tokens is 0 / 0; the gradients are exactly zero, not NaN.
    assert torch.isnan(ref_loss) and torch.isnan(loss)
    assert torch.equal(hidden.grad.cpu(), ref_dh.float()) and not hidden.grad.any()
    assert torch.equal(weight.grad.cpu(), ref_dw.float()) and not weight.grad.any()


def test_frozen_weight_and_no_grad_mode(device):
    hidden, weight, labels = _inputs((9,), 16, 30, torch.float32, device, seed=5, ignore_every=3)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    loss.backward()
    assert weight.grad is None
    ref_loss, ref_dh, _ = _float64_expected(_torch_cross_entropy, hidden, weight, labels, -100)
    tol = TOLERANCES[torch.float32]  # fp32: see TOLERANCES
    _assert_close(hidden.grad.cpu(), ref_dh, tol=tol, what="dhidden")
    with torch.no_grad():
        loss_no_grad = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert not loss_no_grad.requires_grad
    _assert_close(loss_no_grad.cpu(), ref_loss, tol=tol, what="loss without grad")


class _LargestTensor(TorchDispatchMode):
    """Records the size in bytes of the largest tensor an ATen op produces while active.

    Bytes, not elements: the Triton interpreter stages each kernel argument through a byte (uint8) copy.
    """

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
        return out


@pytest.mark.integration
def test_memory_is_chunk_by_vocab_not_tokens_by_vocab(device):
    """No tensor of tokens x vocab elements is ever made: the largest is a logits chunk or a weight-sized one."""
    num_tokens, hidden_dim, vocab, chunk = 48, 8, 300, 4
    hidden, weight, labels = _inputs((num_tokens,), hidden_dim, vocab, torch.float32, device, seed=6)
    with _LargestTensor() as largest:
        loss, _, _ = ce_module._forward(hidden.detach(), weight.detach(), labels, -100, chunk, True, True)
    fp32_bytes = 4
    bound = fp32_bytes * max(chunk * vocab, vocab * hidden_dim, num_tokens * hidden_dim)
    assert 0 < largest.max_bytes <= bound < fp32_bytes * num_tokens * vocab
    expected = _torch_cross_entropy(hidden.cpu().double(), weight.cpu().double(), labels.cpu(), -100)
    _assert_close(loss.cpu(), expected, tol=TOLERANCES[torch.float32], what="loss")  # fp32: see TOLERANCES


@pytest.mark.parametrize(
    "hidden_shape, weight_shape, labels_shape, labels_dtype, message",
    [
        ((4, 8), (10, 9), (4,), torch.int64, "hidden_dim 8 but weight"),
        ((4, 8), (10, 8), (5,), torch.int64, "labels must have hidden's leading shape"),
        ((4, 8), (10, 8), (4,), torch.float32, "labels must be int64 or int32"),
        ((4, 8), (10,), (4,), torch.int64, "weight \\(vocab, hidden_dim\\)"),
    ],
)
def test_rejects_bad_inputs(hidden_shape, weight_shape, labels_shape, labels_dtype, message):
    hidden = torch.zeros(hidden_shape, device="meta")
    weight = torch.zeros(weight_shape, device="meta")
    labels = torch.zeros(labels_shape, dtype=labels_dtype, device="meta")
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(hidden, weight, labels)


def test_meta_tensors_give_shapes_forward_and_backward():
    hidden = torch.empty(4, 4096, 2048, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta", requires_grad=True)
    labels = torch.empty(4, 4096, dtype=torch.int64, device="meta")
    loss = linear_cross_entropy(hidden, weight, labels)
    assert loss.shape == () and loss.dtype == torch.bfloat16 and loss.device.type == "meta"
    loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


class _LMHead(torch.nn.Module):
    def __init__(self, hidden_dim: int, vocab: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_dim, vocab, bias=False)

    def forward(self, hidden, labels):
        return linear_cross_entropy(hidden, self.proj.weight, labels)


def test_export_keeps_one_custom_op_node(device):
    model = _LMHead(16, 50).to(device)
    hidden, _, labels = _inputs((2, 7), 16, 50, torch.float32, device, seed=8, ignore_every=3)
    hidden = hidden.detach()
    exported = torch.export.export(model, (hidden, labels))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.linear_cross_entropy.default) == 1
    assert torch.ops.aten.mm.default not in targets, "the logits matmul must stay inside the op"
    # Running the exported program runs the same kernel: identical bits.
    torch.testing.assert_close(exported.module()(hidden, labels), model(hidden, labels), atol=0, rtol=0)


@pytest.mark.integration
def test_opcheck_registration(device):
    """PyTorch's own checker: schema, fake (meta) implementation and autograd registration agree with the kernel."""
    hidden, weight, labels = _inputs((6,), 8, 20, torch.float32, device, seed=9, ignore_every=4)
    torch.library.opcheck(torch.ops.autopar.linear_cross_entropy.default, (hidden, weight, labels, -100, 4, True, True))


def test_torch_compile_sees_one_op(device):
    """Dynamo traces the op as one node (fullgraph: no graph break) and AOT autograd uses its backward formula."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _LMHead(16, 50).to(device)
    hidden, _, labels = _inputs((9,), 16, 50, torch.float32, device, seed=10, ignore_every=4)
    counter = CompileCounterWithBackend("aot_eager")
    torch.compile(model, backend=counter, fullgraph=True)(hidden, labels).backward()
    compiled_grads = [hidden.grad.clone(), model.proj.weight.grad.clone()]
    targets = [node.target for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.autopar.linear_cross_entropy.default) == 1
    hidden.grad = model.proj.weight.grad = None
    model(hidden, labels).backward()
    # The same kernel runs in both: identical bits.
    torch.testing.assert_close(compiled_grads[0], hidden.grad, atol=0, rtol=0)
    torch.testing.assert_close(compiled_grads[1], model.proj.weight.grad, atol=0, rtol=0)

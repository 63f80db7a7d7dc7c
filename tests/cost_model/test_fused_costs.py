"""Costs of autopar's fused Triton ops against the hand formulas, and the registration by name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.fx as fx

import autopar.triton_kernels  # noqa: F401  (registers the autopar:: ops)
from autopar.cost_model.compute import UNKNOWN_OPS, estimate_node_cost
from tests.fx_nodes import call_node

aten = torch.ops.aten
autopar_ops = torch.ops.autopar


def _meta(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


B, H, HKV, S, D = 2, 8, 2, 512, 64


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_flops_and_bytes(causal):
    q, k, v = _meta(B, H, S, D), _meta(B, HKV, S, D), _meta(B, HKV, S, D)
    node = call_node(autopar_ops.flash_attention.default, (q, k, v, causal, D**-0.5))
    cost = estimate_node_cost(node)
    expected = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    assert cost.flops == expected
    assert cost.backward_flops == 2.5 * expected
    lse_bytes = B * H * S * 4  # fp32 log-sum-exp per query row
    assert cost.bytes_accessed == _nbytes(q, k, v, q) + lse_bytes  # q, k, v read, O (q's shape) written
    assert cost.bytes_accessed < B * H * S * S * 2  # far below one fp16 copy of the s x s scores
    assert cost.is_matmul


def test_flash_attention_matches_the_sdpa_entry():
    # The same attention priced as aten SDPA (is_causal, GQA) and as the fused op: same FLOPs.
    q, k = _meta(B, H, S, D), _meta(B, HKV, S, D)
    g = fx.Graph()
    names = [g.placeholder(n) for n in "qkv"]
    for p, t in zip(names, (q, k, k), strict=True):
        p.meta["val"] = t
    sdpa = g.call_function(
        aten.scaled_dot_product_attention.default, tuple(names), {"is_causal": True, "enable_gqa": True}
    )
    sdpa.meta["val"] = _meta(B, H, S, D)
    fused = call_node(autopar_ops.flash_attention.default, (q, k, k, True, D**-0.5))
    assert estimate_node_cost(fused).flops == estimate_node_cost(sdpa).flops


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_fused_norms_are_one_pass(op):
    rows, cols = 512, 1024
    x, w = _meta(4, rows // 4, cols), _meta(cols)
    args = (x, w, 1e-6) if op == "rms_norm" else (x, w, _meta(cols), 1e-5)
    node = call_node(getattr(autopar_ops, op).default, args)
    cost = estimate_node_cost(node)
    affine = [a for a in args[1:] if isinstance(a, torch.Tensor)]
    stats = (1 if op == "rms_norm" else 2) * rows * 4  # fp32 rstd (and mean) per row
    assert cost.flops == (4 if op == "rms_norm" else 5) * x.numel()
    # forward: x read, y written, affine parameters read, stats written, each once
    assert cost.bytes_accessed == 2 * _nbytes(x) + _nbytes(*affine) + stats
    # backward: x and dy read, dx written; parameters read and their gradients written; stats read
    assert cost.backward_bytes == 3 * _nbytes(x) + 2 * _nbytes(*affine) + stats
    assert str(node.target) not in UNKNOWN_OPS


@pytest.mark.parametrize("need_grad", [True, False])
def test_linear_cross_entropy_flops_and_bytes(need_grad):
    tokens, hidden_dim, vocab = 256, 64, 32000
    h, w = _meta(2, tokens // 2, hidden_dim), _meta(vocab, hidden_dim)
    labels = torch.empty(2, tokens // 2, dtype=torch.long, device="meta")
    node = call_node(autopar_ops.linear_cross_entropy.default, (h, w, labels, -100, 0, need_grad, need_grad))
    cost = estimate_node_cost(node)
    nvh, nv = tokens * vocab * hidden_dim, tokens * vocab
    if need_grad:  # head GEMM, dH and dW GEMMs (6·N·V·H), softmax + loss (5·N·V), softmax - onehot (3·N·V)
        assert cost.flops == 6 * nvh + 8 * nv
        assert cost.bytes_accessed == _nbytes(h, w, labels) + 2 + _nbytes(h, w)  # + fp16 loss + gradients
        assert cost.backward_flops == h.numel() + w.numel()  # scaling the saved gradients
    else:
        assert cost.flops == 2 * nvh + 5 * nv
        assert cost.bytes_accessed == _nbytes(h, w, labels) + 2
        assert cost.backward_flops == 0
    assert cost.bytes_accessed < nv * 2  # the fp16 logits alone would be more than everything it moves


@pytest.mark.subprocess
def test_cost_model_does_not_import_the_kernels():
    # Pricing must not pull in Triton: the fused ops are registered by name.
    code = "import sys, autopar.cost_model; print('autopar.triton_kernels' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_linear_cross_entropy_does_the_eager_work_in_its_forward():
    # The fused loss runs the head's forward and backward GEMMs and the softmax in its forward: the same
    # arithmetic as aten.linear + aten.cross_entropy_loss over forward and backward together.
    tokens, hidden_dim, vocab = 64, 32, 1000
    h, w = _meta(tokens, hidden_dim, dtype=torch.float32), _meta(vocab, hidden_dim, dtype=torch.float32)
    labels = torch.empty(tokens, dtype=torch.long, device="meta")
    fused = estimate_node_cost(call_node(autopar_ops.linear_cross_entropy.default, (h, w, labels, -100, 0, True, True)))
    head = estimate_node_cost(call_node(aten.linear.default, (h, w)))
    logits = _meta(tokens, vocab, dtype=torch.float32)
    loss = estimate_node_cost(call_node(aten.cross_entropy_loss.default, (logits, labels)))
    eager = head.flops + head.backward_flops + loss.flops + loss.backward_flops
    assert fused.flops == eager
    # the eager cross-entropy alone, over forward and backward, moves more than the whole fused loss
    assert fused.bytes_accessed + fused.backward_bytes < loss.bytes_accessed + loss.backward_bytes


def test_eager_rms_norm_is_priced_as_the_kernels_it_launches():
    """Hugging Face's LlamaRMSNorm run eagerly (as torchtitan's eager runs run theirs) against autopar's fused norm.

    Eager, on x bf16 [2, 8192, 4096] (N elements), each op is a kernel with its own pass over HBM, in bytes per
    element: cast to fp32 (2 read + 4 written), pow (4 + 4), mean (4 read, one value a row written), the product by
    rsqrt (4 + 4), cast back (4 + 2), the product by the weight (2 + 2): 36 N, and the row statistics' ops. Fused:
    x read and y written once, 4 N. The H100-96GB-500W's HBM2e moves 2.4 TB/s x 4.3/4.8 (`memory_efficiency`).
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from autopar.cost_model.compute import AnalyticEstimator
    from autopar.cost_model.devices import get_device
    from autopar.passes.fused_ops import fuse_traced
    from autopar.trace import trace_model

    device = get_device("H100-96GB-500W")
    bandwidth = 2.4e12 * 4.3 / 4.8
    n, rows, hidden = 2 * 8192 * 4096, 2 * 8192, 4096
    with torch.device("meta"):
        norm = LlamaRMSNorm(hidden).to(torch.bfloat16)
    x = torch.empty(2, 8192, hidden, dtype=torch.bfloat16, device="meta")

    def forward_s(traced) -> tuple[float, int]:
        estimator = AnalyticEstimator(device, "bf16")
        priced = [
            estimator.forward_time_s(node, 1.0)
            for node in traced.graph_module.graph.nodes
            if node.op == "call_function" and not estimate_node_cost(node).is_view
        ]
        return sum(priced), sum(1 for t in priced if t > 0)

    eager_s, kernels = forward_s(trace_model(norm, (x,)))
    # the row statistics' ops (add eps, rsqrt) and the mean's output move 4 bytes a row; the weight 2 bytes a column
    small = 5 * 4 * rows + 2 * hidden
    assert eager_s == pytest.approx((36 * n + small) / bandwidth + kernels * device.kernel_overhead_s, rel=1e-3)
    fused_s, fused_kernels = forward_s(fuse_traced(trace_model(norm, (x,)), attention=False, cross_entropy=False))
    assert fused_kernels == 1
    assert fused_s == pytest.approx((4 * n + 4 * rows + 2 * hidden) / bandwidth + device.kernel_overhead_s, rel=1e-3)
    # 1.12 ms against 0.13 ms: nine passes over the activations where the fused kernel makes one
    assert eager_s / fused_s == pytest.approx(9, rel=0.02)

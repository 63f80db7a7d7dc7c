"""Attention one pair of sequence segments at a time, merged by log-sum-exp, equals attention on the whole sequence.

Segments here are deliberately unequal and overlapping in position ranges, so that every kind of pair (visible,
hidden, diagonal and partial, which the cp layouts never produce) is exercised, on CPU's flash op and on the
plain reference that other devices use.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.context_parallel import blocks
from autopar.context_parallel.blocks import Visibility, visibility

SEQ, HEADS, DIM = 10, 4, 8
Q_SEGS = ((6, 4), (0, 6))  # stored out of order, as a zig-zag rank stores its two chunks
K_SEGS = ((0, 3), (3, 5), (8, 2))  # (3, 5) against (0, 6) and (6, 4) is a partial pair
# float64: pairs and the whole-sequence reference sum the same ~10 terms per entry in another order (~1e-15);
# a mis-masked key changes entries at ~1e-2
ATOL = RTOL = 1e-10


def test_visibility_by_global_position():
    assert visibility((4, 2), (0, 4), causal=True) == Visibility.VISIBLE  # keys 0..3 precede queries 4, 5
    assert visibility((0, 2), (2, 2), causal=True) == Visibility.HIDDEN
    assert visibility((2, 2), (2, 2), causal=True) == Visibility.DIAGONAL
    assert visibility((0, 6), (3, 5), causal=True) == Visibility.PARTIAL
    assert visibility((0, 2), (2, 2), causal=False) == Visibility.VISIBLE


def _take(x, segs):
    return torch.cat([x.narrow(2, s, n) for s, n in segs], dim=2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_pairs_merge_to_whole_attention_forward_and_backward(causal, kv_heads):
    g = torch.Generator().manual_seed(kv_heads + 10 * causal)
    q, dout = (torch.randn(2, HEADS, SEQ, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, SEQ, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    scale = DIM**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    outs, lses = [], []
    for qs in Q_SEGS:
        acc = None
        for ks in K_SEGS:
            found = blocks.block_forward(_take(qd, [qs]), _take(kd, [ks]), _take(vd, [ks]), qs, ks, causal, scale)
            if found is not None:
                acc = blocks.merge(acc, found)
        outs.append(acc[0])
        lses.append(acc[1])
    torch.testing.assert_close(torch.cat(outs, 2), _take(ref.detach(), Q_SEGS), atol=ATOL, rtol=RTOL)
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for qs, out, lse in zip(Q_SEGS, outs, lses, strict=True):
        for ks in K_SEGS:
            grads = blocks.block_backward(
                _take(dout, [qs]), _take(qd, [qs]), _take(kd, [ks]), _take(vd, [ks]), out, lse, qs, ks, causal, scale
            )
            if grads is not None:
                dq.narrow(2, *qs).add_(grads[0])
                dk.narrow(2, *ks).add_(grads[1])
                dv.narrow(2, *ks).add_(grads[2])
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["visible", "diagonal", "partial"])
def test_reference_matches_cpu_flash_op(kind):
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, HEADS, 6, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, HEADS, 6, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    is_causal = kind == "diagonal"
    mask = None
    if kind == "partial":  # queries at 0..5, keys at 3..8
        keep = torch.arange(3, 9)[None, :] <= torch.arange(6)[:, None]
        mask = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, is_causal, attn_mask=mask, scale=0.3)
    ref_out, ref_lse = blocks.reference_forward(q, k, v, is_causal, mask, 0.3)
    torch.testing.assert_close(ref_out, out, atol=ATOL, rtol=RTOL)
    if kind == "partial":
        # queries 0..2 see no key: the reference says lse -inf (what merge needs), the CPU op says 0
        assert torch.isneginf(ref_lse[..., :3]).all() and (lse[..., :3] == 0).all()
        torch.testing.assert_close(ref_lse[..., 3:], lse[..., 3:], atol=ATOL, rtol=RTOL)
    else:
        torch.testing.assert_close(ref_lse, lse, atol=ATOL, rtol=RTOL)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=0.3
    )
    got = blocks.reference_backward(dout, q, k, v, out, lse, is_causal, mask, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)

"""Tests of the flash-attention kernel on blocks placed by global position (context parallelism's pairs).

`attention_block_forward` / `attention_block_backward` run one block of queries against one block of keys with
their first global positions as offsets, return the log-sum-exp, and take the merged output and LSE in the
backward. They are checked against float64 references built from the definition (a mask by global position),
alone and merged over the key blocks of a zig-zag split, and the wiring of `context_parallel.blocks` onto them
against the CPU path it replaces on CUDA.

Tolerance (fp32 inputs): |error| <= 1e-5 * max|expected| + 1e-5 * |expected|, as in test_flash_attention: every
product and sum is IEEE fp32, so the kernel differs from the float64 reference by a few ulps of sums over at
most 96 terms (observed near 1e-6); a wrong offset, a missed block or a row merged with the wrong weight moves
values by the order of the values themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from autopar.context_parallel import blocks
from autopar.triton_kernels.flash_attention import attention_block_backward, attention_block_forward

TOL = 1e-5  # fp32: see the module docstring


def _assert_close(actual, expected, what):
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = TOL * scale if scale > 0 else TOL
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=TOL, msg=lambda m: f"{what}: {m}")


def _reference(q, k, v, q_offset, k_offset, causal, scale):
    """float64 (out, lse) by the definition: query i sees key j when k_offset + j <= q_offset + i (if causal)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        q_pos = torch.arange(q.shape[2]) + q_offset
        k_pos = torch.arange(k.shape[2]) + k_offset
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row with no key: all zero
    return probs @ v, lse


def _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=g)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=g)
    v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=g)
    return q, k, v


# (heads_q, heads_kv, seq_q, seq_k, head_dim, q_offset, k_offset, causal). The interpreter's blocks are 32 queries x
# 16 keys (forward), so the offsets below are not multiples of them: the straddling-block logic runs.
CASES = [
    pytest.param(2, 2, 33, 40, 32, 0, 0, False, id="full"),
    pytest.param(2, 1, 40, 40, 32, 48, 48, True, id="causal-diagonal-gqa"),
    pytest.param(2, 2, 33, 45, 16, 30, 10, True, id="offset-partial"),
    pytest.param(2, 2, 50, 37, 32, 0, 20, True, id="offset-rows-without-keys"),
    pytest.param(4, 2, 24, 24, 16, 72, 0, True, id="offset-all-visible-gqa"),
]


@pytest.mark.parametrize("heads_q, heads_kv, seq_q, seq_k, head_dim, q_offset, k_offset, causal", CASES)
def test_block_forward_and_backward_match_the_definition(
    heads_q, heads_kv, seq_q, seq_k, head_dim, q_offset, k_offset, causal, device
):
    q, k, v = _inputs(1, heads_q, heads_kv, seq_q, seq_k, head_dim, seed=seq_q * 100 + seq_k)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attention_block_forward(
        q.to(device), k.to(device), v.to(device), causal=causal, scale=scale, q_offset=q_offset, k_offset=k_offset
    )
    ref_out, ref_lse = _reference(q, k, v, q_offset, k_offset, causal, scale)
    _assert_close(out.cpu(), ref_out, "out")
    no_keys = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), no_keys), "rows that see no key have lse -inf, the others finite"
    _assert_close(lse.cpu()[~no_keys], ref_lse[~no_keys], "lse")
    if no_keys.any():
        assert out.cpu()[no_keys].abs().max() == 0, "rows that see no key have output 0"

    # backward of the block alone (its own out and lse): float64 autograd of the definition
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = _reference(qd, kd, vd, q_offset, k_offset, causal, scale)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), dout.double())
    grads = attention_block_backward(
        dout.to(device),
        q.to(device),
        k.to(device),
        v.to(device),
        out,
        lse,
        causal=causal,
        scale=scale,
        q_offset=q_offset,
        k_offset=k_offset,
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        _assert_close(got.cpu(), want, name)


@pytest.mark.integration
def test_zigzag_blocks_merge_to_the_whole_attention(device):
    """A rank of a zig-zag split (cp=2, chunks of 24: it holds positions 24-47 and 48-71) runs its two query halves
    against the four key chunks of the sequence: the blocks' outputs merged by their LSE, and their gradients
    (each from the merged out and LSE) summed, equal causal attention over the whole sequence for those rows."""
    seq, chunk, heads_q, heads_kv, head_dim = 96, 24, 4, 2, 16
    q, k, v = _inputs(1, heads_q, heads_kv, seq, seq, head_dim, seed=3)
    scale = 1.0 / math.sqrt(head_dim)
    q_segs = ((chunk, chunk), (2 * chunk, chunk))
    k_segs = tuple((i * chunk, chunk) for i in range(seq // chunk))
    rows = torch.cat([torch.arange(s, s + n) for s, n in q_segs])

    def piece(t, seg):
        return t[:, :, seg[0] : seg[0] + seg[1]].to(device)

    merged = {}
    for q_seg in q_segs:
        part = None
        for k_seg in k_segs:
            if blocks.visibility(q_seg, k_seg, causal=True) == blocks.Visibility.HIDDEN:
                continue
            found = attention_block_forward(
                piece(q, q_seg),
                piece(k, k_seg),
                piece(v, k_seg),
                causal=True,
                scale=scale,
                q_offset=q_seg[0],
                k_offset=k_seg[0],
            )
            part = blocks.merge(part, found)
        merged[q_seg] = part

    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _reference(qd, kd, vd, 0, 0, True, scale)
    _assert_close(torch.cat([merged[s][0] for s in q_segs], dim=2).cpu(), ref_out[:, :, rows].detach(), "out")
    _assert_close(torch.cat([merged[s][1] for s in q_segs], dim=2).cpu(), ref_lse[:, :, rows].detach(), "lse")

    dout = torch.randn(1, heads_q, len(rows), head_dim, generator=torch.Generator().manual_seed(5))
    full_dout = torch.zeros(ref_out.shape, dtype=torch.float64)
    full_dout[:, :, rows] = dout.double()
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out, (qd, kd, vd), full_dout)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for i, q_seg in enumerate(q_segs):
        out_i, lse_i = merged[q_seg]
        do_i = dout[:, :, i * chunk : (i + 1) * chunk].to(device)
        for k_seg in k_segs:
            if blocks.visibility(q_seg, k_seg, causal=True) == blocks.Visibility.HIDDEN:
                continue
            g = attention_block_backward(
                do_i,
                piece(q, q_seg),
                piece(k, k_seg),
                piece(v, k_seg),
                out_i.to(q.dtype),
                lse_i,
                causal=True,
                scale=scale,
                q_offset=q_seg[0],
                k_offset=k_seg[0],
            )
            dq[:, :, q_seg[0] : q_seg[0] + chunk] += g[0].cpu()
            dk[:, :, k_seg[0] : k_seg[0] + chunk] += g[1].cpu()
            dv[:, :, k_seg[0] : k_seg[0] + chunk] += g[2].cpu()
    _assert_close(dq, ref_dq, "dq")
    _assert_close(dk, ref_dk, "dk")
    _assert_close(dv, ref_dv, "dv")


@pytest.mark.parametrize(
    "k_seg", [(0, 20), (40, 20), (30, 20), (70, 20)], ids=["visible", "diagonal", "partial", "hidden"]
)
def test_context_parallel_blocks_run_on_the_kernel_where_it_applies(k_seg, device, monkeypatch):
    """`context_parallel.blocks` sends a pair to the kernel on CUDA; here the kernel runs interpreted on CPU
    tensors (the dispatch is forced) and must give what the CPU path (PyTorch's flash op) gives for each
    visibility, forward and backward from a given out and LSE."""
    q_seg = (40, 20)
    q, k, v = _inputs(1, 4, 2, 20, 20, 16, seed=k_seg[0] + 11)
    scale = 0.25
    cpu = blocks.block_forward(q, k, v, q_seg, k_seg, True, scale)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    cpu_grads = None if cpu is None else blocks.block_backward(dout, q, k, v, *cpu, q_seg, k_seg, True, scale)
    monkeypatch.setattr(blocks, "runs_on_kernel", lambda t: True)
    moved = [t.to(device) for t in (q, k, v)]
    kernel = blocks.block_forward(*moved, q_seg, k_seg, True, scale)
    if cpu is None:
        assert kernel is None, "a hidden pair is skipped before any kernel runs"
        return
    _assert_close(kernel[0].cpu(), cpu[0], "out")
    _assert_close(kernel[1].cpu(), cpu[1], "lse")
    grads = blocks.block_backward(
        dout.to(device), *moved, cpu[0].to(device), cpu[1].to(device), q_seg, k_seg, True, scale
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, cpu_grads, strict=True):
        _assert_close(got.cpu(), want, name)


def test_cpu_tensors_keep_pytorchs_path():
    """Without the forced dispatch a CPU pair never reaches the kernel (nor loads it interpreted)."""
    assert not blocks.runs_on_kernel(torch.zeros(1, 1, 4, 8))
    assert not blocks.runs_on_kernel(torch.zeros(1, 1, 4, 8, device="meta"))

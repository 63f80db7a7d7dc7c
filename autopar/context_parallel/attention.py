"""Attention across a context-parallel (cp) group: each rank holds a shard of the sequence of q, k and v.

``cp_attention(q, k, v, group=..., causal=..., layout=..., algorithm=...)`` returns this rank's shard of
``softmax(scale · Q Kᵀ) V`` over the *whole* sequence, with SDPA's semantics (causal by global position,
grouped-query attention when k and v have fewer heads). Inputs are ``(batch, heads, local_seq, head_dim)`` in
the layout of `autopar.context_parallel.layout` (zig-zag or contiguous). Three algorithms, each an
``autograd.Function`` whose backward runs the mirror-image communication:

* ``allgather``: queries stay split; K and V (stacked, one tensor) are all-gathered in the forward, and their
  gradients reduce-scattered in the backward. One all-gather forward, one reduce-scatter backward. The
  gathered K/V are kept for the backward (cp times the local K/V).
* ``ring``: the K/V block travels around the group (rank r sends to r+1, receives from r-1) while each rank
  attends to the block it holds and merges the partial results by their log-sum-exp. The next block's
  transfer is posted before the current block's compute, so they overlap. Forward: cp-1 sends. Backward: the
  K/V blocks travel again (cp-1 sends), and the dK/dV of each block travels with it, gaining each rank's
  contribution, to arrive home after cp-1 hops (cp-1 more sends).
* ``alltoall`` (DeepSpeed-Ulysses): one all-to-all turns q, k, v from sequence-split to head-split, each
  rank runs ordinary attention on the whole sequence for heads/cp heads, one all-to-all turns the output
  back; the backward mirrors both. The cp degree must divide the query heads; key/value heads are repeated
  up to a multiple of the degree when it does not divide them.

Block attention (per pair of sequence segments, masked by global position) is in
`autopar.context_parallel.blocks`. This increment is an ``autograd.Function`` per algorithm, not a
``torch.library`` custom op: a custom op's autograd may save only its inputs and outputs, and the all-gather
algorithm's backward needs the gathered K/V (re-gathering would add a collective), so export/meta tracing
would see the collectives inside it rather than one node.

Every wait is bounded, through the one timeout wrapper (`autopar.runtime.collectives.waiting_for`, the
`AUTOPAR_COLLECTIVE_TIMEOUT_S` limit): a rank whose peers stopped or called another collective fails with an
error naming its rank and the collective instead of hanging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from autopar import compat
from autopar.context_parallel import blocks
from autopar.context_parallel.layout import Segment, SequenceLayout, check_cp_sequence, layout_order, rank_segments
from autopar.errors import ConfigError, LoweringError

__all__ = ["CPAlgorithm", "check_cp_attention", "cp_attention"]

_KV_TAG, _DKV_TAG = 0, 1 << 16  # ring message tags: K/V blocks and travelling dK/dV never match each other


class CPAlgorithm(StrEnum):
    ALL_GATHER = "allgather"
    RING = "ring"
    ALL_TO_ALL = "alltoall"


@dataclass(frozen=True, slots=True)
class CPGroup:
    """A cp process group as the algorithms see it: this rank, the group size, every rank's segments."""

    group: dist.ProcessGroup
    rank: int
    num_ranks: int
    segments: tuple[tuple[Segment, ...], ...]

    def global_rank(self, offset: int) -> int:
        """Global rank of the group member `offset` places after this one around the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.num_ranks)

    def wait(self, work, what: str) -> None:
        from autopar.runtime.collectives import collective_timeout, waiting_for  # the runtime imports this module

        try:
            with waiting_for(f"context-parallel attention's {what} (cp rank {self.rank} of {self.num_ranks})"):
                work.wait(timeout=collective_timeout())
        except LoweringError:
            raise
        except RuntimeError as e:
            raise LoweringError(
                f"context-parallel attention: cp rank {self.rank} of {self.num_ranks}: {what} did not complete "
                f"({e}); every rank of the cp group must call cp_attention with the same algorithm and shapes"
            ) from e


def check_cp_attention(
    q: Tensor, k: Tensor, v: Tensor, num_ranks: int, layout: SequenceLayout | str, algorithm: CPAlgorithm | str
) -> tuple[SequenceLayout, CPAlgorithm]:
    """Raise :class:`ConfigError` unless q, k, v shards fit `algorithm` over `num_ranks` ranks in `layout`."""
    try:
        algorithm = CPAlgorithm(algorithm)
    except ValueError:
        raise ConfigError(
            f"unknown context-parallel attention algorithm {algorithm!r}: expected one of "
            f"{[a.value for a in CPAlgorithm]}"
        ) from None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ConfigError(
                f"cp_attention: {name} must be a 4-D tensor (batch, heads, local_seq, head_dim), "
                f"got {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
            )
    if k.shape != v.shape or not q.dtype == k.dtype == v.dtype:
        raise ConfigError(
            f"cp_attention: k and v must match in shape and dtype with q's dtype, got q {q.dtype}, "
            f"k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}"
        )
    (batch, heads_q, local_seq, head_dim), (batch_k, heads_kv, local_seq_k, head_dim_k) = q.shape, k.shape
    if (batch, local_seq, head_dim) != (batch_k, local_seq_k, head_dim_k):
        raise ConfigError(
            f"cp_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, local "
            "sequence and head_dim (self-attention over one sequence)"
        )
    if heads_kv < 1 or heads_q % heads_kv:
        raise ConfigError(
            f"cp_attention: the {heads_q} query heads must be a multiple of the {heads_kv} key/value "
            "heads (grouped-query attention)"
        )
    check_cp_sequence(local_seq * num_ranks, num_ranks, layout)
    if algorithm == CPAlgorithm.ALL_TO_ALL and heads_q % num_ranks:
        divisors = [d for d in range(1, heads_q + 1) if heads_q % d == 0]
        raise ConfigError(
            f"all-to-all (Ulysses) context parallelism splits the {heads_q} query heads over the cp degree "
            f"{num_ranks}, which does not divide them. Use algorithm='ring' or 'allgather', or a cp degree among "
            f"{divisors}."
        )
    return SequenceLayout(layout), algorithm


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    layout: SequenceLayout | str = SequenceLayout.ZIGZAG,
    algorithm: CPAlgorithm | str = CPAlgorithm.ALL_GATHER,
    scale: float | None = None,
) -> Tensor:
    """This rank's shard of attention over the whole sequence split across the cp `group`.

    Args:
        q: this rank's queries, ``(batch, heads_q, local_seq, head_dim)``, its tokens in `layout` order.
        k: this rank's keys, ``(batch, heads_kv, local_seq, head_dim)``; ``heads_q % heads_kv == 0``.
        v: this rank's values, same shape as `k`.
        group: the cp process group (default: the world); every member calls with the same arguments.
        causal: query at global position i attends to keys at global positions <= i.
        layout: "zigzag" (rank r holds chunks r and 2·cp-1-r of 2·cp) or "contiguous" (chunk r of cp).
        algorithm: "allgather", "ring" or "alltoall" (see the module docstring).
        scale: multiplier of ``q @ kᵀ``; None means ``1 / sqrt(head_dim)``.

    Returns:
        ``(batch, heads_q, local_seq, head_dim)``, this rank's rows of the output; differentiable in q, k, v.

    Raises:
        autopar.errors.ConfigError: shapes, layout or algorithm that do not fit the group.
    """
    group = group if group is not None else dist.group.WORLD
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    layout, algorithm = check_cp_attention(q, k, v, num_ranks, layout, algorithm)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    causal = bool(causal)
    if num_ranks == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    seq_len = q.shape[2] * num_ranks
    segments = tuple(rank_segments(seq_len, num_ranks, r, layout) for r in range(num_ranks))
    cp = CPGroup(group, rank, num_ranks, segments)
    if algorithm == CPAlgorithm.ALL_GATHER:
        return _AllGatherAttention.apply(q, k, v, cp, causal, scale)
    if algorithm == CPAlgorithm.RING:
        return _RingAttention.apply(q, k, v, cp, causal, scale)
    return _ulysses_attention(q, k, v, cp, layout, causal, scale)


# ----------------------------------------------------------------------------------------------------------------
# Local work shared by all-gather and ring: this rank's queries against one rank's K/V block
# ----------------------------------------------------------------------------------------------------------------


def _pieces(x: Tensor, segs: tuple[Segment, ...]):
    """``(segment, slice of x along dim 2)`` for each segment stored in x.

    Dim 2 is the sequence of q, k, v ``(batch, heads, seq, head_dim)`` and of the LSE ``(batch, heads, seq)``.
    """
    offset = 0
    for seg in segs:
        yield seg, x.narrow(2, offset, seg[1])
        offset += seg[1]


class _Partial:
    """Running output and LSE of each query segment, merged over K/V blocks (the online softmax)."""

    def __init__(self, q: Tensor, q_segs: tuple[Segment, ...], causal: bool, scale: float):
        self.q, self.q_segs, self.causal, self.scale = q, q_segs, causal, scale
        self.parts: list[tuple[Tensor, Tensor] | None] = [None] * len(q_segs)

    def add(self, k: Tensor, v: Tensor, k_segs: tuple[Segment, ...]) -> None:
        for i, (q_seg, q_i) in enumerate(_pieces(self.q, self.q_segs)):
            for (k_seg, k_j), (_, v_j) in zip(_pieces(k, k_segs), _pieces(v, k_segs), strict=True):
                found = blocks.block_forward(q_i, k_j, v_j, q_seg, k_seg, self.causal, self.scale)
                if found is not None:
                    self.parts[i] = blocks.merge(self.parts[i], found)

    def result(self) -> tuple[Tensor, Tensor]:
        # every query segment meets at least its own diagonal block, causal or not
        assert all(p is not None for p in self.parts)
        out = torch.cat([p[0] for p in self.parts], dim=2).to(self.q.dtype)
        return out, torch.cat([p[1] for p in self.parts], dim=2)


def _block_grads(
    dout: Tensor,
    q: Tensor,
    out: Tensor,
    lse: Tensor,
    q_segs,
    k: Tensor,
    v: Tensor,
    k_segs,
    causal: bool,
    scale: float,
    dq: Tensor,
) -> Tensor:
    """Add this K/V block's share of dq into `dq`; return the block's stacked ``(dk, dv)``."""
    dk = torch.zeros(k.shape, dtype=dq.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dq.dtype, device=v.device)
    q_parts = zip(
        _pieces(q, q_segs),
        _pieces(dout, q_segs),
        _pieces(out, q_segs),
        _pieces(lse, q_segs),
        _pieces(dq, q_segs),
        strict=True,
    )
    for (q_seg, q_i), (_, do_i), (_, o_i), (_, l_i), (_, dq_i) in q_parts:
        for (k_seg, k_j), (_, v_j), (_, dk_j), (_, dv_j) in zip(
            _pieces(k, k_segs), _pieces(v, k_segs), _pieces(dk, k_segs), _pieces(dv, k_segs), strict=True
        ):
            grads = blocks.block_backward(do_i, q_i, k_j, v_j, o_i, l_i, q_seg, k_seg, causal, scale)
            if grads is not None:
                dq_i += grads[0]
                dk_j += grads[1]
                dv_j += grads[2]
    return torch.stack((dk, dv)).to(k.dtype)


# ----------------------------------------------------------------------------------------------------------------
# All-gather K/V
# ----------------------------------------------------------------------------------------------------------------


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp: CPGroup, causal: bool, scale: float) -> Tensor:
        kv = torch.stack((k, v))
        # gloo gathers along dim 0 only: (n·2, ...) holds rank r's k at 2r and v at 2r+1
        gathered = kv.new_empty((cp.num_ranks * 2, *kv.shape[1:]))
        cp.wait(compat.all_gather_single(gathered, kv, group=cp.group, async_op=True), "all-gather of K/V")
        gathered = gathered.unflatten(0, (cp.num_ranks, 2))
        partial = _Partial(q, cp.segments[cp.rank], causal, scale)
        for r in range(cp.num_ranks):
            partial.add(gathered[r, 0], gathered[r, 1], cp.segments[r])
        out, lse = partial.result()
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, gathered, out, lse = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=blocks.accumulation_dtype(q.dtype), device=q.device)
        q_segs = cp.segments[cp.rank]
        dkv = torch.stack(
            [
                _block_grads(
                    dout, q, out, lse, q_segs, gathered[r, 0], gathered[r, 1], cp.segments[r], ctx.causal, ctx.scale, dq
                )
                for r in range(cp.num_ranks)
            ]
        )
        from autopar.runtime.collectives import issue_reduce_scatter  # the runtime imports this module

        # into a tensor of its own: a view of the summed stack would keep every rank's row alive with the gradients
        local = dkv.new_empty(dkv.shape[1:])
        cp.wait(issue_reduce_scatter(dkv, cp.group, out=local), "reduce-scatter of dK/dV")
        return dq.to(q.dtype), local[0], local[1], None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Ring
# ----------------------------------------------------------------------------------------------------------------


def _pass_on(cp: CPGroup, send: Tensor, recv: Tensor, tag: int) -> list:
    """Send `send` to the next rank and receive `recv` from the previous one, asynchronously."""
    return [
        dist.isend(send, cp.global_rank(1), group=cp.group, tag=tag),
        dist.irecv(recv, cp.global_rank(-1), group=cp.group, tag=tag),
    ]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp: CPGroup, causal: bool, scale: float) -> Tensor:
        current = torch.stack((k, v))
        partial = _Partial(q, cp.segments[cp.rank], causal, scale)
        for step in range(cp.num_ranks):
            if step < cp.num_ranks - 1:
                incoming = torch.empty_like(current)
                works = _pass_on(cp, current, incoming, _KV_TAG + step)
            partial.add(current[0], current[1], cp.segments[(cp.rank - step) % cp.num_ranks])
            if step < cp.num_ranks - 1:
                for w in works:
                    cp.wait(w, f"ring step {step}: K/V block exchange")
                current = incoming
        out, lse = partial.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        n, dout = cp.num_ranks, dout.contiguous()
        dq = torch.zeros(q.shape, dtype=blocks.accumulation_dtype(q.dtype), device=q.device)
        current, own, sends = torch.stack((k, v)), None, []
        for step in range(n):
            if step < n - 1:
                incoming = torch.empty_like(current)
                kv_works = _pass_on(cp, current, incoming, _KV_TAG + step)
            if step >= 2:  # the dK/dV of the block held now, summed by the ranks that held it before
                travelling = torch.empty_like(current)
                recv = dist.irecv(travelling, cp.global_rank(-1), group=cp.group, tag=_DKV_TAG + step)
            src = (cp.rank - step) % n
            dkv = _block_grads(
                dout,
                q,
                out,
                lse,
                cp.segments[cp.rank],
                current[0],
                current[1],
                cp.segments[src],
                ctx.causal,
                ctx.scale,
                dq,
            )
            if step == 0:
                own = dkv  # this rank's block: its share waits here for the others'
            else:
                if step >= 2:
                    cp.wait(recv, f"ring backward step {step}: receiving dK/dV")
                    dkv = dkv + travelling
                sends.append(dist.isend(dkv, cp.global_rank(1), group=cp.group, tag=_DKV_TAG + step + 1))
            if step < n - 1:
                for w in kv_works:
                    cp.wait(w, f"ring backward step {step}: K/V block exchange")
                current = incoming
        home = torch.empty_like(own)
        cp.wait(dist.irecv(home, cp.global_rank(-1), group=cp.group, tag=_DKV_TAG + n), "ring backward: final dK/dV")
        for w in sends:
            cp.wait(w, "ring backward: sending dK/dV")
        dkv = own + home
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None


# ----------------------------------------------------------------------------------------------------------------
# All-to-all (Ulysses)
# ----------------------------------------------------------------------------------------------------------------


def _seq_to_heads(tensors: tuple[Tensor, ...], cp: CPGroup, order: Tensor) -> tuple[Tensor, ...]:
    """Sequence-split ``(b, h, s/n, d)`` tensors to head-split ``(b, h/n, s, d)`` in natural order: one all-to-all."""
    n = cp.num_ranks
    # piece j of every tensor (its j-th group of heads) goes to rank j; all tensors travel in one buffer
    send = torch.cat([t.unflatten(1, (n, t.shape[1] // n)).movedim(1, 0).reshape(n, -1) for t in tensors], dim=1)
    recv = torch.empty_like(send)
    cp.wait(dist.all_to_all_single(recv, send.contiguous(), group=cp.group, async_op=True), "all-to-all seq->heads")
    out, offset, inverse = [], 0, torch.argsort(order).to(recv.device)
    for t in tensors:
        b, h, s, d = t.shape
        size = b * (h // n) * s * d
        piece = recv[:, offset : offset + size].reshape(n, b, h // n, s, d)  # piece j: rank j's tokens
        offset += size
        out.append(piece.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d).index_select(2, inverse))
    return tuple(out)


def _heads_to_seq(tensors: tuple[Tensor, ...], cp: CPGroup, order: Tensor) -> tuple[Tensor, ...]:
    """Head-split ``(b, h/n, s, d)`` tensors in natural order back to sequence-split ``(b, h, s/n, d)``."""
    n = cp.num_ranks
    order = order.to(tensors[0].device)
    # in layout order, piece j of the sequence is rank j's tokens
    send = torch.cat(
        [
            t.index_select(2, order).unflatten(2, (n, t.shape[2] // n)).permute(2, 0, 1, 3, 4).reshape(n, -1)
            for t in tensors
        ],
        dim=1,
    )
    recv = torch.empty_like(send)
    cp.wait(dist.all_to_all_single(recv, send.contiguous(), group=cp.group, async_op=True), "all-to-all heads->seq")
    out, offset = [], 0
    for t in tensors:
        b, h, s, d = t.shape
        size = b * h * (s // n) * d
        piece = recv[:, offset : offset + size].reshape(n, b, h, s // n, d)  # piece j: rank j's heads
        offset += size
        out.append(piece.movedim(0, 1).reshape(b, n * h, s // n, d))
    return tuple(out)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp: CPGroup, order: Tensor, *tensors: Tensor):
        ctx.cp, ctx.order = cp, order
        return _seq_to_heads(tensors, cp, order)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, *_heads_to_seq(tuple(g.contiguous() for g in grads), ctx.cp, ctx.order))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp: CPGroup, order: Tensor, *tensors: Tensor):
        ctx.cp, ctx.order = cp, order
        return _heads_to_seq(tensors, cp, order)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, *_seq_to_heads(tuple(g.contiguous() for g in grads), ctx.cp, ctx.order))


def _ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: CPGroup, layout: SequenceLayout, causal: bool, scale: float
) -> Tensor:
    n, heads_kv = cp.num_ranks, k.shape[1]
    if heads_kv % n:
        # repeat each key/value head so that the count is a multiple of n (lcm(heads_kv, n) divides heads_q, as
        # both do); autograd sums the repeats' gradients back
        repeat = math.lcm(heads_kv, n) // heads_kv
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    order = layout_order(q.shape[2] * n, n, layout)
    qh, kh, vh = _SeqToHeads.apply(cp, order, q, k, v)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=True)
    (out,) = _HeadsToSeq.apply(cp, order, out)
    return out

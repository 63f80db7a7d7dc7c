"""Where the tokens of a sequence live when a context-parallel (cp) group of `num_ranks` ranks splits it.

Two layouts of a sequence of length S:

* contiguous: S is cut into `num_ranks` chunks; rank r holds chunk r, positions ``[r·S/n, (r+1)·S/n)``.
  Under a causal mask the last rank's queries see every key and the first rank's only their own chunk, so
  the busiest rank does (2n-1)/n times the average work.
* zig-zag: S is cut into 2n chunks; rank r holds chunks r and 2n-1-r, in that order. Every rank then holds
  one early and one late chunk, and causal attention costs every rank the same.

A rank's tokens are described by its *segments*: ``(start, length)`` runs of consecutive global positions,
in the order the rank stores them (one segment for contiguous, two for zig-zag). The causal mask and
rotary embeddings need global positions, never the local index. Terms: `dim` is the tensor dimension that
holds the sequence; ranks are numbered within the cp group.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch
from torch import Tensor

from autopar.errors import ConfigError

Segment = tuple[int, int]  # (first global position, number of positions)


class SequenceLayout(StrEnum):
    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


def num_chunks(num_ranks: int, layout: SequenceLayout | str) -> int:
    """Chunks the sequence is cut into: 2·num_ranks for zig-zag, num_ranks for contiguous."""
    return 2 * num_ranks if SequenceLayout(layout) == SequenceLayout.ZIGZAG else num_ranks


def check_cp_sequence(seq_len: int, num_ranks: int, layout: SequenceLayout | str) -> None:
    """Raise :class:`ConfigError` unless a sequence of `seq_len` tokens splits evenly in `layout` over `num_ranks`."""
    layout = _coerce_layout(layout)
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"a context-parallel group needs at least one rank, got num_ranks={num_ranks!r}")
    chunks = num_chunks(num_ranks, layout)
    if seq_len < 1 or seq_len % chunks:
        padded = max(chunks, -(-seq_len // chunks) * chunks)
        how = f"2·cp = {chunks} zig-zag chunks" if layout == SequenceLayout.ZIGZAG else f"cp = {chunks} chunks"
        raise ConfigError(
            f"context parallelism over {num_ranks} ranks in the {layout} layout cuts the sequence into {how}, "
            f"but the sequence length {seq_len} is not a multiple of {chunks}. Pad the sequence to {padded} tokens "
            f"(and mask the padding out of the loss), or choose a cp degree whose "
            f"{'2·cp' if layout == SequenceLayout.ZIGZAG else 'cp'} divides {seq_len}."
        )


def rank_segments(seq_len: int, num_ranks: int, rank: int, layout: SequenceLayout | str) -> tuple[Segment, ...]:
    """The ``(start, length)`` runs of global positions rank `rank` holds, in its storage order.

    Args:
        seq_len: tokens in the whole sequence.
        num_ranks: ranks of the cp group.
        rank: this rank's index within the cp group.
        layout: "zigzag" or "contiguous".
    """
    layout = _coerce_layout(layout)
    check_cp_sequence(seq_len, num_ranks, layout)
    if not 0 <= rank < num_ranks:
        raise ConfigError(f"rank {rank} is not in a context-parallel group of {num_ranks} ranks")
    chunk = seq_len // num_chunks(num_ranks, layout)
    if layout == SequenceLayout.CONTIGUOUS:
        return ((rank * chunk, chunk),)
    return ((rank * chunk, chunk), ((2 * num_ranks - 1 - rank) * chunk, chunk))


def token_positions(
    seq_len: int, num_ranks: int, rank: int, layout: SequenceLayout | str, *, device: torch.device | str | None = None
) -> Tensor:
    """Global positions (int64, length seq_len / num_ranks) of the tokens rank `rank` holds, in storage order.

    Rotary embeddings and position embeddings index with these; so does a causal mask.
    """
    segs = rank_segments(seq_len, num_ranks, rank, layout)
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in segs])


def layout_order(seq_len: int, num_ranks: int, layout: SequenceLayout | str) -> Tensor:
    """Global positions in the order of rank 0's tokens, then rank 1's, ...: ``cat(shards)[i]`` is position ``order[i]``."""
    return torch.cat([token_positions(seq_len, num_ranks, r, layout) for r in range(num_ranks)])


def shard_sequence(x: Tensor, dim: int, num_ranks: int, rank: int, layout: SequenceLayout | str) -> Tensor:
    """This rank's share of `x` along the sequence dim `dim` (a copy, contiguous), in storage order.

    Args:
        x: the whole sequence, e.g. ``(batch, seq)`` token ids or ``(batch, heads, seq, head_dim)``.
        dim: the sequence dimension of `x`.
        num_ranks, rank, layout: as in :func:`rank_segments`.
    """
    segs = rank_segments(x.shape[dim], num_ranks, rank, layout)
    return torch.cat([x.narrow(dim, start, n) for start, n in segs], dim=dim).contiguous()


def unshard_sequence(shards: Sequence[Tensor], dim: int, layout: SequenceLayout | str) -> Tensor:
    """The whole sequence back from every rank's share (``shards[r]`` from rank r), in natural order."""
    num_ranks = len(shards)
    if num_ranks < 1:
        raise ConfigError("unshard_sequence needs the shards of at least one rank")
    seq_len = sum(s.shape[dim] for s in shards)
    joined = torch.cat(list(shards), dim=dim)
    inverse = torch.argsort(layout_order(seq_len, num_ranks, layout)).to(joined.device)
    return joined.index_select(dim, inverse)


def _coerce_layout(layout: SequenceLayout | str) -> SequenceLayout:
    try:
        return SequenceLayout(layout)
    except ValueError:
        raise ConfigError(
            f"unknown context-parallel layout {layout!r}: expected one of {[v.value for v in SequenceLayout]}"
        ) from None

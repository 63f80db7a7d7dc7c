"""Context parallelism: a sequence split over the ranks of a cp group, and attention across that group.

`layout` places the tokens of a sequence on the ranks (zig-zag or contiguous chunks) and says which global
positions each rank holds; `attention` computes attention of this rank's queries against the whole
sequence's keys and values by one of three algorithms (all-gather K/V, ring, all-to-all).
"""

from autopar.context_parallel.attention import CPAlgorithm, cp_attention
from autopar.context_parallel.layout import (
    SequenceLayout,
    check_cp_sequence,
    layout_order,
    rank_segments,
    shard_sequence,
    token_positions,
    unshard_sequence,
)

__all__ = [
    "CPAlgorithm",
    "SequenceLayout",
    "check_cp_sequence",
    "cp_attention",
    "layout_order",
    "rank_segments",
    "shard_sequence",
    "token_positions",
    "unshard_sequence",
]

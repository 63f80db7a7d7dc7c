"""Zig-zag and contiguous sequence layouts over a cp group, against hand-written placements."""

from __future__ import annotations

import pytest
import torch

from autopar.context_parallel import (
    check_cp_sequence,
    layout_order,
    rank_segments,
    shard_sequence,
    token_positions,
    unshard_sequence,
)
from autopar.errors import ConfigError


def test_zigzag_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    # 16 tokens over 4 ranks: 8 chunks of 2; rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4
    assert rank_segments(16, 4, 0, "zigzag") == ((0, 2), (14, 2))
    assert rank_segments(16, 4, 3, "zigzag") == ((6, 2), (8, 2))
    assert token_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]


def test_contiguous_rank_holds_chunk_r():
    assert rank_segments(12, 3, 2, "contiguous") == ((8, 4),)
    assert token_positions(12, 3, 1, "contiguous").tolist() == [4, 5, 6, 7]


def test_zigzag_balances_causal_work():
    # causal work of a rank = sum over its query positions p of (p + 1) visible keys
    for n in (2, 4, 8):
        work = [int((token_positions(8 * n, n, r, "zigzag") + 1).sum()) for r in range(n)]
        assert len(set(work)) == 1, work
        contiguous = [int((token_positions(8 * n, n, r, "contiguous") + 1).sum()) for r in range(n)]
        # the last contiguous rank does (2n-1)/n of the average, up to the diagonal's half block
        assert max(contiguous) > sum(contiguous) / n * (2 * n - 1) / n * 0.9


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_and_unshard_round_trip(layout):
    x = torch.arange(2 * 3 * 24).reshape(2, 3, 24)
    shards = [shard_sequence(x, 2, 4, r, layout) for r in range(4)]
    for r, s in enumerate(shards):
        assert s.shape == (2, 3, 6)
        assert torch.equal(s[0, 0], token_positions(24, 4, r, layout))  # x[0, 0] is the position itself
    assert torch.equal(unshard_sequence(shards, 2, layout), x)
    assert sorted(layout_order(24, 4, layout).tolist()) == list(range(24))


def test_length_that_does_not_divide_says_what_to_do():
    with pytest.raises(ConfigError, match=r"2·cp = 8 zig-zag chunks.*length 1002.*Pad the sequence to 1008"):
        check_cp_sequence(1002, 4, "zigzag")
    with pytest.raises(ConfigError, match=r"not a multiple of 3"):
        check_cp_sequence(10, 3, "contiguous")
    check_cp_sequence(12, 4, "contiguous")  # contiguous needs cp | S only; zig-zag would need 8 | 12
    with pytest.raises(ConfigError, match=r"not a multiple of 8"):
        check_cp_sequence(12, 4, "zigzag")
    with pytest.raises(ConfigError, match="unknown context-parallel layout"):
        rank_segments(16, 2, 0, "striped")
    with pytest.raises(ConfigError, match="rank 2 is not in"):
        rank_segments(16, 2, 2, "zigzag")

"""cp_attention's input checks: what a user can get wrong is a ConfigError that says what to do."""

from __future__ import annotations

import pytest
import torch

from autopar.context_parallel.attention import CPAlgorithm, check_cp_attention
from autopar.errors import ConfigError


def _qkv(heads=4, kv_heads=2, local_seq=6):
    return (
        torch.zeros(1, heads, local_seq, 8),
        torch.zeros(1, kv_heads, local_seq, 8),
        torch.zeros(1, kv_heads, local_seq, 8),
    )


def test_all_to_all_degree_must_divide_the_query_heads():
    q, k, v = _qkv(heads=6, kv_heads=2)
    with pytest.raises(ConfigError, match=r"splits the 6 query heads over the cp degree 4.*'ring'.*\[1, 2, 3, 6\]"):
        check_cp_attention(q, k, v, 4, "zigzag", "alltoall")
    assert check_cp_attention(q, k, v, 4, "zigzag", "ring")[1] == CPAlgorithm.RING  # ring takes any head count


def test_fewer_kv_heads_than_the_degree_is_accepted():
    q, k, v = _qkv(heads=4, kv_heads=1)
    check_cp_attention(q, k, v, 4, "zigzag", "alltoall")  # the key/value head is repeated, not an error


def test_shapes_layout_and_algorithm():
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="unknown context-parallel attention algorithm"):
        check_cp_attention(q, k, v, 2, "zigzag", "tree")
    with pytest.raises(ConfigError, match="4-D"):
        check_cp_attention(q[0], k, v, 2, "zigzag", "ring")
    with pytest.raises(ConfigError, match="multiple of the 3 key/value heads"):
        check_cp_attention(q, *_qkv(kv_heads=3)[1:], 2, "zigzag", "ring")
    with pytest.raises(ConfigError, match="must agree"):
        check_cp_attention(q, *_qkv(local_seq=4)[1:], 2, "zigzag", "ring")
    q, k, v = _qkv(local_seq=5)  # 5 local tokens: 2 ranks hold 10, not a multiple of 2·cp = 4
    with pytest.raises(ConfigError, match="Pad the sequence to 12"):
        check_cp_attention(q, k, v, 2, "zigzag", "allgather")
    check_cp_attention(q, k, v, 2, "contiguous", "allgather")

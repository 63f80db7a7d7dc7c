"""Context-parallel attention costs against hand computation, one formula at a time."""

from __future__ import annotations

import pytest

from autopar.context_parallel import CPAlgorithm
from autopar.cost_model.context_parallel import (
    CPAttentionShape,
    attention_time_from_device,
    estimate_cp_attention,
    estimate_cp_attention_all,
    load_balance_factor,
)
from autopar.cost_model.devices import LinkSpec, get_device
from autopar.errors import ConfigError

LINK = LinkSpec("test", bandwidth_bytes_per_s=1e9, latency_s=1e-6)
# 8 query heads, 2 key/value heads, 4096 tokens, head dim 128, bf16: K and V together are 2·2·4096·128·2 B
SHAPE = CPAttentionShape(batch=1, heads=8, kv_heads=2, seq_len=4096, head_dim=128, bytes_per_element=2)
KV = 4_194_304
# one (S/4 x S/4) block of 8 heads: 1e-12 s per b·h·q·k·d = 1e-12 · 8·1024·1024·128
BLOCK = 1.073741824e-3


def block_time(batch, heads, queries, keys, head_dim):
    return 1e-12 * batch * heads * queries * keys * head_dim


def _cost(algorithm, causal=True, layout="zigzag", link=LINK, c=4):
    return estimate_cp_attention(
        SHAPE, c, causal=causal, layout=layout, algorithm=algorithm, link=link, compute=block_time
    )


def test_load_balance_factor():
    assert load_balance_factor(4, True, "contiguous") == pytest.approx(7 / 4)
    assert load_balance_factor(4, True, "zigzag") == 1.0
    assert load_balance_factor(4, False, "contiguous") == 1.0
    assert SHAPE.kv_bytes == KV


def test_all_gather_hand_computed():
    gather = 3e-6 + 0.75 * KV / 1e9  # 3 ring steps; (c-1)/c of the whole K/V through each link
    cost = _cost(CPAlgorithm.ALL_GATHER, causal=False)
    assert cost.compute_forward_s == pytest.approx(4 * BLOCK)  # 4 blocks of (S/4 x S/4), nothing masked
    assert cost.forward_s == pytest.approx(4 * BLOCK + gather)
    assert cost.backward_s == pytest.approx(2.5 * 4 * BLOCK + gather)  # the reduce-scatter prices as the gather
    assert cost.exposed_comm_s == pytest.approx(2 * gather)
    assert (cost.saved_bytes, cost.peak_extra_bytes) == (KV, 2 * KV)  # gathered K/V, then whole dK/dV too
    # contiguous causal: half the scores, and the last rank does 7/4 of the average
    assert _cost(CPAlgorithm.ALL_GATHER, layout="contiguous").compute_forward_s == pytest.approx(1.75 * 0.5 * 4 * BLOCK)
    assert _cost(CPAlgorithm.ALL_GATHER, layout="zigzag").compute_forward_s == pytest.approx(0.5 * 4 * BLOCK)


def test_ring_bound_by_transfers_hand_computed():
    cost = _cost(CPAlgorithm.RING)  # causal zig-zag
    hop = 1e-6 + KV / 4 / 1e9  # 1.049576e-3 s: one rank's K/V block, one step
    step_f, step_b = 0.5 * BLOCK, 2.5 * 0.5 * BLOCK  # 0.537e-3 and 1.342e-3 s per step
    assert cost.forward_s == pytest.approx(3 * hop + step_f)  # 3 steps wait for their block, the last computes
    # backward steps overlap 1, 1, 2, 1 hops (K/V; K/V + dK/dV; dK/dV), then the last dK/dV hop home
    assert cost.backward_s == pytest.approx(3 * step_b + 2 * hop + hop)
    assert cost.comm_s == pytest.approx(9 * hop)  # 3 hops forward, 6 backward
    assert (cost.saved_bytes, cost.peak_extra_bytes) == (0.0, KV)  # four blocks of KV/4 in the backward


def test_ring_hides_transfers_behind_compute():
    fast = LinkSpec("fast", bandwidth_bytes_per_s=1e12, latency_s=0.0)
    cost = _cost(CPAlgorithm.RING, link=fast)
    hop = KV / 4 / 1e12
    assert cost.forward_s == pytest.approx(4 * 0.5 * BLOCK)
    assert cost.exposed_comm_s == pytest.approx(hop)  # only the last dK/dV hop, after the last compute


def test_all_to_all_hand_computed():
    cost = _cost(CPAlgorithm.ALL_TO_ALL, layout="contiguous")
    # 2 key/value heads over 4 ranks: repeated to lcm(2, 4) = 4. q, k', v': 8 + 4 + 4 heads of 4096·128·2 B
    qkv, out = 16 * 4096 * 128 * 2, 8 * 4096 * 128 * 2
    a2a = 3e-6 + 3 / 16 * qkv / 1e9 + 3e-6 + 3 / 16 * out / 1e9  # (c-1)/c² of each whole tensor
    compute = 0.5 * 1e-12 * 2 * 4096 * 4096 * 128  # 2 heads, the whole sequence, causal: no imbalance
    assert cost.compute_forward_s == pytest.approx(compute)
    assert cost.forward_s == pytest.approx(compute + a2a)
    assert cost.backward_s == pytest.approx(2.5 * compute + a2a)
    assert cost.saved_bytes == pytest.approx((qkv + out) / 4)
    assert cost.peak_extra_bytes == pytest.approx((qkv + out) / 4 + 2 * qkv / 4)


def test_device_roofline_block_time():
    # the blocks run autopar's Triton kernel: on an A100 at FlashAttention-2's 73% forward and 63% backward
    device = get_device("A100-80GB")
    t = attention_time_from_device(device, "bf16")
    rate = device.peak_matmul_flops("bf16") * 0.73
    assert t(1, 8, 1024, 1024, 128) == pytest.approx(4 * 8 * 1024 * 1024 * 128 / rate + device.kernel_overhead_s)
    cost = estimate_cp_attention(
        SHAPE, 4, causal=False, layout="zigzag", algorithm="allgather", link=LINK, compute=device
    )
    assert cost.compute_forward_s == pytest.approx(4 * t(1, 8, 1024, 1024, 128))
    assert cost.compute_backward_s == pytest.approx(2.5 * 0.73 / 0.63 * cost.compute_forward_s)


def test_one_rank_costs_no_communication():
    for cost in estimate_cp_attention_all(
        SHAPE, 1, causal=True, layout="zigzag", link=LINK, compute=block_time
    ).values():
        assert cost.comm_s == 0.0 and cost.exposed_comm_s == pytest.approx(0.0)
        assert cost.compute_forward_s == pytest.approx(0.5 * 16 * BLOCK)


def test_errors_and_applicable_algorithms():
    six_heads = CPAttentionShape(1, 6, 2, 4096, 128, 2)
    with pytest.raises(ConfigError, match="divide the 6 query heads"):
        estimate_cp_attention(
            six_heads, 4, causal=True, layout="zigzag", algorithm="alltoall", link=LINK, compute=block_time
        )
    found = estimate_cp_attention_all(six_heads, 4, causal=True, layout="zigzag", link=LINK, compute=block_time)
    assert set(found) == {CPAlgorithm.ALL_GATHER, CPAlgorithm.RING}
    with pytest.raises(ConfigError, match="not a multiple of 8"):
        estimate_cp_attention(
            CPAttentionShape(1, 8, 2, 4100, 128, 2),
            4,
            causal=True,
            layout="zigzag",
            algorithm="ring",
            link=LINK,
            compute=block_time,
        )
    with pytest.raises(ConfigError, match="multiple of the 3 key/value heads"):
        CPAttentionShape(1, 8, 3, 4096, 128, 2)

"""Alpha-beta ring model of the collectives, against hand computation."""

from __future__ import annotations

import pytest

from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec, get_device
from autopar.errors import ConfigError

LINK = LinkSpec("test", bandwidth_bytes_per_s=100e9, latency_s=1e-6)
S = 1e9  # bytes of the full tensor


def test_all_reduce_hand_computed():
    # 8 ranks: 2·7 = 14 steps, 2·7/8·S bytes through each rank's link
    assert estimate_collective_time(Collective.ALL_REDUCE, S, 8, LINK) == pytest.approx(14e-6 + 1.75e9 / 100e9)


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.BROADCAST])
def test_one_pass_collectives_hand_computed(kind):
    assert estimate_collective_time(kind, S, 8, LINK) == pytest.approx(7e-6 + 0.875e9 / 100e9)


def test_all_to_all_sends_what_a_rank_does_not_keep_of_its_own_shard():
    # 8 ranks each hold S/8 and keep 1/8 of it: each sends 7/8 · S/8 = 7/64 · S, in 7 pairwise steps
    assert estimate_collective_time(Collective.ALL_TO_ALL, S, 8, LINK) == pytest.approx(7e-6 + 7 / 64 * 1e9 / 100e9)
    for n in (2, 4, 16):
        shard = S / n
        expected = (n - 1) * LINK.latency_s + (n - 1) / n * shard / LINK.bandwidth_bytes_per_s
        assert estimate_collective_time(Collective.ALL_TO_ALL, S, n, LINK) == pytest.approx(expected)


def test_send_recv_moves_the_whole_tensor_in_one_step():
    assert estimate_collective_time(Collective.SEND_RECV, S, 2, LINK) == pytest.approx(1e-6 + 1e9 / 100e9)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 4, 16, 64):
        rs = estimate_collective_time(Collective.REDUCE_SCATTER, S, n, LINK)
        ag = estimate_collective_time(Collective.ALL_GATHER, S, n, LINK)
        assert estimate_collective_time(Collective.ALL_REDUCE, S, n, LINK) == pytest.approx(rs + ag)


def test_one_rank_costs_nothing():
    for kind in Collective:
        assert estimate_collective_time(kind, S, 1, LINK) == 0.0


def test_nvlink_link_priced_per_step():
    # the NVLink link alone (no group shape) keeps the per-step model: 1 GB over 8 GPUs of a DGX A100 at
    # 230 GB/s bus bandwidth, 11.8 µs per step (NCCL's Simple base latency plus one NVLink hop)
    link = get_device("A100-80GB").intra_node_link
    expected = 14 * 11.8e-6 + 2 * 7 / 8 * 1e9 / 230e9
    assert estimate_collective_time("all_reduce", 1e9, 8, link) == pytest.approx(expected)


def test_bad_arguments():
    with pytest.raises(ConfigError):
        estimate_collective_time(Collective.ALL_REDUCE, -1.0, 4, LINK)
    with pytest.raises(ConfigError):
        estimate_collective_time(Collective.ALL_REDUCE, 1.0, 0, LINK)
    with pytest.raises(ValueError):
        estimate_collective_time("all_sum", 1.0, 4, LINK)

"""Expert parallelism's all-to-all traffic and expert-state share, against hand computation."""

from __future__ import annotations

import pytest

from autopar.cost_model.devices import LinkSpec
from autopar.cost_model.experts import estimate_expert_parallel
from autopar.errors import ConfigError

LINK = LinkSpec("test", bandwidth_bytes_per_s=100e9, latency_s=1e-6)


def test_mixtral_layer_all_to_alls_hand_computed():
    # Mixtral 8x7B shapes: 4096 tokens a rank, top-2, hidden 4096, bf16, 32 MoE layers, 2 micro-batches, ep 8.
    # One all-to-all re-splits 8 ranks x 4096 x 2 x 4096 x 2 B = 536,870,912 B; each rank sends 7/8 of its
    # 67,108,864 B share = 58,720,256 B in 7 steps: 7 us + 58,720,256 / 1e11 s = 594.20256 us. A step runs
    # 4 x 32 x 2 = 256 of them: 0.152115855 s.
    cost = estimate_expert_parallel(
        ep=8,
        tokens=4096,
        top_k=2,
        hidden_size=4096,
        bytes_per_element=2,
        num_moe_layers=32,
        num_microbatches=2,
        link=LINK,
    )
    assert cost.all_to_all_bytes == 536_870_912
    assert cost.num_all_to_alls == 256
    assert cost.all_to_all_s == pytest.approx(256 * 594.20256e-6, rel=1e-12)  # float rounding only
    assert cost.expert_state_fraction == 1 / 8


def test_one_rank_moves_nothing():
    cost = estimate_expert_parallel(
        ep=1, tokens=64, top_k=2, hidden_size=32, bytes_per_element=4, num_moe_layers=2, num_microbatches=1, link=LINK
    )
    assert (cost.all_to_all_bytes, cost.num_all_to_alls, cost.all_to_all_s, cost.expert_state_fraction) == (0, 0, 0, 1)


def test_bad_counts_are_named():
    with pytest.raises(ConfigError, match="top_k >= 1"):
        estimate_expert_parallel(
            ep=2, tokens=8, top_k=0, hidden_size=8, bytes_per_element=2, num_moe_layers=1, num_microbatches=1, link=LINK
        )

"""Closed-form memory and ZeRO communication figures against the papers' numbers."""

from __future__ import annotations

import pytest

from autopar.cost_model.memory import (
    estimate_model_state_bytes,
    estimate_transformer_activation_bytes,
    zero_communication_bytes,
)
from autopar.errors import ConfigError

GB = 1e9


@pytest.mark.parametrize(
    ("stage", "paper_gb", "abs_gb"), [(0, 120, 0.05), (1, 31.4, 0.05), (2, 16.6, 0.05), (3, 1.88, 0.005)]
)
def test_zero_paper_example(stage, paper_gb, abs_gb):
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam. The paper rounds to
    # three significant figures, so the tolerance is half of its last digit.
    states = estimate_model_state_bytes(7.5e9, mixed_precision=True, zero_stage=stage, dp=64)
    assert states.total / GB == pytest.approx(paper_gb, abs=abs_gb)


def test_state_split_per_parameter():
    mixed = estimate_model_state_bytes(1.0, mixed_precision=True, zero_stage=0, dp=8)
    assert (mixed.params, mixed.grads, mixed.optimizer) == (2, 2, 12)
    fp32 = estimate_model_state_bytes(1.0, mixed_precision=False, zero_stage=0, dp=8)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4, 4, 8)
    z2 = estimate_model_state_bytes(8.0, mixed_precision=True, zero_stage=2, dp=8)
    assert (z2.params, z2.grads, z2.optimizer) == (16, 2, 12)


def test_sgd_options():
    assert estimate_model_state_bytes(1.0, mixed_precision=False, zero_stage=0, dp=1, optimizer="sgd").optimizer == 0
    momentum = estimate_model_state_bytes(1.0, mixed_precision=False, zero_stage=0, dp=1, optimizer="sgd_momentum")
    assert momentum.optimizer == 4
    with pytest.raises(ConfigError):
        estimate_model_state_bytes(1.0, mixed_precision=False, zero_stage=0, dp=1, optimizer="lion")


def test_bad_zero_arguments():
    with pytest.raises(ConfigError):
        estimate_model_state_bytes(1.0, mixed_precision=True, zero_stage=4, dp=8)
    with pytest.raises(ConfigError):
        estimate_model_state_bytes(1.0, mixed_precision=True, zero_stage=1, dp=0)
    with pytest.raises(ConfigError):
        zero_communication_bytes(1.0, zero_stage=-1)


def test_activation_formulas():
    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    # 5·a·s/h = 80: the attention scores dominate the 34 of the rest
    assert estimate_transformer_activation_bytes(s, b, h, a) == pytest.approx(sbh * 114)
    # tensor parallel t = 8: 10 + 24/8 + 80/8
    assert estimate_transformer_activation_bytes(s, b, h, a, tp=8) == pytest.approx(sbh * 23)
    assert estimate_transformer_activation_bytes(s, b, h, a, tp=8, sequence_parallel=True) == pytest.approx(
        sbh * 114 / 8
    )
    assert estimate_transformer_activation_bytes(s, b, h, a, tp=8, recompute="selective") == pytest.approx(sbh * 13)
    selective_sp = estimate_transformer_activation_bytes(
        s, b, h, a, tp=8, sequence_parallel=True, recompute="selective"
    )
    assert selective_sp == pytest.approx(34 * sbh / 8)
    assert estimate_transformer_activation_bytes(s, b, h, a, tp=8, recompute="full") == pytest.approx(2 * sbh)
    with pytest.raises(ConfigError):
        estimate_transformer_activation_bytes(s, b, h, a, recompute="some")


def test_zero_communication():
    psi = 7.5e9
    assert zero_communication_bytes(psi, zero_stage=0) == 2 * psi * 2
    assert zero_communication_bytes(psi, zero_stage=2) == 2 * psi * 2
    assert zero_communication_bytes(psi, zero_stage=3) == 3 * psi * 2
    assert zero_communication_bytes(psi, zero_stage=3, bytes_per_param=4) == 3 * psi * 4

"""Closed-form memory and ZeRO communication estimates, as checks on the graph-level model.

The planner computes memory per device from the traced graph (parameter shards, optimizer
states, activations by liveness). The formulas here are the published closed forms it must
agree with on standard transformers:

- Model states (ZeRO paper, Rajbhandari et al. 2020): mixed-precision Adam keeps 2 bytes of
  16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights and
  two fp32 moments) per parameter, 16 in all; fp32 Adam keeps 4 + 4 + 8. ZeRO-1 shards the
  optimizer state over the dp ranks, ZeRO-2 the gradients as well, ZeRO-3 the weights too.
- Activations per transformer layer (Korthikanti et al. 2022, 16-bit activations), with s the
  sequence length, b the micro-batch, h the hidden size, a the heads, t the tensor-parallel
  degree:

      no parallelism                     s·b·h·(34 + 5·a·s/h)
      tensor parallel                    s·b·h·(10 + 24/t + 5·a·s/(h·t))
      tensor + sequence parallel         s·b·h/t·(34 + 5·a·s/h)
      selective recompute (attention)    s·b·h·(10 + 24/t), or 34·s·b·h/t with sequence parallelism
      full recompute                     2·s·b·h (the layer's input), /t with sequence parallelism

- Communication per step: data parallelism and ZeRO-1/2 move 2Ψ (reduce-scatter plus
  all-gather, or all-reduce), ZeRO-3 moves 3Ψ (one more all-gather of the weights for the
  backward), Ψ the parameter bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import ConfigError

# (weight, gradient, optimizer) bytes per parameter; optimizer bytes include the fp32 master copy that
# mixed precision keeps for every optimizer.
_STATE_BYTES = {
    ("adamw", True): (2, 2, 12),
    ("adamw", False): (4, 4, 8),
    ("sgd", True): (2, 2, 4),
    ("sgd", False): (4, 4, 0),
    ("sgd_momentum", True): (2, 2, 8),
    ("sgd_momentum", False): (4, 4, 4),
}
_OPTIMIZER_ALIASES = {
    "adam": "adamw",
    "adamw": "adamw",
    "sgd": "sgd",
    "sgd_momentum": "sgd_momentum",
    "sgd-momentum": "sgd_momentum",
    "momentum": "sgd_momentum",
}
_RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Per-device bytes of weights, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def _check_zero(zero_stage: int) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")


def estimate_model_state_bytes(
    num_params: float, *, mixed_precision: bool, zero_stage: int, dp: int, optimizer: str = "adamw"
) -> ModelStateBytes:
    """Per-device model-state bytes of `num_params` parameters.

    Args:
        num_params: parameters held by this device before ZeRO sharding (after tensor/pipeline splits).
        mixed_precision: 16-bit weights and gradients with fp32 master weights, or plain fp32.
        zero_stage: 0 (replicated), 1 (optimizer sharded), 2 (+ gradients), 3 (+ weights).
        dp: data-parallel ranks the ZeRO shards are spread over.
        optimizer: "adamw" (or "adam"), "sgd" (no state), "sgd_momentum" (one fp32 buffer).
    """
    _check_zero(zero_stage)
    if not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp must be a positive integer, got {dp!r}")
    if num_params < 0:
        raise ConfigError(f"num_params must be >= 0, got {num_params}")
    name = _OPTIMIZER_ALIASES.get(str(optimizer).lower())
    if name is None:
        raise ConfigError(f"unknown optimizer {optimizer!r}: expected one of {sorted(_OPTIMIZER_ALIASES)}")
    weight, grad, opt = _STATE_BYTES[(name, bool(mixed_precision))]
    return ModelStateBytes(
        params=num_params * weight / (dp if zero_stage >= 3 else 1),
        grads=num_params * grad / (dp if zero_stage >= 2 else 1),
        optimizer=num_params * opt / (dp if zero_stage >= 1 else 1),
    )


def estimate_transformer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    num_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer keeps for its backward (Korthikanti et al., 16-bit).

    Args:
        seq_len, micro_batch, hidden, num_heads: s, b, h, a of the formulas in the module docstring.
        tp: tensor-parallel degree t.
        sequence_parallel: whether the non-tensor-parallel regions are split over the sequence too.
        recompute: "none", "selective" (attention scores recomputed) or "full" (only the layer input kept).
    """
    if recompute not in _RECOMPUTE:
        raise ConfigError(f"recompute must be one of {list(_RECOMPUTE)}, got {recompute!r}")
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("hidden", hidden),
        ("num_heads", num_heads),
        ("tp", tp),
    ):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    s, b, h, a, t = float(seq_len), float(micro_batch), float(hidden), float(num_heads), float(tp)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def zero_communication_bytes(num_params: float, *, zero_stage: int, bytes_per_param: float = 2) -> float:
    """Bytes each data-parallel rank moves per step: 2Ψ for dp and ZeRO-1/2, 3Ψ for ZeRO-3 (Ψ = params x bytes)."""
    _check_zero(zero_stage)
    return (3 if zero_stage == 3 else 2) * num_params * bytes_per_param

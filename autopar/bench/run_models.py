"""The models `autopar bench run` trains: presets with config overrides and a global batch shape, and the seeded
initial weights and batch every method of a model starts from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.bench.run_methods import OPTIMIZERS
from autopar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RunModel:
    """A model trained in the run suite: a preset with config overrides and the global batch shape."""

    name: str
    preset: str
    batch_size: int
    seq_len: int
    overrides: tuple[tuple[str, object], ...] = ()
    # the optimizer every method trains it with (`OPTIMIZERS`)
    optimizer: str = "adamw"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"RunModel {self.name!r}: optimizer {self.optimizer!r}, expected one of {', '.join(OPTIMIZERS)}"
            )


# Small enough that a step takes well under a second on one core per rank.
MODELS: tuple[RunModel, ...] = (
    RunModel("tiny-llama", "tiny-llama", 8, 64),
    RunModel("tiny-gpt2", "tiny-gpt2", 8, 64),
    RunModel(
        "small-llama",
        "tiny-llama",
        8,
        128,
        (
            ("hidden_size", 256),
            ("intermediate_size", 688),
            ("num_hidden_layers", 4),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("vocab_size", 2048),
        ),
    ),
    RunModel("small-gpt2", "tiny-gpt2", 8, 128, (("n_embd", 256), ("n_layer", 4), ("n_head", 8), ("vocab_size", 2048))),
)
QUICK_MODELS: tuple[RunModel, ...] = MODELS[:2]
# Communication-bound on cpu:2: ~41M parameters in wide layers (164 MB of fp32 gradients, about 0.15 s of gloo
# all-reduce on loopback) and little compute per rank (32 tokens), so the gradient sync is a large share of the
# step and how much of it hides behind backward shows. Trained with SGD: AdamW on CPU would dominate the step.
# Not in `MODELS` (a step takes a good part of a second): `--models wide-llama` selects it.
WIDE_LLAMA = RunModel(
    "wide-llama",
    "tiny-llama",
    4,
    16,
    (
        ("hidden_size", 768),
        ("intermediate_size", 3072),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 12),
        ("num_key_value_heads", 12),
        ("vocab_size", 2048),
    ),
    optimizer="sgd",
)
# every model `--models` can name
ALL_MODELS: tuple[RunModel, ...] = MODELS + (WIDE_LLAMA,)


def model_and_batch(spec: RunModel):
    """The model (seeded initial weights) and the global batch every method of `spec` trains on."""
    from autopar import presets

    config = presets.load_config(spec.preset, **dict(spec.overrides))
    torch.manual_seed(0)
    base = presets.build_model(config, device="cpu", dtype=torch.float32)
    batch_rng = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (spec.batch_size, spec.seq_len), generator=batch_rng)
    return config, base, ids


__all__ = ["ALL_MODELS", "MODELS", "QUICK_MODELS", "WIDE_LLAMA", "RunModel", "model_and_batch"]

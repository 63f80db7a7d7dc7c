"""Checkpoints: training state through `torch.distributed.checkpoint` (`training`, with its marker, folder lock,
plain data and safe index reader in `marker`, `lock`, `data`, `reader`), Hugging Face safetensors weights in and
out (`hf`), all on the `Checkpointable` protocol every program implements (`protocol`) and the pieces it exposes
(`pieces`). Loading a checkpoint never runs code from it (see docs/checkpoints.md)."""

from autopar.checkpoint.marker import latest_checkpoint

__all__ = ["latest_checkpoint"]

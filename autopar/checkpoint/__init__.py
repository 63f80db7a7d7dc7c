"""Checkpoints: training state through `torch.distributed.checkpoint` (`training`), Hugging Face safetensors
weights in and out (`hf`), both on the `Checkpointable` protocol every program implements (`protocol`) and the
pieces it exposes (`pieces`)."""

from autopar.checkpoint.training import latest_checkpoint

__all__ = ["latest_checkpoint"]

"""Mixed precision of a program: the compute formats a plan names, and fp16's dynamic loss scale.

The masters stay fp32 and the graph computes on copies cast to the compute format (`autopar.runtime.base`'s module
docstring says how); fp16 multiplies the loss by `LossScaler`'s scale and skips steps whose gradients overflow.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The format a plan of `precision` computes in; None for "fp32" (the model's own dtype)."""
    return COMPUTE_DTYPES.get(precision)


class LossScaler:
    """Dynamic loss scaling for fp16, by torch.amp.GradScaler's rule: the loss is multiplied by `scale` before
    backward; a step whose gradients hold an inf or NaN is skipped and the scale halved; after
    `growth_interval` good steps in a row the scale doubles."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


__all__ = ["COMPUTE_DTYPES", "LossScaler", "compute_dtype"]

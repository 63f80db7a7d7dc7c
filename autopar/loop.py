"""The training loop's options `compile` takes besides the planning ones, checked once at the edge.

- `max_grad_norm`: clip the gradients to this global L2 norm (over every parameter of every rank, each element
  once); also a `plan` option, so the plan prices the clipping (a plan given to `compile` brings its own);
- `on_nonfinite`: "raise" (default) or "skip" a step whose loss or gradients are not finite
  (`autopar.runtime.step_guard`);
- `local_batch`: each data-parallel rank passes its own rows instead of the global batch (`autopar.data`);
- `loss_fn(outputs, batch) -> scalar`, with `loss_reduction` ("mean" over loss tokens, or "sum"),
  `loss_inputs` (keywords for the loss only, default ("labels",)) and `loss_tokens(batch)` (`autopar.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import ConfigError
from autopar.guard_options import check_guard_options
from autopar.loss import LOSS_SCALE, LossSpec, with_loss

_LOOP_KEYS = ("on_nonfinite", "local_batch", "loss_fn", "loss_reduction", "loss_inputs", "loss_tokens")


@dataclass(frozen=True, slots=True)
class LoopOptions:
    """The loop settings of one `compile` call (module docstring)."""

    max_grad_norm: float | None = None
    on_nonfinite: str = "raise"
    local_batch: bool = False
    loss: LossSpec | None = None

    def __post_init__(self):
        check_guard_options(self.max_grad_norm, self.on_nonfinite)
        if not isinstance(self.local_batch, bool):
            raise ConfigError(f"local_batch={self.local_batch!r}: expected True or False")

    @classmethod
    def take(cls, plan_kwargs: dict, model) -> LoopOptions:
        """The loop options among `compile`'s keywords, popped from `plan_kwargs` (`max_grad_norm` stays there:
        the plan prices it)."""
        got = {k: plan_kwargs.pop(k) for k in _LOOP_KEYS if k in plan_kwargs}
        loss = None
        if got.get("loss_fn") is not None:
            from autopar.context_parallel.inputs import is_causal_lm

            inputs = got.get("loss_inputs", ("labels",))
            if isinstance(inputs, str) or not all(isinstance(k, str) for k in inputs):
                raise ConfigError(f"loss_inputs={inputs!r}: expected a tuple of keyword names, e.g. ('labels',)")
            loss = LossSpec(
                got["loss_fn"],
                got.get("loss_reduction", "mean"),
                tuple(inputs),
                got.get("loss_tokens"),
                causal_lm=is_causal_lm(model),
            )
        elif any(k in got for k in ("loss_reduction", "loss_inputs", "loss_tokens")):
            raise ConfigError("loss_reduction, loss_inputs and loss_tokens describe a loss_fn: pass loss_fn= too")
        return cls(
            plan_kwargs.get("max_grad_norm"),
            got.get("on_nonfinite", "raise"),
            got.get("local_batch", False),
            loss,
        )

    def traced(self, model: torch.nn.Module, kwargs: dict) -> tuple[torch.nn.Module, dict]:
        """The module `compile` plans and builds, and the example keywords it traces with: under a user's loss the
        model with its loss (`autopar.loss.with_loss`) and the loss-scale input."""
        if self.loss is None:
            return model, kwargs
        if LOSS_SCALE in kwargs:
            raise ConfigError(f"the keyword {LOSS_SCALE!r} is autopar's own; rename that input")
        return with_loss(model, self.loss), {**kwargs, LOSS_SCALE: torch.tensor(1.0, dtype=torch.float64)}

    def apply(self, program, plan) -> None:
        """Set the program's loop (the plan's own `max_grad_norm` unless `compile` was given one)."""
        clip = self.max_grad_norm if self.max_grad_norm is not None else getattr(plan, "max_grad_norm", None)
        program.configure_loop(
            max_grad_norm=clip, on_nonfinite=self.on_nonfinite, local_batch=self.local_batch, loss=self.loss
        )

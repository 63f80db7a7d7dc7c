"""The step guard's options, checked where they arrive (`plan`, `compile`, the programs) without importing the
runtime: `max_grad_norm` (clip to this global norm) and `on_nonfinite` (what a non-finite loss or gradient
does: "raise" or "skip"). The guard itself is `autopar.runtime.step_guard`."""

from __future__ import annotations

import math

from autopar.errors import ConfigError

ON_NONFINITE = ("raise", "skip")


def check_guard_options(max_grad_norm, on_nonfinite) -> None:
    """ConfigError for a `max_grad_norm` that is not a positive number or an unknown `on_nonfinite`."""
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not math.isfinite(max_grad_norm)
        or max_grad_norm <= 0
    ):
        raise ConfigError(f"max_grad_norm={max_grad_norm!r}: expected a positive number (e.g. 1.0) or None")
    if on_nonfinite not in ON_NONFINITE:
        raise ConfigError(f"on_nonfinite={on_nonfinite!r}: expected one of {', '.join(map(repr, ON_NONFINITE))}")

"""Errors a user of autopar can cause.

Every error raised for bad input subclasses :class:`ValueError`; every error raised because a
plan is infeasible or a lowering failed subclasses :class:`RuntimeError`. All of them subclass
:class:`AutoparError`, so ``except autopar.AutoparError`` catches exactly what autopar raises on
purpose. Messages say what was expected, what was found, and what to do.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ConfigError(AutoparError, ValueError):
    """Bad input: a malformed cluster string, an unknown device or preset, a bad constraint."""


class PlanFormatError(AutoparError, ValueError):
    """A plan file that is corrupt, of another format version, or not a plan at all."""


class TraceError(AutoparError, RuntimeError):
    """The model could not be traced into a graph (data-dependent control flow, an unsupported op)."""


class InfeasiblePlanError(AutoparError, RuntimeError):
    """No plan satisfies the constraints (memory budget, pinned axis sizes)."""


class LoweringError(AutoparError, RuntimeError):
    """A plan could not be turned into a parallel program, or the program was launched wrongly."""


class NonFiniteError(AutoparError, RuntimeError):
    """A training step's loss or gradients were not finite (`on_nonfinite="raise"`); `step` is its number. No
    update was applied."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step

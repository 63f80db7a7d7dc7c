"""A planning time limit (`autopar.plan(..., time_limit_s=...)`): the searches stop trying candidates once it has
passed and keep the best found so far, and say what they left untried.

`limited(limit_s)` sets the limit for the planning inside it (a context variable: the searches read it with
`expired()` and tell what they skip with `skipped(...)`, without a parameter through every layer). Each search
solves at least one candidate, so that a plan comes back however short the limit: the plan without a pipeline
(`passes.sharding.search`) solves its fastest mesh, the pipeline search prices none once the limit has passed
(`passes.pipeline.layout_search`), and the layouts a report prices next to the plan are left out
(`planning.plan_model`). `TimeLimit.record()` is what the plan's stats say under "time_limit".
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from autopar.errors import ConfigError


@dataclass
class TimeLimit:
    """The limit of one `plan` call and what the searches left untried once it had passed."""

    limit_s: float
    t_end: float
    not_tried: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {"limit_s": self.limit_s, "cut_short": bool(self.not_tried), "not_tried": list(self.not_tried)}


_CURRENT: ContextVar[TimeLimit | None] = ContextVar("autopar_time_limit", default=None)


@contextlib.contextmanager
def limited(limit_s: float | None):
    """Planning inside runs under a limit of `limit_s` seconds (None: none); yields the TimeLimit (or None)."""
    if limit_s is None:
        yield None
        return
    if not isinstance(limit_s, (int, float)) or isinstance(limit_s, bool) or not limit_s >= 0:
        raise ConfigError(f"time_limit_s must be a number of seconds >= 0, got {limit_s!r}")
    tl = TimeLimit(float(limit_s), time.perf_counter() + float(limit_s))
    token = _CURRENT.set(tl)
    try:
        yield tl
    finally:
        _CURRENT.reset(token)


def expired() -> bool:
    """Whether a limit is set and has passed."""
    tl = _CURRENT.get()
    return tl is not None and time.perf_counter() >= tl.t_end


def skipped(what: str) -> None:
    """Note that `what` (candidates in words) was not tried because the limit had passed."""
    tl = _CURRENT.get()
    if tl is not None:
        tl.not_tried.append(what)

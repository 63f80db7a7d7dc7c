"""One plan for every rank: rank 0 plans, the others read its plan (or its failure) from the group's store.

Planning on every rank solves the same trace and integer programs once per rank at the same time (on a host whose
cores the ranks share, that many times the CPU) and leaves nothing but determinism to keep the plans equal. Here
rank 0 plans and writes the plan's JSON under a key of this `compile` call in the default process group's store;
every rank, rank 0 included, builds its program from `Plan.from_json` of those bytes, so the ranks run one plan by
construction. Where rank 0 cannot plan, it writes the error instead, and every rank raises an error of the same
class that says so.

The other ranks wait `AUTOPAR_PLAN_WAIT_S` seconds (3600 when unset: planning a large model on a busy host takes
minutes, longer than a collective's timeout), then raise a `LoweringError` naming what they waited for. The store
holds plain bytes (JSON), never pickles: nothing read from it runs code. The key counts `compile` calls in this
process, which every rank makes in the same order, as it makes every collective.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from autopar import errors
from autopar.errors import AutoparError, LoweringError
from autopar.plan import Plan
from autopar.runtime.collectives import env_seconds

WAIT_ENV = "AUTOPAR_PLAN_WAIT_S"
DEFAULT_WAIT_S = 3600.0
_CALLS = itertools.count()


def plan_wait() -> timedelta:
    """How long a rank other than 0 waits for rank 0's plan: `AUTOPAR_PLAN_WAIT_S` seconds, 3600 when unset."""
    return env_seconds(WAIT_ENV, DEFAULT_WAIT_S, example=1800)


def plan_on_rank_zero(make_plan: Callable[[], tuple[Plan, object]]) -> tuple[Plan, object | None]:
    """`make_plan()` run on rank 0 only; returns the plan every rank builds (read back from its JSON) and, on rank 0,
    what `make_plan` returned beside the plan (None on the others). One rank: `make_plan()` itself."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make_plan()
    wait = plan_wait()  # read (and refused where malformed) on every rank before rank 0 plans
    key = f"autopar/compile/{next(_CALLS)}/plan"
    store = dist.distributed_c10d._get_default_store()
    extra = None
    if dist.get_rank() == 0:
        try:
            plan, extra = make_plan()
            message = {"plan": plan.to_json()}
        except Exception as e:
            store.set(key, json.dumps({"error": type(e).__name__, "message": str(e)}))
            raise
        store.set(key, json.dumps(message))
    else:
        try:
            store.wait([key], wait)
        except RuntimeError as e:  # the store's own timeout (DistStoreError is a RuntimeError)
            raise LoweringError(
                f"rank {dist.get_rank()} waited {wait.total_seconds():g} s for rank 0's plan (key {key!r}) and "
                f"none came: rank 0 is still planning or has failed; {WAIT_ENV} sets the wait"
            ) from e
        message = json.loads(store.get(key))
    if "error" in message:
        raise _error_class(message["error"])(f"rank 0 could not plan: {message['error']}: {message['message']}")
    return Plan.from_json(message["plan"]), extra


def _error_class(name: str) -> type[Exception]:
    """autopar's error class of that name (the class rank 0 raised), `AutoparError` for any other exception."""
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, AutoparError) else AutoparError

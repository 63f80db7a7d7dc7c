"""Process groups that wait a bounded time, the error a rank gets when its peers never come, and how a
reduce-scatter runs on each backend.

A collective that one rank of its group skips (a bug, a rank that failed, ranks running different plans
or batches) otherwise blocks the others for the backend's default (30 minutes on gloo, or forever). Every
process group a program creates (its DeviceMesh's groups, a pipeline's tie groups) gets the timeout of
`collective_timeout()`: `AUTOPAR_COLLECTIVE_TIMEOUT_S` seconds from the environment, 300 by default (the
limit `ensure_process_group` gives the world group it creates). A wait past it raises in the backend; a
program runs its collectives inside `waiting_for(what)`, which turns that error into a `LoweringError`
naming what this rank was waiting for.

The timeout must be the same on every rank (read it from the launch environment, not per rank).

A reduce-scatter over a gloo group runs as an all-reduce of the whole tensor, of which each rank keeps its
slice (`reduce_scatter_by_all_reduce`): gloo's own reduce-scatter takes longer than its all-reduce of the same
tensor (2 ranks, one thread each: 4 MiB 15.6 against 4.3 ms, 25 MiB 36.8 against 29.3 ms; 4 ranks, 25 MiB 76.2
against 69.6 ms). `AUTOPAR_GLOO_REDUCE_SCATTER=native` keeps gloo's own. Every autopar reduce-scatter (the
gradient buckets, the chunk store, context-parallel attention's dK/dV) and the link calibration's measurement
of one are issued by `issue_reduce_scatter`, so the reduce-scatter a plan is priced on is the one its program
runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar import compat
from autopar.errors import ConfigError, LoweringError

TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT_S"
GLOO_REDUCE_SCATTER_ENV = "AUTOPAR_GLOO_REDUCE_SCATTER"  # "all_reduce" (the default) or "native"
DEFAULT_TIMEOUT_S = 300.0
# what gloo says when a wait times out ("Timed out waiting 3000ms for send operation to complete"), and what
# it says of every later operation on the pair it closed; NCCL's watchdog says "timeout"
_TIMEOUT_WORDS = ("timed out", "timeout")


def collective_timeout() -> timedelta:
    """How long a rank waits in one collective of a group autopar created: `AUTOPAR_COLLECTIVE_TIMEOUT_S`
    seconds (a positive number), 300 when unset."""
    return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, example=600)


def env_seconds(name: str, default_s: float, *, example: float) -> timedelta:
    """The positive number of seconds the environment variable `name` holds, `default_s` when it is unset or
    empty; anything else is a ConfigError naming the variable (`example` is the value it suggests)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return timedelta(seconds=default_s)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(
            f"{name}={raw!r} is not a positive number of seconds; set it to e.g. {example:g}, or unset it for "
            f"{default_s:g}"
        )
    return timedelta(seconds=seconds)


def _backend_options(device_type: str, timeout: timedelta):
    """(backend, options carrying `timeout`) for the groups of a mesh on `device_type`."""
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options = dist.ProcessGroupGloo._Options()
        backend = "gloo"
    options._timeout = timeout
    return backend, options


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`init_device_mesh(device_type, shape, mesh_dim_names=names)` whose groups time out after
    `collective_timeout()` (a mesh dim spanning the world gets a group of its own, not the world group, whose
    timeout autopar may not have set)."""
    options = _backend_options(device_type, collective_timeout())
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, options))


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """`dist.new_group(ranks)` that times out after `collective_timeout()` (every rank must call it)."""
    return dist.new_group(ranks, timeout=collective_timeout())


def reduce_scatter_by_all_reduce(group=None) -> bool:
    """Whether a reduce-scatter over `group` runs as an all-reduce of the whole input, each rank keeping its slice:
    on gloo unless `AUTOPAR_GLOO_REDUCE_SCATTER=native` (see the module's notes); never on other backends."""
    if dist.get_backend(group) != "gloo":
        return False
    raw = os.environ.get(GLOO_REDUCE_SCATTER_ENV, "all_reduce").strip() or "all_reduce"
    if raw not in ("all_reduce", "native"):
        raise ConfigError(f"{GLOO_REDUCE_SCATTER_ENV}={raw!r}: expected all_reduce (the default) or native")
    return raw == "all_reduce"


class PendingReduceScatter:
    """A reduce-scatter in flight (`issue_reduce_scatter`); `wait()` completes it and returns this rank's piece."""

    def __init__(self, work, piece: torch.Tensor, copy_from: torch.Tensor | None = None):
        # copy_from: the summed row `wait()` copies into `piece` (the all-reduce form into a caller's tensor)
        self.work, self.piece, self._copy_from = work, piece, copy_from

    def wait(self, timeout: timedelta | None = None) -> torch.Tensor:
        """Wait (at most `timeout`, where given) and return this rank's summed piece."""
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout=timeout)
        if self._copy_from is not None:
            self.piece.copy_(self._copy_from)
        return self.piece


def issue_reduce_scatter(full: torch.Tensor, group=None, out: torch.Tensor | None = None) -> PendingReduceScatter:
    """Issue (asynchronously) the sum over `group` of `full` (contiguous; its elements split evenly into one row
    per rank, rank r's row its r-th), of which this rank keeps its row.

    The piece `wait()` returns is `out` where given; otherwise, where the reduce-scatter runs as an all-reduce
    (`reduce_scatter_by_all_reduce`), a view of this rank's row of `full` (which the all-reduce overwrites with
    the sum), else a new tensor. A backend without a reduce-scatter falls back to the all-reduce, with a warning.
    """
    parts = dist.get_world_size(group)
    rows = full.view(parts, -1)
    if not reduce_scatter_by_all_reduce(group):
        piece = out if out is not None else rows.new_empty(rows.shape[1])
        try:
            work = compat.reduce_scatter_single(piece.view(-1), full.reshape(-1), group=group, async_op=True)
            return PendingReduceScatter(work, piece)
        except (RuntimeError, NotImplementedError) as e:  # a backend without reduce-scatter
            warnings.warn(f"reduce-scatter is not available ({e}); running it as an all-reduce", stacklevel=2)
    row = rows[dist.get_rank(group)]
    work = dist.all_reduce(full, group=group, async_op=True)
    if out is None:
        return PendingReduceScatter(work, row)
    return PendingReduceScatter(work, out, copy_from=row.view(out.shape))


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a backend's report of a wait that timed out."""
    return isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _TIMEOUT_WORDS)


@contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Run collectives; a timeout among them raises `LoweringError` saying this rank waited for `what`."""
    try:
        yield
    except LoweringError:
        raise
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        seconds = collective_timeout().total_seconds()
        raise LoweringError(
            f"rank {rank} waited more than {seconds:g} s for {what}: a rank of its group did not join (it "
            f"failed, skipped the collective, or runs another plan or batch; the other ranks' errors say which). "
            f"If a step is only slow, raise the limit with {TIMEOUT_ENV}. Backend said: {e}"
        ) from e

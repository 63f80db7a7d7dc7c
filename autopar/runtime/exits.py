"""A finished job exits cleanly: every program is closed while the interpreter is still whole.

Why: a gloo process group runs its collectives on worker threads of its own. When a worker finishes a collective
it drops its reference to the collective's tensors; if that was the last reference to a tensor Python knows,
freeing it takes the GIL. Once `Py_FinalizeEx` has begun, a thread that asks for the GIL is ended with
`pthread_exit`, whose unwinding through the worker's C++ frames calls `std::terminate`: the process aborts
("terminate called without an active exception", SIGABRT) after the script's last line, and torchrun reports
the job FAILED. A core dump of such an abort shows the worker in `ProcessGroupGloo::runLoop` destroying an
`AsyncAllreduceWork` -> `THPVariable_dealloc` -> `take_gil` -> `PyThread_exit_thread`, the main thread in
`Py_FinalizeEx`'s last garbage collection. It happens when a collective is still in flight, or its worker has
not yet let go of it, as finalization begins; a group that objects still reference outlives
`destroy_process_group()` with its workers running.

What autopar does: a program waits for every collective it issues before its call returns (no handle is kept
between calls, prefetched gathers are drained after an eval); and at interpreter exit, from an `atexit` hook (the
interpreter is still whole then: threads joined, modules alive), every live program is closed
(`Program.close`): its asynchronous save is waited for, its collectives in flight are waited for, and what holds
its process groups is dropped; a garbage collection then destroys the groups nothing else references, which joins
their worker threads while they may still take the GIL.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref

_programs: weakref.WeakSet = weakref.WeakSet()
_registered: list[bool] = []


def track(program) -> None:
    """Close `program` at interpreter exit if it is still alive then (the hook is registered once)."""
    _programs.add(program)
    if not _registered:
        atexit.register(close_all)
        _registered.append(True)


def close_all() -> None:
    """Close every live program (errors are printed, not raised: the interpreter is exiting), then collect."""
    for program in list(_programs):
        try:
            program.close()
        except Exception as e:  # an asynchronous save that failed, a peer gone: say so, and go on exiting
            print(f"autopar: closing a {type(program).__name__} at exit: {type(e).__name__}: {e}", file=sys.stderr)
    _programs.clear()
    gc.collect()

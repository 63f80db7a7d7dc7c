"""One writer per checkpoint folder, and the run id retention is scoped to.

The first save into a folder takes its lock: rank 0 opens `<folder>/.autopar-lock` and holds an exclusive
`flock` on it for the life of the process, with the holder written into it (host, pid, run id, since when).
A second job saving into the same folder gets a `CheckpointLockError` naming that holder at its first save,
before any rank writes. The kernel drops the lock when the holder's process ends, however it ends (a crash, a
SIGKILL), so a dead holder never blocks a new job; the file itself stays (a small dotfile that
`latest_checkpoint` ignores). On a file system without `flock` the save warns once and goes on unlocked.

The run id (`run_id()`) is `AUTOPAR_RUN_ID` where set, else torchrun's rendezvous id (`--rdzv-id`, shared by the
restarts of one job) where set, else one made for this process. Retention removes only checkpoints of the same run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
import warnings
from pathlib import Path

from autopar.errors import ConfigError

LOCK = ".autopar-lock"
RUN_ID_ENV = "AUTOPAR_RUN_ID"
_HOLDER_LIMIT_BYTES = 4096
_held: dict[Path, int] = {}  # folder -> the open file holding its lock, for the life of the process
_unlockable: set[Path] = set()
_made_run_id: list[str] = []


class CheckpointLockError(ConfigError):
    """Another process holds the checkpoint folder a save was asked to write into."""


def run_id() -> str:
    """This job's run id (see the module docstring)."""
    given = os.environ.get(RUN_ID_ENV, "").strip()
    if given:
        return given[:200]
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if rdzv and rdzv.lower() != "none":
        return rdzv[:200]
    if not _made_run_id:
        _made_run_id.append(uuid.uuid4().hex[:16])
    return _made_run_id[0]


def hold(folder: Path) -> None:
    """Take `folder`'s lock for this process (nothing when it holds it already); CheckpointLockError naming the
    holder when another process does."""
    folder = folder.resolve()
    if folder in _held or folder in _unlockable:
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CheckpointLockError(
                f"the checkpoint folder {folder} is being written by another job ({holder}); two jobs saving "
                f"into one folder overwrite and delete each other's checkpoints: give this job a folder of its "
                f"own, or end the other one"
            ) from None
        warnings.warn(
            f"the checkpoint folder {folder} cannot be locked ({e.strerror}): saving without the guard against "
            f"a second job writing into it",
            stacklevel=3,
        )
        _unlockable.add(folder)
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "run": run_id(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
    _held[folder] = fd


def _holder(fd: int) -> str:
    """The holder a lock file names, in words."""
    try:
        info = json.loads(os.pread(fd, _HOLDER_LIMIT_BYTES, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"host {str(info['host'])[:80]}, pid {int(info['pid'])}, run {str(info['run'])[:80]}, since {since}"
    except (OSError, ValueError, TypeError, KeyError, OverflowError, RecursionError):
        return "a holder that has not written its name yet"


def release(folder: Path) -> None:
    """Give up `folder`'s lock (a process's locks go at its exit anyway)."""
    fd = _held.pop(folder.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the file drops the flock

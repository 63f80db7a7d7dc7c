"""The marker that makes a folder a complete checkpoint, finding the newest, and retention.

A checkpoint folder is complete when it holds the marker `autopar_checkpoint.json` (written last, by rank 0,
after DCP's index) and DCP's index `.metadata`. The marker says: format and version, the step, the run that
wrote it (`run`), when it was committed (`time`), and the layout (world size, program, mesh, model).
`read_marker` reads at most `MARKER_LIMIT_BYTES` and checks every field it relies on, so that a hostile or
damaged marker is skipped (by `latest_checkpoint`) or refused (by `load`) with the reason, never a crash.

Retention (`retain`) is scoped to the run that saves: it removes the run's own older checkpoints (by commit
time), never another run's, never the checkpoint just written, and never the newest complete checkpoint of the
folder (the one `latest_checkpoint` returns). A folder is removed marker first, so that a removal cut short leaves
a folder that is not taken for a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from autopar.checkpoint.reader import INDEX
from autopar.errors import ConfigError

MARKER = "autopar_checkpoint.json"
FORMAT = "autopar-checkpoint"
VERSION = 2  # 1 held pickled meta, extra and RNG states, which this autopar does not read
MARKER_LIMIT_BYTES = 1 << 20


def checkpoint_path(path, what: str) -> Path:
    """`path` as a Path; ConfigError naming `what` for anything that is not a path."""
    if not isinstance(path, (str, os.PathLike)):
        hint = " (latest_checkpoint found none: start from scratch when it returns None)" if path is None else ""
        raise ConfigError(f"{what}: expected a directory path, got {path!r}{hint}")
    return Path(path)


def latest_checkpoint(root) -> str | None:
    """The newest complete checkpoint directory under `root` (by step, then by when it was committed); None if
    there is none. Directories without a valid marker or index (a save cut short, another version) are
    skipped."""
    found = complete(checkpoint_path(root, "latest_checkpoint(root)"))
    return str(max(found)[-1]) if found else None


def complete(root: Path) -> list[tuple]:
    """(step, commit time, name, run, path) of every complete checkpoint directly under `root`."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        info = read_marker(child)
        if info is not None:
            found.append((info["step"], info["time"], child.name, info["run"], child))
    return found


def read_marker(path) -> dict | None:
    """The marker of a complete checkpoint directory of this version, or None (`marker_problem` says why)."""
    info, problem = _read_marker(Path(path))
    return None if problem else info


def marker_problem(path) -> str | None:
    """Why `path` is not a complete checkpoint this autopar reads (None: it is one)."""
    return _read_marker(Path(path))[1]


def _read_marker(path: Path) -> tuple[dict | None, str | None]:
    marker = path / MARKER
    try:
        with open(marker, "rb") as f:
            raw = f.read(MARKER_LIMIT_BYTES + 1)
    except OSError:
        return None, f"it has no {MARKER} (the save was cut short, or it is another kind of folder)"
    if len(raw) > MARKER_LIMIT_BYTES:
        return None, f"its {MARKER} is larger than {MARKER_LIMIT_BYTES} bytes, which no marker is"
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return None, f"its {MARKER} is not valid JSON"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return None, f"its {MARKER} is not an autopar checkpoint marker (no 'format': '{FORMAT}')"
    version = info.get("version")
    if version != VERSION or isinstance(version, bool):
        old = " (version 1 stored Python pickles, which this autopar does not load)" if version == 1 else ""
        return (
            None,
            f"it is of checkpoint format version {str(version)[:20]}{old}; this autopar reads version {VERSION}",
        )
    problem = _field_problem(info)
    if problem:
        return None, f"its {MARKER} {problem}"
    if not (path / INDEX).is_file():
        return None, f"it has a missing or damaged index ({INDEX}: the save was cut short, or the folder was damaged)"
    return info, None


def _field_problem(info: dict) -> str | None:
    step, run, time_ = info.get("step"), info.get("run"), info.get("time")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        return f"gives the step as {str(step)[:40]}, not a count of steps"
    if not isinstance(run, str) or not 0 < len(run) <= 200:
        return "names no run that wrote it"
    if isinstance(time_, bool) or not isinstance(time_, (int, float)) or not math.isfinite(time_):
        return "gives no commit time"
    return None


def write_marker(folder: Path, marker: dict) -> None:
    """Write the marker into `folder`, flushed to the disk."""
    with open(folder / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def remove(folder: Path) -> None:
    """Remove a checkpoint folder, its marker first."""
    (folder / MARKER).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def retain(root: Path, keep_last: int, run: str, written: Path) -> list[Path]:
    """Remove all but the `keep_last` newest checkpoints `run` committed in `root` (module docstring); returns the
    folders removed."""
    found = complete(root)
    if not found:
        return []
    newest = max(found)[-1]
    mine = sorted((t, name, p) for _, t, name, r, p in found if r == run)
    removed = []
    for *_, p in mine[:-keep_last]:
        if p not in (written, newest):
            remove(p)
            removed.append(p)
    return removed

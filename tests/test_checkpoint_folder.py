"""One writer per checkpoint folder and retention scoped to the run that wrote, in one process: a second process's
save is refused naming the holder (host, pid, run) until the holder dies (a SIGKILLed holder never blocks a new
job); retention removes only the run's own older checkpoints, never the one just written nor the folder's newest.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.checkpoint import lock
from autopar.checkpoint.marker import FORMAT, MARKER, VERSION, latest_checkpoint, retain
from autopar.checkpoint.reader import INDEX

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autopar.checkpoint import lock
    lock.hold(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding `tmp_path`'s lock (run id "other-run")."""
    env = dict(os.environ, AUTOPAR_RUN_ID="other-run")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.subprocess
def test_a_second_writer_is_refused_naming_the_holder(tmp_path, holder):
    with pytest.raises(lock.CheckpointLockError) as e:
        lock.hold(tmp_path)
    words = str(e.value)
    assert f"host {socket.gethostname()}" in words and f"pid {holder.pid}" in words and "run other-run" in words
    assert str(tmp_path) in words and "give this job a folder of its own" in words


@pytest.mark.subprocess
def test_a_killed_holder_does_not_block_the_next_job(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock.hold(tmp_path)  # the kernel dropped the dead holder's lock
    info = json.loads((tmp_path / lock.LOCK).read_text())
    assert info["pid"] == os.getpid() and info["run"] == lock.run_id()
    lock.hold(tmp_path)  # taken already by this process: nothing to do
    lock.release(tmp_path)


def test_the_run_id_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_RUN_ID", "mine")
    assert lock.run_id() == "mine"
    monkeypatch.delenv("AUTOPAR_RUN_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert lock.run_id() == "job-7"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: shared by unrelated jobs
    made = lock.run_id()
    assert made not in ("none", "job-7") and lock.run_id() == made


def _checkpoint(root: Path, name: str, step: int, run: str, time_: float) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / INDEX).write_bytes(b"")
    marker = {"format": FORMAT, "version": VERSION, "step": step, "run": run, "time": time_}
    (folder / MARKER).write_text(json.dumps(marker))
    return folder


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_retention_removes_only_the_runs_own_older_checkpoints(tmp_path):
    for i in (1, 2, 3):
        _checkpoint(tmp_path, f"a{i}", i, "a", float(i))
    _checkpoint(tmp_path, "b1", 1, "b", 1.5)
    _checkpoint(tmp_path, "b2", 2, "b", 2.5)
    removed = retain(tmp_path, 1, "a", tmp_path / "a3")
    assert sorted(p.name for p in removed) == ["a1", "a2"] and _names(tmp_path) == ["a3", "b1", "b2"]


def test_retention_keeps_what_was_just_written_behind_another_run(tmp_path):
    """A run behind another (or rolled back) keeps what it writes: order is by commit time within the run."""
    _checkpoint(tmp_path, "ahead", 100, "other", 1.0)
    _checkpoint(tmp_path, "a50", 50, "a", 2.0)
    written = _checkpoint(tmp_path, "a20", 20, "a", 3.0)  # after a rollback: a lower step, written later
    assert retain(tmp_path, 1, "a", written) == [tmp_path / "a50"]
    assert _names(tmp_path) == ["a20", "ahead"]


def test_retention_never_removes_the_folders_newest(tmp_path):
    _checkpoint(tmp_path, "a9", 9, "a", 1.0)  # the newest by step: what latest_checkpoint returns
    written = _checkpoint(tmp_path, "a3", 3, "a", 2.0)
    assert retain(tmp_path, 1, "a", written) == []
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a9")


def test_a_marker_without_an_index_is_not_a_checkpoint(tmp_path):
    _checkpoint(tmp_path, "a1", 1, "a", 1.0)
    (_checkpoint(tmp_path, "a2", 2, "a", 2.0) / INDEX).unlink()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a1")

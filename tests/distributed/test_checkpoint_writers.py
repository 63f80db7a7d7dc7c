"""Two jobs saving into one folder (each two gloo ranks, started together): the second writer is refused naming
the holder (host, pid, run) until the first has ended, then writes; retention removes only each run's own
checkpoints; every checkpoint the folder marks loads, and what `save_checkpoint` returned is there when it returns
and, for the `keep_last` newest of each job, at the end."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import autopar
from autopar.checkpoint import lock
from autopar.checkpoint.lock import CheckpointLockError
from autopar.checkpoint.marker import complete, read_marker
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

SAVES = 3
KEEP_LAST = 2
WAIT_S = 300.0  # how long a refused job keeps trying, and a job waits for the other's first attempt


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _job(rank: int, world: int, root: str, name: str, other: str):
    args, kwargs = make_batch("llama")
    pm = autopar.compile(make_model("llama"), f"cpu:{world}", args, kwargs, optimizer=_sgd, constraints={"dp": 2})
    returned, refusals, present = [], [], []
    deadline = time.monotonic() + WAIT_S
    while len(returned) < SAVES:
        pm.train_step(*args, **kwargs)
        try:
            path = pm.save_checkpoint(f"{root}/{name}-{len(returned)}", keep_last=KEEP_LAST, extra={"job": name})
        except CheckpointLockError as e:  # every rank gets it: they retry together
            refusals.append(str(e))
            assert time.monotonic() < deadline, "the other job never let go of the folder"
            time.sleep(0.5)
            continue
        finally:
            if rank == 0:
                Path(root).parent.joinpath(f"{name}.tried").touch()
        returned.append(path)
        present.append(read_marker(path) is not None)
    # hold the folder (this process's lock) until the other job has tried once: one of the two is refused
    while not Path(root).parent.joinpath(f"{other}.tried").exists():
        assert time.monotonic() < deadline, "the other job never tried to save"
        time.sleep(0.2)
    return {"returned": returned, "present": present, "refusals": refusals, "run": lock.run_id(), "pid": os.getpid()}


def _two_jobs(folder: Path) -> list[dict]:
    """Start both jobs together; each job's rank 0 result."""
    root = folder / "checkpoints"
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            # fresh worlds: two at once, and each holds its lock until its processes end
            pool.submit(run_distributed, _job, 2, str(root), a, b, timeout_s=900, fresh=True)
            for a, b in (("a", "b"), ("b", "a"))
        ]
        return [job.result()[0] for job in jobs]


def _check(folder: Path, loader) -> None:
    results = _two_jobs(folder)
    root = folder / "checkpoints"
    refused = [r for r in results if r["refusals"]]
    assert len(refused) == 1, [r["refusals"] for r in results]  # the first to save held the folder till the end
    holder = next(r for r in results if not r["refusals"])
    for words in refused[0]["refusals"]:
        assert f"host {socket.gethostname()}" in words and f"pid {holder['pid']}" in words, words
        assert f"run {holder['run']}" in words and "give this job a folder of its own" in words, words
    for r in results:
        assert all(r["present"]), r  # complete when returned
        for path in r["returned"][-KEEP_LAST:]:  # the other job's retention removed none of them
            assert read_marker(path) is not None, (path, sorted(p.name for p in root.iterdir()))
    found = complete(root)
    assert sorted(name for _, _, name, _, _ in found) == ["a-1", "a-2", "b-1", "b-2"], found
    for *_, path in found:  # every marked checkpoint loads
        assert loader.load_checkpoint(path)["job"] == path.name[0]


@pytest.fixture(scope="module")
def loader():
    args, kwargs = make_batch("llama")
    return autopar.compile(make_model("llama", seed=3), "cpu:1", args, kwargs, optimizer=_sgd)


# slow: two fresh worlds of two ranks at once (38 s in `make test` on a busy 2-core machine). `make test` keeps what
# it is made of in tests/test_checkpoint_folder.py: a second process's save refused naming the holder (host, pid,
# run), a killed holder blocking no one, retention removing only the run's own older checkpoints
@pytest.mark.slow
def test_two_jobs_on_one_folder(tmp_path, loader):
    _check(tmp_path, loader)


@pytest.mark.slow
def test_two_jobs_on_one_folder_twenty_times(tmp_path, loader):
    for repetition in range(20):
        _check(tmp_path / str(repetition), loader)

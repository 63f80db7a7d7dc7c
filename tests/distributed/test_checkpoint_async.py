"""Asynchronous training checkpoints on gloo ranks: `save_checkpoint(..., async_save=True)` returns before the
shard files are written, the checkpoint holds the state at the call (the steps taken while it is written do
not leak into it), it is invisible until committed, retention waits for the commit, and what it holds equals
a synchronous save at the same step."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

import autopar
from autopar.checkpoint.lock import LOCK
from autopar.checkpoint.training import MARKER
from tests.distributed.harness import run_distributed
from tests.distributed.test_checkpoint import OPTIMIZERS, RESUME_RTOL, _compile
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

# program kind -> optimizer: DTensor shards (tp), whole tensors written once (dp), stages on sub-meshes (pp),
# flat chunk pieces (offload)
KINDS = {"sharded": "adamw", "data-parallel": "sgd", "pipeline": "sgd", "offload": "adamw"}
HOLD_S = 120.0  # how long a held write waits for the training steps before it gives up (and the test fails)


class _HeldWrites:
    """Holds every shard write of this process until `release()`: the steps taken meanwhile run while the
    checkpoint is provably not yet written."""

    def __init__(self):
        self.event, self.timed_out, self.calls = threading.Event(), False, 0
        self._original = _FileSystemWriter.write_data

    def __enter__(self):
        held = self

        def write_data(writer, plan, planner):
            held.calls += 1
            held.timed_out |= not held.event.wait(HOLD_S)
            return held._original(writer, plan, planner)

        _FileSystemWriter.write_data = write_data
        return self

    def release(self):
        self.event.set()

    def __exit__(self, *exc):
        self.event.set()
        _FileSystemWriter.write_data = self._original


def _run(rank: int, world: int, root: str):
    out = {}
    for kind, opt in KINDS.items():
        run, ref = Path(root, kind, "run"), Path(root, kind, "ref")
        pm, args, kwargs = _compile(world, kind, opt)
        straight = [pm.train_step(*args, **kwargs)]
        pm.save_checkpoint(run / "step1")
        straight += [pm.train_step(*args, **kwargs) for _ in range(2)]
        pm.save_checkpoint(ref / "step3")  # the synchronous save the asynchronous one must equal
        with _HeldWrites() as held:
            future = pm.save_checkpoint(run / "step3", keep_last=1, async_save=True)
            seen = {
                "future": isinstance(future, Future),
                "done": future.done(),
                "latest": autopar.latest_checkpoint(run),
                "partial": (run / "step3.partial").is_dir(),
                "marker": (run / "step3.partial" / MARKER).exists(),
                "committed": (run / "step3").exists(),
            }
            straight += [pm.train_step(*args, **kwargs) for _ in range(2)]  # while the save is held
            held.release()
            path = pm.wait_checkpoint()
        seen |= {
            "path": path,
            "result": future.result(),
            "timed_out": held.timed_out,
            "calls": held.calls,
            "kept": sorted(p.name for p in run.iterdir() if p.name != LOCK),
            "wait_again": pm.wait_checkpoint(),
        }
        straight.append(pm.train_step(*args, **kwargs))
        loaded = {}
        for name, path_ in (("async", run / "step3"), ("sync", ref / "step3")):
            fresh, _, _ = _compile(world, kind, opt, seed=7)
            fresh.load_checkpoint(str(path_))
            loaded[name] = {
                "state": fresh.state_dict(),
                "draws": torch.rand(4),
                "step": fresh.num_steps,
                "losses": [fresh.train_step(*args, **kwargs) for _ in range(3)],
            }
        out[kind] = {"seen": seen, "straight": straight, "loaded": loaded, "run": str(run)}
    return out


@pytest.mark.slow
def test_async_save_holds_the_state_at_the_call_and_commits_after_the_writes(tmp_path):
    results = run_distributed(_run, 2, str(tmp_path))
    for kind in KINDS:
        for r, result in enumerate(results):
            got = result[kind]
            seen, run = got["seen"], got["run"]
            # returned while the writes were held: a future, not done, nothing committed, the older one latest
            assert seen["future"] and not seen["done"], (kind, r, seen)
            assert seen["partial"] and not seen["marker"] and not seen["committed"], (kind, r, seen)
            assert seen["latest"] == f"{run}/step1", (kind, r, seen)
            assert seen["calls"] == 1 and not seen["timed_out"], (kind, r, seen)  # the write waited for the steps
            assert seen["path"] == seen["result"] == f"{run}/step3" and seen["wait_again"] is None, (kind, r, seen)
            assert seen["kept"] == ["step3"], (kind, r, seen)  # keep_last=1 applied after the commit
            a, s = got["loaded"]["async"], got["loaded"]["sync"]
            assert a["step"] == s["step"] == 3, (kind, r)
            assert torch.equal(a["draws"], s["draws"]), (kind, r)  # RNG states of the call, per rank
            assert a["state"].keys() == s["state"].keys()
            for name, value in s["state"].items():
                # bit for bit: both hold the same bytes of the step-3 state; steps 4 and 5 ran before the
                # asynchronous files were written, so a leak shows as a different value
                assert torch.equal(a["state"][name], value), (kind, r, name)
            # the same program resumed from the same bytes runs the same operations: the same bits
            assert a["losses"] == s["losses"], (kind, r, a["losses"], s["losses"])
            # and the straight run's steps 4..6 (moments and momentum buffers included), as a resume does
            assert a["losses"] == pytest.approx(got["straight"][3:6], rel=RESUME_RTOL), (kind, r, got["straight"])


def _failing(rank: int, world: int, root: str):
    """An asynchronous save whose writes fail on rank 1: the call returns, the wait raises on every rank, the
    folder is never committed, and the program saves again afterwards."""
    pm, args, kwargs = _compile(world, "data-parallel", "sgd")
    pm.train_step(*args, **kwargs)
    pm.save_checkpoint(f"{root}/step1")
    original = _FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return original(writer, plan, planner)

    _FileSystemWriter.write_data = write_data
    try:
        pm.save_checkpoint(f"{root}/step2", async_save=True)
        pm.train_step(*args, **kwargs)
        try:
            pm.wait_checkpoint()
            error = None
        except autopar.AutoparError as e:
            error = f"{type(e).__name__}: {e}"
    finally:
        _FileSystemWriter.write_data = original
    latest_after_failure = autopar.latest_checkpoint(root)
    again = pm.save_checkpoint(f"{root}/step2-again", async_save=True).result()
    return {"error": error, "latest": latest_after_failure, "again": again, "final": autopar.latest_checkpoint(root)}


def test_failed_async_save_raises_on_every_rank_at_the_wait_and_commits_nothing(tmp_path):
    results = run_distributed(_failing, 2, str(tmp_path), timeout_s=300)
    for r, got in enumerate(results):
        assert got["error"] is not None and got["error"].startswith("ConfigError"), (r, got)
        assert "could not be written: rank 1: OSError" in got["error"] and "No space left" in got["error"], (r, got)
        assert got["latest"] == f"{tmp_path}/step1", (r, got)  # the failed one is skipped
        assert got["again"] == got["final"] == f"{tmp_path}/step2-again", (r, got)
    assert not (tmp_path / "step2" / MARKER).exists() and not (tmp_path / "step2.partial" / MARKER).exists()


def test_async_save_alone_without_a_process_group(tmp_path):
    """One process, no process group (DCP writes without collectives): the same holds at the call."""
    args, kwargs = make_batch("llama")
    pm = autopar.compile(make_model("llama"), "cpu:1", args, kwargs, optimizer=OPTIMIZERS["adamw"])
    pm.train_step(*args, **kwargs)
    pm.save_checkpoint(tmp_path / "sync")
    with _HeldWrites() as held:
        future = pm.save_checkpoint(tmp_path / "async", async_save=True)
        assert not future.done() and autopar.latest_checkpoint(tmp_path) == str(tmp_path / "sync")
        pm.train_step(*args, **kwargs)  # moves the masters and moments the held save must not see
        held.release()
        assert pm.wait_checkpoint() == str(tmp_path / "async") and not held.timed_out
    states = []
    for name in ("sync", "async"):
        fresh = autopar.compile(make_model("llama", seed=7), "cpu:1", args, kwargs, optimizer=OPTIMIZERS["adamw"])
        fresh.load_checkpoint(tmp_path / name)
        states.append((fresh.state_dict(), fresh.train_step(*args, **kwargs)))
    (sync, sync_loss), (async_, async_loss) = states
    assert all(torch.equal(async_[k], v) for k, v in sync.items()) and async_loss == sync_loss  # the same bytes

"""Gloo ranks kept alive across tests: a world of each size is spawned once a pytest run and runs test after test.

Spawning a world costs every rank an interpreter, torch, transformers and autopar (seconds each on two shared
cores), more than most tests' training. A pool spawns `world_size` ranks that join one gloo group and then wait
for tasks: the test process sends each rank `fn` and its arguments (by pickle: `fn` importable at module level)
with its own environment of the moment, each rank runs `fn(rank, world_size, *args)`, writes what it returned to a
file and says so on a queue.

It keeps the guarantees of a fresh world (`harness.run_distributed(..., fresh=True)`):
- a wait is bounded: ranks that have not finished `timeout_s` after the task was sent are asked for their stacks
  and killed, and `RankTimeoutError` names them and where each waited;
- a rank that raises fails the call with its traceback; a rank that dies fails it with its exit code;
- after either, or after a task that left autopar's modules or torch.distributed's functions patched (a test
  hook not undone), the pool is stopped and the next call spawns a new one: no later test runs on ranks left
  hung, desynchronized or patched.
Before each task a rank takes the caller's environment and puts back what it started with: one thread, the default
dtype, grad mode, its torch random state; after it, what `harness.for_this_run` set. `AUTOPAR_TEST_RANK_POOL=0`
spawns a fresh world for every call instead (to tell a test's own failure from an earlier test's leftovers).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

START_TIMEOUT_S = 300.0  # spawning and joining the group: the slowest is eight ranks on two loaded cores
POLL_S = 0.2  # how often the test process looks at the ranks' liveness while it waits
ORPHAN_CHECK_S = 5.0  # how often an idle rank checks that the test process still lives
# worlds kept alive at once (the most recently used sizes): two, as most files use 2 ranks and some 4, and a file that
# runs both would otherwise respawn a world (5 s of CPU a rank) at each switch. An idle rank holds about 500 MB
# resident; under pytest-xdist (`make test`: two workers) each worker keeps its own, so about 6 GB at most
KEEP = 2
# modules whose attributes a task must put back as it found them: every attribute of autopar's modules and of the
# classes they define (a constant set for a test is a patch too), the functions of torch.distributed's
# what the fork server imports before it forks ranks: what every rank imports to join a group and train a model
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "autopar",
    "autopar.api",
    "autopar.runtime",
    "tests.models",
    "tests.distributed.harness",
)
WATCHED = {"autopar": lambda value: True, "torch.distributed": callable}


def _fingerprint() -> dict:
    """What a test hook would patch: the watched attributes, by identity."""
    out = {}
    with warnings.catch_warnings():  # reading an attribute may warn that it is deprecated
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            _watch(out, name, module)
    return out


def _watch(out: dict, name: str, module) -> None:
    watch = next((w for prefix, w in WATCHED.items() if name == prefix or name.startswith(prefix + ".")), None)
    if module is None or watch is None:
        return
    for attr, value in list(vars(module).items()):
        if watch(value):
            out[(name, attr)] = id(value)
        if isinstance(value, type) and value.__module__ == name:
            for cattr, cvalue in list(vars(value).items()):
                if watch(cvalue) and not cattr.startswith("__"):
                    out[(name, attr, cattr)] = id(cvalue)


def _changed(before: dict, after: dict) -> list[str]:
    """The attributes present before whose value is another object now."""
    return sorted(".".join(k) for k, v in before.items() if after.get(k, v) != v)


def _alive(pid: int) -> bool:
    """Whether process `pid` lives (a rank's parent is the fork server, not the test process it serves)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def rank_context():
    """The start method of every rank: forked from a server that has imported torch, transformers and autopar once
    (a rank starts in a fraction of a second instead of several seconds of imports), never from the test process
    itself (whose threads and state a fork would copy). A rank sees the environment of its caller, not the
    server's: the pool sends it with each task, `harness.run_distributed` with its world."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _serve(rank: int, world_size: int, folder: str, tasks, done, parent: int) -> None:
    """A rank of the pool: join the group, then run tasks until told to stop or orphaned."""
    from tests.distributed.harness import join_group, undo_for_this_run

    join_group(rank, world_size, folder)
    fresh_rng = torch.random.get_rng_state()
    done.put((0, rank, "up"))
    while True:
        try:
            item = tasks.get(timeout=ORPHAN_CHECK_S)
        except queue.Empty:
            if not _alive(parent):  # the test process is gone (killed): nobody will stop us
                break
            continue
        if item is None:
            break
        number, payload = item
        before = {}
        try:
            fn, args, env = pickle.loads(payload)  # imports fn's module: what it imports is watched
            before = _fingerprint()
            os.environ.clear()
            os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            torch.random.set_rng_state(fresh_rng)
            data = {"ok": True, "result": fn(rank, world_size, *args)}
        except BaseException as e:  # the test process reports it with the rank's traceback
            data = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        undo_for_this_run()
        # objects in reference cycles may hold async work handles of the group: free them while it lives
        gc.collect()
        data["patched"] = _changed(before, _fingerprint())
        torch.save(data, f"{folder}/task{number}.rank{rank}.pt")
        done.put((number, rank, "ok" if data["ok"] else "failed"))
    import torch.distributed as dist

    dist.destroy_process_group()


class RankPool:
    """`world_size` gloo ranks that run one task at a time (see the module's notes)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.folder = tempfile.mkdtemp(prefix="autopar-ranks-")
        ctx = rank_context()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.done = ctx.Queue()
        self.processes = [
            ctx.Process(
                target=_serve, args=(r, world_size, self.folder, self.tasks[r], self.done, os.getpid()), daemon=True
            )
            for r in range(world_size)
        ]
        self.number = 0
        for p in self.processes:
            p.start()
        try:
            self._wait(0, START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, fn, args: tuple, timeout_s: float) -> list:
        """`fn(rank, world_size, *args)` on every rank; each rank's result. Raises as `harness.run_distributed`
        says, after which this pool is closed."""
        self.number += 1
        payload = pickle.dumps((fn, args, dict(os.environ)))
        for q in self.tasks:
            q.put((self.number, payload))
        self._wait(self.number, timeout_s, "finish")
        out, patched = [], []
        for r in range(self.world_size):
            path = Path(self.folder) / f"task{self.number}.rank{r}.pt"
            data = torch.load(path, weights_only=False)
            path.unlink()
            out.append(data["result"])
            patched += [f"rank {r}: {name}" for name in data["patched"]]
        if patched:
            self.close()
            raise AssertionError(
                f"{fn.__name__} left these patched on the pool's ranks (the ranks were stopped): {patched[:8]}; "
                "set it with `harness.for_this_run`, undo it in a `finally`, or run with `run_distributed(..., fresh=True)`"
            )
        return out

    def _wait(self, number: int, timeout_s: float, what: str) -> None:
        """Until every rank reports task `number` (0: joined the group); raise, closing the pool, when one
        failed, died, or `timeout_s` passed first."""
        from tests.distributed.harness import RankTimeoutError, stuck_report

        deadline = time.monotonic() + timeout_s
        finished: set[int] = set()
        while len(finished) < self.world_size:
            try:
                got, rank, status = self.done.get(timeout=POLL_S)
            except queue.Empty:
                got = None
            if got is None:
                dead = [(r, p.exitcode) for r, p in enumerate(self.processes) if r not in finished and not p.is_alive()]
                stuck = [r for r in range(self.world_size) if r not in finished]
                if dead:
                    self.close()
                    raise AssertionError(f"rank(s) {dead} (rank, exit code) died before they could {what}")
                if time.monotonic() > deadline:
                    report = stuck_report(self.processes, stuck, self.folder, timeout_s, verb=what)
                    self.close()
                    raise RankTimeoutError(report)
                continue
            assert got == number, (got, number)  # a pool runs one task at a time
            if status == "failed":
                error = torch.load(Path(self.folder) / f"task{number}.rank{rank}.pt", weights_only=False)["error"]
                self.close()
                raise AssertionError(f"rank {rank} failed: {error}")
            finished.add(rank)

    def close(self) -> None:
        """Stop the ranks (asking first, then killing those that do not stop) and remove the folder."""
        for p, q in zip(self.processes, self.tasks, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for q in [*self.tasks, self.done]:
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


_POOLS: OrderedDict[int, RankPool] = OrderedDict()


def run_pooled(fn, world_size: int, args: tuple, timeout_s: float) -> list:
    """Run on the pool of `world_size` ranks, spawning it if there is none (or the last one was stopped)."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = RankPool(world_size)
        _POOLS[world_size] = pool
    _POOLS.move_to_end(world_size)
    while len(_POOLS) > KEEP:
        next(iter(_POOLS.values())).close()
    return pool.run(fn, args, timeout_s)


@atexit.register
def close_all() -> None:
    """Stop every pool (at the end of the pytest run)."""
    for pool in list(_POOLS.values()):
        pool.close()

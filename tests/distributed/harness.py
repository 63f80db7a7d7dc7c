"""Run a function on gloo ranks on CPU and collect what each returns.

Ranks rendezvous through a file in a temporary folder (no fixed ports), run with one thread
each (two cores are shared by all ranks), and hand their results back as files. By default a
call runs on the pytest run's pool of ranks of that size (`tests/distributed/pool.py`: spawned
once, kept for the next test); `fresh=True` spawns a world for the one call, for tests that
kill ranks or need something at the group's start.

A run never hangs the test session: past `timeout_s` the parent asks every rank that has not
finished for its Python stack (faulthandler on SIGUSR1), kills every rank still alive, and
raises `RankTimeoutError` naming the ranks that did not finish and where each was waiting
(a collective shows as the torch.distributed call on top of its stack).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.distributed.pool import rank_context, run_pooled

POLL_S = 1.0  # how often the parent checks for a finished or failed rank
STACK_WAIT_S = 2.0  # how long a stuck rank gets to write its stack before it is killed
STACK_LINES = 12  # lines of each stuck rank's stack quoted in the error


_UNDO: list[tuple[object, str, object]] = []  # what `for_this_run` set on this rank, with the value it replaced


def for_this_run(target, name: str, value) -> None:
    """On a rank: set `target.name` to `value` (a constant of a module, a function to record calls) until the run
    of the rank's function ends; a pool's rank runs the next test with the old value back."""
    _UNDO.append((target, name, getattr(target, name)))
    setattr(target, name, value)


def undo_for_this_run() -> None:
    """Put back what `for_this_run` set, the latest first."""
    while _UNDO:
        target, name, old = _UNDO.pop()
        setattr(target, name, old)


class RankTimeoutError(AssertionError):
    """Some ranks did not finish within the run's time limit (a hang: usually a collective some rank skipped)."""


def join_group(rank: int, world_size: int, folder: str) -> None:
    """Make this process rank `rank` of a gloo group rendezvousing in `folder`, with one thread, and write its
    stack to `folder/rank{rank}.stack` when asked (SIGUSR1)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    stack_file = open(f"{folder}/rank{rank}.stack", "w")  # noqa: SIM115 - open for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)


def _entry(rank: int, world_size: int, folder: str, fn, args, env: dict) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment, not the fork server's
    os.environ.update(env)
    join_group(rank, world_size, folder)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, f"{folder}/rank{rank}.pt")
    except BaseException as e:  # the parent reports it with the rank's traceback
        torch.save(
            {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}, f"{folder}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def stuck_report(processes, stuck: list[int], folder: str, timeout_s: float, verb: str = "finish") -> str:
    """Ask the ranks in `stuck` for their stacks, kill every rank still alive, and say who was stuck where."""
    alive = [(r, p) for r, p in enumerate(processes) if p.is_alive()]
    for r, p in alive:
        if r in stuck:
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(STACK_WAIT_S)
    for _, p in alive:
        if p.is_alive():
            p.kill()
    for _, p in alive:
        p.join(timeout=10)
    finished = [r for r in range(len(processes)) if r not in stuck]
    lines = [
        f"rank(s) {stuck} did not {verb} within {timeout_s:g} s (finished: {finished or 'none'}); every rank was killed"
    ]
    for r in stuck:
        path = Path(folder) / f"rank{r}.stack"  # absent when the rank had not started its interpreter yet
        text = path.read_text().strip().splitlines() if path.exists() else ["(not started)"]
        main = _main_thread(text)
        lines.append(f"rank {r} was at (innermost first):\n  " + "\n  ".join(main[:STACK_LINES] or ["(no stack)"]))
    return "\n".join(lines)


def _main_thread(lines: list[str]) -> list[str]:
    """The frames of the thread that runs the rank's function (the one whose stack holds `_entry`, or the pool's
    `_serve`); the signal
    may land on any thread, and faulthandler lists them in no fixed order."""
    threads: list[list[str]] = []
    for line in lines:
        if line.startswith(("Current thread", "Thread")):
            threads.append([])
        elif line.strip().startswith("File") and threads:
            threads[-1].append(line.strip())
    return next(
        (t for t in threads if any(f.endswith((" in _entry", " in _serve")) for f in t)), threads[0] if threads else []
    )


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600.0, fresh: bool = False) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be importable (defined at module level). Raises with the first failing rank's traceback, or
    `RankTimeoutError` naming the ranks still running after `timeout_s` seconds (which are killed).
    On the pool of `world_size` ranks unless `fresh` (or `AUTOPAR_TEST_RANK_POOL=0` in the environment, to tell a
    test's failure from a leak of an earlier test's); the ranks see the caller's environment either way.
    """
    if not fresh and os.environ.get("AUTOPAR_TEST_RANK_POOL", "1") != "0":
        return run_pooled(fn, world_size, args, timeout_s)
    with tempfile.TemporaryDirectory() as folder:
        rank_context()  # the fork server's imports
        ctx = mp.start_processes(
            _entry,
            args=(world_size, folder, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=POLL_S):
            if time.monotonic() > deadline:
                stuck = [r for r in range(world_size) if not (Path(folder) / f"rank{r}.pt").exists()]
                raise RankTimeoutError(stuck_report(ctx.processes, stuck, folder, timeout_s))
        out = []
        for r in range(world_size):
            path = Path(folder) / f"rank{r}.pt"
            data = torch.load(path, weights_only=False)
            if not data["ok"]:
                raise AssertionError(f"rank {r} failed: {data['error']}")
            out.append(data["result"])
        return out


@contextlib.contextmanager
def backward_marks(note):
    """Within it, every value an op of a program's graph makes that needs a gradient calls `note(node name)` when the
    backward reaches it (a tensor hook: its gradient is in, its op's backward comes next). Marks where the backward's
    compute stands among a program's own events. The ops are those of a lowered graph (`passes.lower.run_graph`,
    named by the traced node they come from) or of a `ShardedInterpreter`."""
    from torch.utils import _pytree as pytree

    from autopar.passes import lower
    from autopar.passes.parallelize import ShardedInterpreter

    def mark(out, name):
        for v in pytree.tree_leaves(out):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(lambda _, name=name: note(name))

    inner = ShardedInterpreter._run_op

    def run_op(self, n):
        out = inner(self, n)
        mark(out, n.name)
        return out

    class Marking(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op in ("call_function", "call_module") and "autopar_origin" in n.meta:
                mark(out, n.meta["autopar_origin"])
            return out

    run_graph = lower.run_graph
    ShardedInterpreter._run_op = run_op
    lower.run_graph = lambda gm, *args: Marking(gm).run(*args)
    try:
        yield
    finally:
        ShardedInterpreter._run_op = inner
        lower.run_graph = run_graph

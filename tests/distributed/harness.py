"""Spawn gloo ranks on CPU and collect what each returns.

Ranks rendezvous through a file in a temporary folder (no fixed ports), run with one thread
each (two cores are shared by all ranks), and hand their results back as files.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, folder: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, f"{folder}/rank{rank}.pt")
    except BaseException as e:  # the parent reports it with the rank's traceback
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be importable (defined at module level). Raises with the first failing rank's traceback.
    """
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_entry, args=(world_size, folder, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")  # fmt: skip
        while not ctx.join(timeout=timeout_s):
            pass
        out = []
        for r in range(world_size):
            path = Path(folder) / f"rank{r}.pt"
            data = torch.load(path, weights_only=False)
            if not data["ok"]:
                raise AssertionError(f"rank {r} failed: {data['error']}")
            out.append(data["result"])
        return out

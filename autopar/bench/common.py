"""What every suite shares: the environment record, progress reporting, and writing results.

Every JSON document a suite writes starts with `environment()`: the autopar and torch versions
and a description of the machine, so that figures from two machines are never compared by accident.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from autopar.units import GIB


def environment() -> dict:
    """Versions and machine facts that a reader of a benchmark result needs to judge it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        autopar_version = version("autopar")
    except PackageNotFoundError:
        autopar_version = "unknown"
    return {
        "autopar_version": autopar_version,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        # not platform.platform() / processor(): on Linux they run `uname -p` in a child process
        "platform": f"{platform.system()}-{platform.release()}-{platform.machine()}",
        "machine": platform.machine(),
        "processor": _cpu_model() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _total_memory_bytes(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def progress(items: Iterable, *, desc: str, total: int | None = None, enabled: bool = True) -> Iterator:
    """Iterate over `items` with a progress bar on stderr: tqdm when installed, else one line per item."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=True)
        return
    items = list(items)
    for i, item in enumerate(items):
        print(f"[autopar bench] {desc}: {i + 1}/{len(items)}", file=sys.stderr, flush=True)
        yield item


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def md_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; None prints as an em dash."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join("—" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def fmt_ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def fmt_gib(n: float | None) -> str | None:
    if n is None:
        return None
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def fmt_pct(x: float | None) -> str | None:
    return None if x is None else f"{x:.1%}"


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[autopar bench] matplotlib is not installed: no plot (pip install 'autopar[bench]')", file=sys.stderr)
        return None
    return plt


def env_md(env: dict) -> str:
    return (
        f"autopar {env['autopar_version']}, torch {env['torch_version']}, Python {env['python_version']} on "
        f"{env['processor']} ({env['cpu_count']} CPUs), {env['platform']}, {env['time_utc']}"
    )


def _rank_entry(rank: int, world: int, folder: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        torch.save({"ok": True, "result": fn(rank, world, *args)}, f"{folder}/rank{rank}.pt")
    except BaseException as e:  # the parent reports it with this rank's traceback
        torch.save(
            {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}, f"{folder}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn, *args, label: str) -> list:
    """fn(rank, world, *args) on `world` spawned gloo ranks (one thread each); each rank's result. A rank that
    raises fails the call with `label` and that rank's traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(
            _rank_entry, args=(world, folder, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        while not ctx.join():
            pass
        out = []
        for r in range(world):
            data = torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
            if not data["ok"]:
                raise RuntimeError(f"{label}: rank {r} failed: {data['error']}")
            out.append(data["result"])
        return out

"""What every suite shares: the environment record, progress reporting, and writing results.

Every JSON document a suite writes starts with `environment()`: the autopar and torch versions
and a description of the machine, so that figures from two machines are never compared by accident.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

GIB = 1024**3


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
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model() or platform.processor(),
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
    return (f"autopar {env['autopar_version']}, torch {env['torch_version']}, Python {env['python_version']} on "
            f"{env['processor']} ({env['cpu_count']} CPUs), {env['platform']}, {env['time_utc']}")  # fmt: skip

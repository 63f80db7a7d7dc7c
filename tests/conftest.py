"""What the whole suite shares: a test that starts a process says so by a marker.

The tiers (`make check`, `make test`, `make test-all`) choose tests by markers: `distributed` (spawns gloo ranks),
`subprocess` (starts another interpreter or program) and `slow`. `make check` promises to start no process, so a
test that starts one without `distributed` or `subprocess` fails here, naming the marker to add.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from pathlib import Path

import pytest

STARTS_PROCESSES = ("distributed", "subprocess")
# The files that take longest in `make test` (measured with --durations=0 on 2 cores), longest first: pytest-xdist
# hands out whole files (`--dist loadfile --no-loadscope-reorder`) in the order of `pytest_collection_modifyitems`,
# and a long file handed out last keeps one worker busy while the other has finished. The rest follow, the files of
# more tests first (xdist's own order).
LONGEST_FIRST = (
    "tests/distributed/test_finetune_example.py",
    "tests/passes/test_sharding_solver.py",
    "tests/distributed/test_sharded_overlap.py",
    "tests/test_plan_snapshots.py",
    "tests/passes/test_context_parallel_pipeline.py",
    "tests/distributed/test_step_guard.py",
    "tests/distributed/test_programs.py",
    "tests/distributed/test_family_matrix.py",
    "tests/distributed/test_pipeline_numerics.py",
    "tests/distributed/test_train_numerics.py",
)


_MISSING = [p for p in LONGEST_FIRST if not (Path(__file__).resolve().parents[1] / p).exists()]
if _MISSING:
    raise RuntimeError(f"tests/conftest.py LONGEST_FIRST names files that are not there: {_MISSING}")


def pytest_collection_modifyitems(config, items):
    files: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        files[path] = files.get(path, 0) + 1

    def rank(item) -> tuple:
        path = item.nodeid.split("::")[0]
        first = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        return (first, -files[path], path)

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request, monkeypatch):
    if any(request.node.get_closest_marker(name) for name in STARTS_PROCESSES):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process but is marked neither `distributed` (gloo ranks) nor "
            "`subprocess` (another program): mark it, so that `make check` leaves it out"
        )

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)

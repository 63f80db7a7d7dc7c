"""What the whole suite shares: a test that starts a process says so by a marker.

The tiers (`make check`, `make test`, `make test-all`) choose tests by markers: `distributed` (spawns gloo ranks),
`subprocess` (starts another interpreter or program) and `slow`. `make check` promises to start no process, so a
test that starts one without `distributed` or `subprocess` fails here, naming the marker to add.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

STARTS_PROCESSES = ("distributed", "subprocess")


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

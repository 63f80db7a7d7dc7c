"""The tiers' pytest-xdist flags (the Makefile's XDIST): a worker that crashes fails the run at once."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _xdist_flags() -> list[str]:
    line = re.search(r"^XDIST := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, "the Makefile defines XDIST, the flags of make test and make test-all"
    return line.group(1).replace("$(JOBS)", "2").split()


@pytest.mark.subprocess
def test_a_crashed_worker_fails_the_run_naming_its_test(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings and conftest
    (tmp_path / "test_crash.py").write_text(
        "import os, signal\n\ndef test_before():\n    pass\n\n"
        "def test_crashes():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\ndef test_after():\n    pass\n"
    )
    for name in "bcde":
        (tmp_path / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")
    start = time.monotonic()
    # restarting workers (xdist's default) left this run waiting for ever; 120 s is 20 times what it takes
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_xdist_flags()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    assert "crashed while running 'test_crash.py::test_crashes'" in done.stdout, done.stdout[-2000:]
    assert time.monotonic() - start < 120

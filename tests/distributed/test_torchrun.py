"""Launch with torchrun as a user would: two "nodes" on localhost, one rank each."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slow: two torchrun agents and their ranks start, import and rendezvous (70 s on a busy 2-core machine); `make test`
# launches through torchrun in tests/distributed/test_finetune_example.py
@pytest.mark.slow
def test_two_nodes_on_localhost():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(node_rank: int) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node_rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(REPO / "examples" / "train_llama.py"),
            "--steps",
            "2",
            "--seq-len",
            "16",
        ]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)

    procs = [launch(0), launch(1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "2 nodes x 1 cpu" in outs[0] or "2 nodes" in outs[0], outs[0][-2000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in outs[0].splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(x > 0 for x in losses)

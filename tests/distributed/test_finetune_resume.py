"""The fine-tuning example under torchrun on 2 CPU ranks: a run whose rank 1 kills itself (SIGKILL) at step 4 is
restarted by torchrun (`--max-restarts 1`), resumes from the newest checkpoint and ends with the final loss
of an uninterrupted run; both write Hugging Face weights that transformers loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.checkpoint.lock import LOCK

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
# The same program on the same layout resumes the same arithmetic: the final losses agree to the last bit in
# practice; the tolerance is the issue's.
RTOL = 1e-6


def _torchrun(workdir: Path, torchrun_args=(), script_args=()) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *torchrun_args,
        str(REPO / "examples" / "finetune_resume.py"),
        "--workdir",
        str(workdir),
        "--steps",
        "8",
        *script_args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, timeout=400
    )
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _final_loss(out: str) -> float:
    found = re.findall(r"^final loss ([0-9.eE+-]+);", out, flags=re.M)
    assert found, out[-3000:]
    return float(found[-1])


def test_killed_rank_restarts_resumes_and_ends_with_the_same_loss(tmp_path):
    straight = _torchrun(tmp_path / "straight")
    killed = _torchrun(tmp_path / "killed", ("--max-restarts", "1"), ("--kill-rank", "1", "--kill-at-step", "4"))
    assert "rank 1 kills itself at step 4" in killed
    assert re.search(r"resumed from .*step000002 at step 2", killed), killed[-3000:]
    assert "resumed" not in straight
    assert _final_loss(killed) == pytest.approx(_final_loss(straight), rel=RTOL)
    from transformers import AutoModelForCausalLM

    for run in ("straight", "killed"):
        AutoModelForCausalLM.from_pretrained(tmp_path / run / "final")
    kept = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name != LOCK)
    assert kept == ["step000006", "step000008"], kept  # keep_last=2

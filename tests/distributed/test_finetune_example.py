"""The fine-tuning example (`examples/finetune.py`) in its smallest form, under torchrun on 2 CPU ranks with LoRA:
a run stopped at step 2 and resumed ends with the loss of a run that went straight through, and the adapters and
the merged model it exports load with peft and transformers and generate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="PEFT is in the test extra: pip install -e .[test]")

# `make test-all`: three torchrun jobs; `make test` runs a torchrun job in test_torchrun and trains LoRA in test_peft
pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
# the same program on the same layout resumes the same arithmetic (schedule, data order, optimizer states):
# the losses agree to the last printed digit in practice; 1e-6 is the tolerance
RTOL = 1e-6


def _run(workdir: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(REPO / "examples" / "finetune.py"), "--workdir", str(workdir), "--steps", "4", "--lora", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _final_loss(out: str) -> float:
    found = re.findall(r"^final loss ([0-9.eE+-]+);", out, flags=re.M)
    assert found, out[-3000:]
    return float(found[-1])


def test_the_finetune_example_resumes_exports_and_generates(tmp_path):
    stopped = _run(tmp_path / "job", "--stop-at", "2", "--save-every", "10")
    assert "stopped at step 2" in stopped and "final loss" not in stopped
    resumed = _run(tmp_path / "job", "--save-every", "10")
    assert re.search(r"resumed from .*step000002 at step 2", resumed), resumed[-3000:]
    straight = _run(tmp_path / "straight", "--save-every", "10")
    assert "resumed" not in straight
    assert _final_loss(resumed) == pytest.approx(_final_loss(straight), rel=RTOL)
    # each step logs the loss, the global gradient norm and the tokens of its batch; batches of varying length
    steps = re.findall(r"^step \d+: loss [0-9.]+, grad norm ([0-9.]+), tokens (\d+), length (\d+)", straight, re.M)
    assert len(steps) == 4 and all(float(n) > 0 and int(t) > 0 for n, t, _ in steps), straight[-3000:]
    # the exported adapters (peft) and merged model (transformers) generate the same tokens
    generated = re.findall(r"^(loaded|merged) generates: (.*)$", resumed, re.M)
    assert [g[0] for g in generated] == ["loaded", "merged"] and generated[0][1] == generated[1][1], resumed[-3000:]
    assert (tmp_path / "job" / "final" / "adapter_config.json").exists()
    assert (tmp_path / "job" / "merged" / "model.safetensors").exists()

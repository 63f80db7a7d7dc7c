"""The fine-tuning example (`examples/finetune.py`) in its smallest form, under torchrun on 2 CPU ranks with LoRA:
its loss falls, a run resumed from a checkpoint another run wrote at step 2 ends with that run's loss, and the
adapters and the merged model it exports load with peft and transformers and generate the same tokens."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="PEFT is in the test extra: pip install -e .[test]")

# in `make test`: two torchrun jobs of a one-layer model, 16 tokens, 4 steps (about 20 s of CPU each)
pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]
REPO = Path(__file__).resolve().parents[2]
# the smallest form: what a user runs, but one layer of 32 wide, 16 tokens, 4 steps, a learning rate at which
# LoRA's loss falls visibly within them, a checkpoint every 2 steps
SMALL = ("--steps", "4", "--lora", "--layers", "1", "--hidden-size", "32", "--max-length", "16")
SMALL += ("--vocab-size", "300", "--lr", "2e-2", "--save-every", "2", "--generate", "3")
# the same program on the same layout resumes the same arithmetic (schedule, data order, optimizer states):
# the losses agree to the last printed digit in practice; 1e-6 is the tolerance
RTOL = 1e-6


def _run(workdir: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(REPO / "examples" / "finetune.py"), "--workdir", str(workdir), *SMALL]
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


def test_the_finetune_example_trains_resumes_exports_and_generates(tmp_path):
    straight = _run(tmp_path / "straight")
    assert "resumed" not in straight
    # each step logs the loss, the global gradient norm and the tokens of its batch
    steps = re.findall(r"^step \d+: loss ([0-9.]+), grad norm ([0-9.]+), tokens (\d+), length (\d+)", straight, re.M)
    assert len(steps) == 4 and all(float(n) > 0 and int(t) > 0 for _, n, t, _ in steps), straight[-3000:]
    # the data and the initial weights are seeded: the last step's loss below the first is what 4 steps of LoRA
    # at 2e-2 give (5.70 to 5.66); a step that does not update the adapters leaves it where it was
    assert float(steps[-1][0]) < float(steps[0][0]), straight[-3000:]

    # a job interrupted after step 2: its folder as the straight run left it then (corpus, tokenizer, weights,
    # plan, the step-2 checkpoint); resumed, it runs steps 3 and 4 and ends where the straight run ended
    job = tmp_path / "job"
    job.mkdir()
    for name in ("corpus.txt", "tokenizer.json", "plan.json"):
        shutil.copy(tmp_path / "straight" / name, job / name)
    shutil.copytree(tmp_path / "straight" / "base", job / "base")
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step000002", job / "checkpoints" / "step000002")
    resumed = _run(job)
    assert re.search(r"resumed from .*step000002 at step 2", resumed), resumed[-3000:]
    assert re.findall(r"^step (\d+):", resumed, re.M) == ["3", "4"], resumed[-3000:]
    assert _final_loss(resumed) == pytest.approx(_final_loss(straight), rel=RTOL)

    # the exported adapters (peft) and merged model (transformers) generate the same tokens
    generated = re.findall(r"^(loaded|merged) generates: (.*)$", resumed, re.M)
    assert [g[0] for g in generated] == ["loaded", "merged"] and generated[0][1] == generated[1][1], resumed[-3000:]
    assert (job / "final" / "adapter_config.json").exists()
    assert (job / "merged" / "model.safetensors").exists()

"""The docs' examples that train under torchrun, run as a user runs them: two gloo ranks on this machine.

`tests/test_docs.py` only compiles these (they need a process group); here the README's training example and
the checkpoints page's example run under `torchrun --standalone --nproc_per_node 2`, the latter twice: the
second run resumes from the newest checkpoint the first one wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _example(page: str, containing: str) -> str:
    return next(b for b in FENCE.findall((REPO / page).read_text()) if containing in b)


def _torchrun(script: Path, cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_readme_training_example(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_example("README.md", "autopar.compile") + "print('trained', loss)\n")
    out = _torchrun(script, tmp_path)
    losses = [float(line.split()[1]) for line in out.splitlines() if line.startswith("trained ")]
    assert len(losses) == 2 and all(loss > 0 for loss in losses), out  # one line per rank


def test_checkpoints_example_trains_saves_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf_dir")
    script = tmp_path / "finetune.py"
    script.write_text(
        _example("docs/checkpoints.md", "save_checkpoint") + "print('started at', extra['data_position'])\n"
    )
    assert _torchrun(script, tmp_path).count("started at 0") == 2  # no checkpoint yet: both ranks start at 0
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["step-2", "step-3", "step-4"], kept  # keep_last=3 of four saves
    assert _torchrun(script, tmp_path).count("started at 4") == 2  # resumed from step-4: no step left
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == kept
    AutoModelForCausalLM.from_pretrained(tmp_path / "out_dir")  # what transformers reads

"""The checkpoint benchmarks (`autopar bench soak`, `autopar bench checkpoint`) on a few steps of tiny models:
they write their documents, and the checks they report hold (loadability, latest, retention); a pruning
rule that kept the wrong checkpoints would show as retention_honoured False."""

from __future__ import annotations

import json

import pytest

from autopar.bench import checkpoints
from autopar.bench.checkpoints import SoakSettings, TimingSettings
from autopar.cli import main

pytestmark = pytest.mark.distributed


@pytest.mark.slow  # two spawns of two ranks: about 25 s on two loaded cores
def test_soak_records_memory_and_checks_every_checkpoint(tmp_path):
    settings = SoakSettings(steps=6, every=2, keep_last=2, constraints=(("tp", 2),), batch=4, seq=8)
    doc = checkpoints.run_soak(tmp_path, cluster="cpu:2", settings=settings, show_progress=False)
    assert json.loads((tmp_path / "soak.json").read_text())["summary"] == doc["summary"]
    assert "| step |" in (tmp_path / "soak.md").read_text()
    assert [rec["step"] for rec in doc["ranks"][0]["records"]] == [2, 4, 6]
    assert all(rec["rss_bytes"] > 0 for r in doc["ranks"] for rec in r["records"])
    assert doc["expected_kept_steps"] == [4, 6]
    s = doc["summary"]
    assert s["every_checkpoint_loadable"] and s["latest_is_the_newest"] and s["retention_honoured"]
    assert doc["ranks"][0]["mesh"]["tp"] == 2
    assert not list(tmp_path.glob("soak-*")), "the soak left its checkpoints behind"


@pytest.mark.slow  # about 20 s
def test_checkpoint_timing_writes_both_rows(tmp_path):
    settings = TimingSettings(hidden=32, layers=1, intermediate=64, vocab=128, repeats=1)
    doc = checkpoints.run_checkpoint_timing(tmp_path, cluster="cpu:2", settings=settings, show_progress=False)
    ranks, ref = doc["ranks"], doc["torch_save"]
    assert len(ranks) == 2 and all(r["save_s"][0] > 0 and r["load_s"][0] > 0 for r in ranks)
    # the same state on disk both ways: masters and moments (within the formats' own bookkeeping)
    assert 0.5 < ranks[0]["bytes"] / ref["bytes"] < 2
    # an asynchronous save blocks for part of the time it takes to be committed
    assert all(0 < b <= c for r in ranks for b, c in zip(r["async_blocked_s"], r["async_committed_s"], strict=True))
    text = (tmp_path / "checkpoint.md").read_text()
    assert "torch.save" in text and "async_save=True" in text


def test_cli_refuses_a_gpu_cluster_for_the_soak(tmp_path, capsys):
    assert main(["bench", "soak", "--cluster", "8xA100-80GB", "--out", str(tmp_path), "--quiet"]) == 2
    assert "must be 'cpu:N'" in capsys.readouterr().err

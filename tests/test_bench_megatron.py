"""`autopar bench calibrate`: the Megatron-LM (SC'21) Table 1 step times and autopar's prediction of them."""

from __future__ import annotations

import json

import pytest

from autopar.bench import megatron


def _row(name):
    return next(r for r in megatron.ROWS if r.name == name)


def test_published_step_time_matches_hand_computation():
    # 18.4B: B=1024, s=2048, l=40, h=6144, V=51200 on 256 GPUs at 135 TFLOP/s each.
    row = _row("18.4b")
    by_hand = 96 * 1024 * 2048 * 40 * 6144**2 * (1 + 2048 / (6 * 6144) + 51200 / (16 * 40 * 6144))
    assert megatron.published_flops(row) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(3.2484e17, rel=1e-4)  # written out: 3.2484e17 FLOPs per iteration
    assert megatron.published_step_time_s(row) == pytest.approx(by_hand / (256 * 135e12), rel=1e-12)
    assert megatron.published_step_time_s(row) == pytest.approx(9.399, rel=1e-3)


def test_rows_and_layouts():
    assert megatron.ROW_NAMES == ("1.7b", "18.4b", "76.1b", "310.1b", "529.6b")
    for row in megatron.ROWS:
        assert row.dp * row.tp * row.pp == row.gpus
        assert row.layers % row.pp == 0 and row.hidden % row.heads == 0
    assert _row("529.6b").cluster == "315x8xA100-80GB"
    # the run script's --num-layers-per-virtual-pipeline-stage 5 / 3 / 1 over 60/4, 96/16 and 105/35 layers per stage
    assert [r.virtual_stages for r in megatron.ROWS] == [1, 1, 3, 2, 3]
    assert [r.micro_batch for r in megatron.ROWS] == [16, 8, 2, 1, 1]
    assert _row("76.1b").constraints() == {
        "tp": 8,
        "pp": 4,
        "dp": 32,
        "zero": 0,
        "recompute": "full",
        "micro_batch_size": 2,
        "schedule": "interleaved_1f1b",
        "virtual_stages": 3,
    }
    assert "schedule" not in _row("18.4b").constraints() and _row("18.4b").constraints()["micro_batch_size"] == 8
    assert [r.name for r in megatron.select_rows("1.7B,18.4")] == ["1.7b", "18.4b"]
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown calibration row"):
        megatron.select_rows("7b")


@pytest.mark.integration
def test_small_row_planned_end_to_end(tmp_path, capsys):
    doc = megatron.run(tmp_path, rows="1.7b", show_progress=False)
    (r,) = doc["rows"]
    fp32, bf16 = r["predicted_fp32_handed"]["step_time_s"], r["predicted_bf16_handed"]["step_time_s"]
    assert bf16 == pytest.approx(fp32, rel=1e-3)  # mixed precision prices the same step whatever dtype is handed in
    assert r["published_step_time_s"] == pytest.approx(3.528, rel=1e-3)
    assert abs(r["error_pct"]) <= 15.0, r
    assert r["predicted_fp32_handed"]["mesh"] == {"dp": 32, "tp": 1}
    assert r["predicted_fp32_handed"]["recompute"] == "full"
    assert json.loads((tmp_path / "calibrate.json").read_text())["rows"][0]["row"]["name"] == "1.7b"
    assert "| 1.7B |" in (tmp_path / "calibrate.md").read_text()
    assert "| 1.7B |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.integration
def test_tensor_parallel_row_planned_with_the_run_scripts_micro_batch(tmp_path):
    # 18.4B: tp=8 inside a node, dp=32 across nodes, MBS 8 of the 32 sequences per data-parallel rank
    doc = megatron.run(tmp_path, rows="18.4b", show_progress=False)
    (r,) = doc["rows"]
    assert r["predicted_fp32_handed"]["layout"] == "tp8 pp1 dp32, mbs 8 x4"
    assert r["predicted_fp32_handed"]["num_microbatches"] == 4
    assert abs(r["error_pct"]) <= 15.0, r

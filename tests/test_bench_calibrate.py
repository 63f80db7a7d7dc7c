"""`autopar bench calibrate`: torchtitan's published runs, Megatron-LM's Table 1 and nccl-tests, next to predictions."""

from __future__ import annotations

import json

import pytest

from autopar.bench import calibrate, nccl_tests, torchtitan
from autopar.errors import ConfigError


def _row(name):
    return next(r for r in torchtitan.ROWS if r.name == name)


@pytest.mark.parametrize(
    "name, seconds",
    [
        # local batch x sequence / (tokens/s per GPU x tp), the step times of the published tables
        ("tt-8b-fsdp8-h100", 2 * 8192 / 5762),  # 2.843 s
        ("tt-8b-fsdp128-h100", 2 * 8192 / 5605),  # 2.923 s
        ("tt-8b-fsdp8-tp8-h100", 12 * 8192 / (4378 * 8)),  # 2.807 s
        ("tt-70b-fsdp32-tp8-h100", 16 * 8192 / (597.3 * 8)),  # 27.43 s
        ("tt-8b-fsdp64-a100", 8192 / 2973),  # 2.755 s
        ("tt-70b-fsdp64-a100", 8192 / 331),  # 24.75 s
        ("tt-13b-fsdp64-a100", 2 * 4096 / 2162),  # 3.789 s
    ],
)
def test_published_step_times(name, seconds):
    row = _row(name)
    assert torchtitan.published_step_time_s(row) == pytest.approx(seconds, rel=1e-12)
    assert row.dp * row.tp == row.gpus
    assert row.constraints()["zero"] == 3 and row.constraints()["micro_batch_size"] == row.local_batch


def test_rows_name_their_skus_and_what_is_not_modelled():
    assert {r.device for r in torchtitan.ROWS} == {"H100-96GB-500W", "A100-80GB"}
    assert _row("tt-70b-fsdp32-tp8-h100").cluster == "32x8xH100-96GB-500W"
    assert _row("tt-8b-fsdp8-h100").memory_gib == 82.4 and _row("tt-8b-fsdp128-h100").memory_gib == 67.0
    for row in torchtitan.ROWS:
        if row.published_recompute.startswith("selective op"):
            assert torchtitan.GAP_OP_SAC in row.gaps, row.name
        if row.compiled:
            assert torchtitan.GAP_COMPILE in row.gaps, row.name


def test_rows_price_the_kernels_their_runs_called():
    # eager runs: SDPA's flash kernel for attention, every other op an ATen kernel of its own (norms, rotary
    # embedding, SwiGLU, the fp32 loss); compiled runs: autopar's fused norms and loss stand for Inductor's fusions
    assert {r.name: r.fuse_kernels for r in torchtitan.ROWS} == {
        "tt-8b-fsdp8-h100": ("attention",),
        "tt-8b-fsdp128-h100": ("attention",),
        "tt-8b-fsdp8-tp8-h100": True,
        "tt-70b-fsdp32-tp8-h100": True,
        "tt-8b-fsdp64-a100": ("attention",),
        "tt-70b-fsdp64-a100": ("attention",),
        "tt-13b-fsdp64-a100": ("attention",),
    }


def test_row_selection_across_both_sets():
    titan, meg = calibrate.select("tt-13b-fsdp64-a100,1.7b")
    assert [r.name for r in titan] == ["tt-13b-fsdp64-a100"] and [r.name for r in meg] == ["1.7b"]
    titan, meg = calibrate.select(None)
    assert len(titan) == 7 and len(meg) == 5
    with pytest.raises(ConfigError, match="unknown calibration rows"):
        calibrate.select("tt-9b")


def test_nccl_tests_points_that_check_the_model_independently():
    by_system = {p.system: p for p in nccl_tests.POINTS}
    # 8 HDR adapters of 24 GB/s each (a one-adapter measurement) give the 192 GB/s measured across DGX A100s
    point = by_system["DGX A100 nodes, 8 HDR adapters each"]
    got = nccl_tests.predicted(point)
    assert got["algorithm"] == "ring/simple" and got["bus_bandwidth_gb_s"] == pytest.approx(192, rel=0.02)
    # 1984 H200s: NCCL's tree, within the published 300-350 GB/s
    got = nccl_tests.predicted(by_system["H200, 248 nodes of 8 (1984 GPUs)"])
    assert got["algorithm"].startswith("tree") and 300 <= got["bus_bandwidth_gb_s"] <= 350
    # the points a preset figure comes from give it back
    for p in nccl_tests.POINTS:
        if p.defines:
            assert nccl_tests.predicted(p)["within_published"], p.system
    assert "| system |" in nccl_tests.markdown()


@pytest.mark.subprocess  # the machine description (`bench.common.environment`): Python's `platform` runs uname
@pytest.mark.integration  # plans a preset on its published layout
def test_one_torchtitan_row_end_to_end(tmp_path):
    doc = calibrate.run(tmp_path, rows="tt-13b-fsdp64-a100", show_progress=False)
    (r,) = doc["torchtitan"]
    assert r["published_step_time_s"] == pytest.approx(3.789, rel=1e-3)
    assert r["predicted"]["mesh"] == {"dp": 64, "tp": 1}
    assert r["predicted"]["recompute"] == "none"
    # the run kept every state on the device: the pinned layout offloads nothing, even where the model says it is
    # short of memory (then the row is planned past the device's memory and says so)
    assert "offload" not in r["predicted"]["time_breakdown"]
    # the ratio is what the model predicts of the row, whatever it is: a physical time, within a factor of 2
    assert 0.5 < r["ratio"] < 2.0
    assert doc["megatron"] == [] and len(doc["nccl_tests"]) == len(nccl_tests.POINTS)
    md = (tmp_path / "calibrate.md").read_text()
    assert "| tt-13b-fsdp64-a100 |" in md and "## Collectives: nccl-tests" in md
    assert json.loads((tmp_path / "calibrate.json").read_text())["torchtitan"][0]["row"]["name"] == r["row"]["name"]


@pytest.mark.integration  # traces a preset (two layers standing for 32)
def test_compute_terms_count_every_layer_of_the_model():
    from autopar.bench.compute_terms import compute_terms, markdown

    terms = compute_terms("llama3-8b", "H100-96GB-500W", 1, 512, ("attention",))
    linear = [t for t in terms if t.name.startswith("linear.default")]
    # Llama 3 8B's matmul weights, by hand: 32 layers of q, o (4096 x 4096), k, v (1024 x 4096), gate, up, down
    # (14336 x 4096), and the head (128256 x 4096); forward and backward 6 FLOPs per weight and token
    weights = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) + 128256 * 4096
    assert sum(t.flops for t in linear) == pytest.approx(6 * weights * 512, rel=1e-12)
    assert sum(t.count for t in linear) == 32 * 7 + 1
    flash = next(t for t in terms if "flash_attention" in t.name)
    assert flash.count == 32
    # eager: the norms run as their ATen ops, none fused
    assert not any("rms_norm" in t.name for t in terms) and any(t.name.startswith("pow") for t in terms)
    assert "| total |" in markdown(terms, 884e12)

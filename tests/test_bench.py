"""`autopar bench`: the quick suites on tiny cases, checked for structure and invariants.

The suites are run once per module on test-sized inputs passed through their arguments (tiny
presets, small clusters and grids, few repetitions), so the whole file stays well under 90 s on
two cores. No timing is asserted beyond "measured, positive, not a constant".
"""

from __future__ import annotations

import json
import warnings

import pytest

from autopar import presets
from autopar.bench import compile_time, execution, plans
from autopar.bench.execution import RunModel, RunSettings
from autopar.bench.plans import PlanCase
from autopar.cli import main

# Every baseline is a restriction of autopar's own search (same trace, same cost model, same
# solver): its plan is one autopar considered, so autopar's step time can exceed a baseline's
# only by floating-point rounding of the summed objective (~1e-15 relative). 1e-9 leaves room for
# that and nothing else; a solver stopped early inside its MIP gap would show up here, as it should.
REL_TOL = 1e-9

TINY_CASES = (
    PlanCase("tiny-llama", "2x4xA100-80GB", 8, 64),
    PlanCase("tiny-gpt2", "4xH100-80GB", 8, 64),
    # A budget no layout meets: every entry must be recorded as not fitting, none may crash.
    PlanCase("tiny-llama", "2x4xA100-80GB", 8, 64, memory_budget="100KB"),
)
TINY_GRID = {"pp": lambda c: [1], "tp": lambda c: [1, 2], "num_microbatches": lambda c: [1, 2]}


@pytest.fixture(scope="module")
def plans_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without sharding rules warn; not what is tested here
        results = plans.run(out, cases=TINY_CASES, grid=TINY_GRID, show_progress=False)
    return out, results


@pytest.mark.integration
def test_plans_writes_json_markdown_and_plot(plans_out):
    out, results = plans_out
    doc = json.loads((out / "plans.json").read_text())
    assert doc == json.loads(json.dumps(results))
    assert [r["case"] for r in doc] == [c.name for c in TINY_CASES]
    for r in doc:
        assert set(r["autopar"]) >= {"step_time_s", "mfu", "peak_memory_bytes", "compile_time_s", "mesh"}
        assert set(r["baselines"]) == {"dp", "zero1", "zero2", "zero3", "tp_intra_node", "megatron_grid"}
        for b in r["baselines"].values():
            assert set(b) >= {"step_time_s", "mfu", "peak_memory_bytes", "fits"}
    meta = json.loads((out / "plans_meta.json").read_text())
    assert meta["environment"]["torch_version"] and meta["environment"]["autopar_version"]
    md = (out / "plans.md").read_text()
    assert all(c.name in md for c in TINY_CASES)
    assert (out / "plans.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_every_fitting_baseline_is_priced(plans_out):
    _, results = plans_out
    for r in results:
        for name, b in r["baselines"].items():
            if b["fits"]:
                assert b["step_time_s"] > 0 and b["peak_memory_bytes"] > 0 and 0 < b["mfu"] < 1, (r["case"], name)
                assert b["autopar_speedup"] == pytest.approx(b["step_time_s"] / r["autopar"]["step_time_s"])
            else:
                assert b["step_time_s"] is None and b["error"], (r["case"], name)


@pytest.mark.integration
def test_autopar_is_never_predicted_slower_than_a_baseline(plans_out):
    _, results = plans_out
    compared = 0
    for r in results[:2]:
        auto = r["autopar"]["step_time_s"]
        assert r["autopar"]["fits"] and r["autopar"]["compile_time_s"] > 0
        for name, b in r["baselines"].items():
            if b["fits"]:
                assert auto <= b["step_time_s"] * (1 + REL_TOL), (r["case"], name, auto, b["step_time_s"])
                compared += 1
        best = min(b["step_time_s"] for b in r["baselines"].values() if b["fits"])
        assert r["speedup"] == pytest.approx(best / auto) and r["speedup"] >= 1 - REL_TOL
    assert compared >= 8


@pytest.mark.integration
def test_infeasible_layouts_are_recorded_not_raised(plans_out):
    _, results = plans_out
    r = results[2]
    assert not r["autopar"]["fits"] and "InfeasiblePlanError" in r["autopar"]["error"]
    assert all(not b["fits"] and "InfeasiblePlanError" in b["error"] for b in r["baselines"].values())
    assert r["speedup"] is None and r["best_baseline"] is None


def test_grid_uses_only_accepted_constraints():
    assert plans.accepted_constraint("tp")
    assert not plans.accepted_constraint("no_such_axis")
    points = plans.grid_points(plans.ClusterSpec.parse("2x4xA100-80GB"), TINY_GRID)
    axes = {"pp", "tp", "num_microbatches"}
    assert all(set(p) == axes for p in points)
    assert len(points) == 4  # pp has one value, tp and micro-batches two each


@pytest.mark.integration
def test_compile_suite_splits_planning_time(tmp_path):
    sweep = compile_time.CompileSweep("tiny-llama", (1, 3), "8xA100-80GB", 2, ("8xA100-80GB", "2x8xA100-80GB"), 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = compile_time.run(tmp_path, sweep=sweep, show_progress=False)
    assert [p["num_layers"] for p in doc["layers"]] == [1, 3]
    assert [p["world_size"] for p in doc["devices"]] == [8, 16]
    for p in doc["layers"] + doc["devices"]:
        assert p["trace_time_s"] > 0 and p["solve_time_s"] > 0 and p["rewrite_time_s"] == 0.0
        # the stats round to milliseconds: allow that much
        assert p["total_time_s"] >= p["trace_time_s"] + p["solve_time_s"] - 2e-3
    assert doc["layers"][1]["graph_nodes"] > doc["layers"][0]["graph_nodes"]
    assert json.loads((tmp_path / "compile.json").read_text())["environment"]["torch_version"]
    assert (tmp_path / "compile.png").exists() and "## Devices" in (tmp_path / "compile.md").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_run_suite_measures_every_method(tmp_path):
    model = RunModel("tiny-llama", "tiny-llama", 4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a link fit on a busy machine may fall back to the preset, with a warning
        doc = execution.run(
            tmp_path,
            cluster="cpu:2",
            models=(model,),
            settings=RunSettings(1, 2, 2, 1, min_measured_s=0.2, max_repetitions=4),
            show_progress=False,
            methods="autopar,autopar-dp,autopar-offload,ddp,fsdp2,tp",
        )
    (res,) = doc["results"]
    assert set(res["methods"]) == {"autopar", "autopar-dp", "autopar-offload", "ddp", "fsdp2", "tp"}
    times = []
    # at least 2 repetitions, more (up to 4) while a method had under 0.2 s timed; the same count for every method
    reps = len(res["methods"]["ddp"]["times_s"])
    assert 2 <= reps <= 4
    for name, m in res["methods"].items():
        assert len(m["times_s"]) == reps and all(t > 0 for t in m["times_s"]), name
        assert len(m["cpu_times_s"]) == reps and all(t > 0 for t in m["cpu_times_s"]), name
        assert m["min_step_time_s"] <= m["median_step_time_s"] <= m["max_step_time_s"]
        assert m["state_bytes_per_rank"] > 0 and m["ratio_to_best_baseline"] > 0
        assert m["paired_ratio_to_best_baseline"] > 0
        times += m["times_s"]
        # each repetition also timed the step with no-op collectives; every method communicates, and every
        # collective went through the no-op kernels (losses stayed finite)
        assert len(m["noop_times_s"]) == reps and m["noop_collectives_per_step"] >= 1 and m["noop_losses_finite"]
        exposed = m["measured_exposed_comm_s"]
        assert exposed["min"] <= exposed["median"] <= exposed["max"], name
        assert m["exposed_comm_s"] == [t - n for t, n in zip(m["times_s"], m["noop_times_s"], strict=True)]
    # the best baseline's ratios are to itself: 1 both ways
    best = min(("ddp", "fsdp2", "tp"), key=lambda n: res["methods"][n]["median_step_time_s"])
    assert (
        res["methods"][best]["ratio_to_best_baseline"] == res["methods"][best]["paired_ratio_to_best_baseline"] == 1.0
    )
    # Measured, not constants: eight timings from a live run are never all equal.
    assert len(set(times)) > 1
    auto = res["methods"]["autopar"]
    assert auto["predicted_step_time_s"] > 0 and auto["mesh"]
    dp = res["methods"]["autopar-dp"]
    assert dp["mesh"] == {"dp": 2, "tp": 1} and dp["zero_stage"] == 0 and dp["predicted_exposed_comm_s"] > 0
    offload = res["methods"]["autopar-offload"]
    assert offload["program"] == "offload" and offload["mesh"] == {"dp": 2, "tp": 1} and offload["zero_stage"] == 3
    pair = res["pairs"]["autopar-dp/ddp"]
    assert pair["ratios"] == [a / b for a, b in zip(dp["times_s"], res["methods"]["ddp"]["times_s"], strict=True)]
    # The prediction comes from the cost model profiled on this machine before the run.
    assert auto["plan_stats"]["estimator"] == "ProfiledEstimator"
    cal = doc["calibration"]
    assert all(t > 0 for k, t in cal["host"].items() if k not in ("optimizer_s_per_param_byte", "op_cold_extra_s"))
    # the link is fitted afresh for each model, just before its run
    m = cal["models"]["tiny-llama"]
    assert cal["host"]["optimizer_s_per_param_byte"] >= 0 and ("link" in m or "link_error" in m)
    assert set(m["collective_median_s"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(t > 0 for times in m["collective_median_s"].values() for t in times.values())
    if "link" in m:  # all-gather and reduce-scatter priced on their own fits, which the plans were priced with
        assert set(m["link"]["per_collective"]) == {"all_gather", "reduce_scatter"}
    # the overlap efficiency the plans were priced with, measured among the ranks just before the run
    o = m["overlap"]
    assert 0 <= o["eta"] <= 1 and o["comm_s"] > 0 and o["compute_s"] > 0 and o["both_s"] > 0
    # each rank's host work is priced as measured while the ranks run the model's step together (never faster
    # than alone), and the ops scaled by the model's own graph run as a step against the sum of their profiles
    assert m["shared_core_slowdown"] >= 1.0 and m["ranks_per_core"] == m["shared_core_slowdown"]
    in_step = m["in_step"]
    assert in_step["forward_measured_s"] > 0 and in_step["backward_profiled_s"] > 0
    assert in_step["scale"] == [
        in_step["forward_measured_s"] / in_step["forward_profiled_s"],
        in_step["backward_measured_s"] / in_step["backward_profiled_s"],
    ]
    md = (tmp_path / "run.md").read_text()
    assert "(predicted − measured) / measured" in md and "## Communication the step waits for" in md
    assert "autopar-dp/ddp" in md
    # FSDP2 keeps half of the states on each of two ranks; DDP all of them.
    assert res["methods"]["fsdp2"]["state_bytes_per_rank"] < res["methods"]["ddp"]["state_bytes_per_rank"]
    assert doc["environment"]["torch_version"] and (tmp_path / "run.md").exists() and (tmp_path / "run.png").exists()


def test_gpt2_has_no_hand_written_tensor_parallel_baseline():
    assert "Conv1D" in execution.tp_skip_reason(presets.load_config("tiny-gpt2"), 2)
    assert execution.tp_skip_reason(presets.load_config("tiny-llama"), 2) is None
    assert "num_key_value_heads" in execution.tp_skip_reason(presets.load_config("tiny-llama"), 4)


def test_offload_methods_skip_a_model_trained_with_sgd():
    # the offload program runs AdamW over its chunks; a model the bench trains with SGD is skipped, with the reason
    for name in ("autopar-offload", "autopar-offload-no-overlap"):
        assert "AdamW" in execution.METHODS[name].skip_reason("sgd")
        assert execution.METHODS[name].skip_reason("adamw") is None
    assert execution.METHODS["autopar"].skip_reason("sgd") is None


def test_pipeline_zero1_pair_runs_one_layout_with_and_without_overlap():
    on, off = (execution.METHODS[n].constraints(4) for n in ("autopar-pp-zero1", "autopar-pp-zero1-no-overlap"))
    assert (on["pp"], on["dp"], on["zero"]) == (2, 2, 1) and "overlap" not in on
    assert off == {**on, "overlap": False}
    assert ("autopar-pp-zero1", "autopar-pp-zero1-no-overlap") in execution.PAIRS


def test_run_suite_names_an_unknown_method_or_model(tmp_path, capsys):
    assert main(["bench", "run", "--methods", "autopar,ddp2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'ddp2'" in err and "autopar-dp-no-overlap" in err
    assert main(["bench", "run", "--models", "no-such-model", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model'" in err and "wide-llama" in err


def test_run_suite_repetitions_reach_its_settings(tmp_path, monkeypatch, capsys):
    assert execution.run_settings(execution.RunSettings(), None) == execution.RunSettings()
    more = execution.run_settings(execution.RunSettings(), 40)
    assert (more.repetitions, more.max_repetitions) == (40, 40)  # the most never below the least
    assert execution.run_settings(execution.QUICK_SETTINGS, 7).repetitions == 7
    seen = {}
    monkeypatch.setattr(execution, "run", lambda out, **kw: seen.update(kw) or {})
    assert main(["bench", "run", "--repetitions", "9", "--methods", "ddp", "--out", str(tmp_path)]) == 0
    assert seen["repetitions"] == 9 and seen["methods"] == "ddp"
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "run", "--repetitions", bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_cli_rejects_a_gpu_cluster_for_the_run_suite(tmp_path, capsys):
    assert main(["bench", "run", "--cluster", "8xA100-80GB", "--out", str(tmp_path)]) == 2
    assert "cpu:N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "no-such-suite"])


@pytest.mark.integration
def test_model_estimator_prices_the_optimizer_the_model_trains_with(tmp_path):
    # one rank (no shared-core measurement): the in-step scale and SGD's step are measured on the tiny model
    spec = RunModel("tiny-sgd", "tiny-llama", 2, 16, optimizer="sgd")
    estimator, record = execution.model_estimator(spec, 1, tmp_path, repeats=1, show_progress=False)
    measured = record["optimizer_step"]
    assert measured["optimizer"] == "sgd" and estimator.optimizer[0] == "sgd"
    assert measured["optimizer_tensor_s"] > 0 and measured["optimizer_s_per_param_byte"] >= 0
    # the figures recorded are the ones priced (one rank: no shared-core scale), not the profile's AdamW
    expected = 3 * measured["optimizer_tensor_s"] + 1e6 * measured["optimizer_s_per_param_byte"]
    assert estimator.optimizer_step_time_s(3, 1e6) == pytest.approx(expected, rel=1e-12)
    _, adamw = execution.model_estimator(
        RunModel("tiny", "tiny-llama", 2, 16), 1, tmp_path, repeats=1, show_progress=False
    )
    assert "optimizer_step" not in adamw

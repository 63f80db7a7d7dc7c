"""Planning a cp axis together with a pipeline (mesh pp x dp x cp x tp): the pinned plan, its stage prices set
against the plans with one of the two axes alone and against hand-computed transfers, and the pins still refused."""

from __future__ import annotations

import pytest

import autopar
from autopar.context_parallel import CPAlgorithm
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.errors import ConfigError
from tests.models import make_batch, make_model

HIDDEN = 64  # tests.models.tiny_llama's hidden size: the value that crosses a stage boundary is (rows, seq, 64)


def _plan(cluster: str, constraints: dict, batch: int = 4, seq: int = 16, **kw):
    args, kwargs = make_batch("llama", batch=batch, seq=seq)
    return autopar.plan(make_model("llama"), cluster, args, kwargs, constraints=constraints, **kw)


@pytest.mark.integration
def test_pinned_pp_and_cp_give_a_pipeline_on_a_pp_dp_cp_tp_mesh():
    plan = _plan("cpu:4", {"pp": 2, "cp": 2})
    assert plan.mesh == {"pp": 2, "dp": 1, "cp": 2, "tp": 1}
    assert plan.program == "pipeline"
    assert plan.global_batch_size == 4  # sequences, not the cp rows of the traced batch
    cp = plan.context_parallel
    assert cp["degree"] == 2 and cp["algorithm"] in {a.value for a in CPAlgorithm}
    assert {line.split(":")[0] for line in cp["priced"]} == {a.value for a in CPAlgorithm}
    stages = plan.pipeline["stages"]
    assert [(st["dp"], st["cp"], st["tp"]) for st in stages] == [(1, 2, 1), (1, 2, 1)]
    again = autopar.Plan.from_json(plan.to_json())
    assert again.mesh == plan.mesh and again.context_parallel == cp and again.program == "pipeline"


@pytest.mark.integration
def test_pinned_algorithm_reaches_the_stages():
    plan = _plan("cpu:4", {"pp": 2, "cp": 2, "cp_attention": "ring"})
    assert plan.context_parallel["algorithm"] == "ring"


@pytest.mark.integration
def test_cp_splits_each_stage_s_activations():
    # The same stage blocks (dp=1, tp=1) with and without a cp axis of two: every activation is per token and
    # each cp rank holds half the tokens, so a stage keeps about half the activation bytes. Not exactly half:
    # the all-gather algorithm keeps the gathered K/V of each layer, and the pipeline's schedule keeps the
    # same copies on both; 0.4..0.7 allows that. Its total memory (states equal) is then below the pp plan's.
    seq = 64
    alone = _plan("cpu:2", {"pp": 2, "dp": 1, "tp": 1, "num_microbatches": 2}, seq=seq)
    with_cp = _plan("cpu:4", {"pp": 2, "dp": 1, "tp": 1, "cp": 2, "num_microbatches": 2}, seq=seq)
    for a, b in zip(alone.pipeline["stages"], with_cp.pipeline["stages"], strict=True):
        ratio = b["memory"]["activations"] / a["memory"]["activations"]
        assert 0.4 <= ratio <= 0.7, ratio
        assert b["memory_bytes"] < a["memory_bytes"]
    assert with_cp.predicted.peak_memory_bytes < alone.predicted.peak_memory_bytes


@pytest.mark.integration
def test_stage_boundary_transfer_is_this_rank_s_chunk():
    # Stage 0 of two sends one boundary activation per micro-batch forward and receives nothing back to send:
    # c_0 is one point-to-point send of this rank's piece, b sequences of seq/cp tokens of the hidden state,
    # on the link between the stage blocks (one node: intra-node), fp32 on CPU. The hand-computed figure.
    batch, seq, m, cp = 4, 32, 2, 2
    plan = _plan("cpu:4", {"pp": 2, "cp": cp, "num_microbatches": m}, batch=batch, seq=seq)
    rows = batch // (plan.mesh["dp"] * m)
    piece = rows * (seq // cp) * HIDDEN * 4
    expected = estimate_collective_time(Collective.SEND_RECV, piece, 2, plan.cluster.intra_node_link)
    assert plan.pipeline["stages"][0]["transfer_per_microbatch_s"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.integration
def test_pipeline_stages_together_price_the_cp_plan_s_compute():
    # Every layer runs on exactly one stage and the stage views together are the whole graph, each stage
    # priced on the same (dp·cp, tp) block with the same cp attention: the stages' time of one micro-batch
    # (compute and the exposed part of the ring's hops) summed over stages and micro-batches is that of the cp
    # plan without a pipeline on that block at the same micro-batches. Only the resharding differs (none here:
    # tp=1), so 1e-6 is rounding.
    m = 2
    piped = _plan("cpu:4", {"pp": 2, "cp": 2, "num_microbatches": m, "cp_attention": "ring"}, seq=64)
    flat = _plan(
        "cpu:2",
        {"cp": 2, "tp": 1, "num_microbatches": m, "cp_attention": "ring", "zero": 0},
        seq=64,
        memory_budget=float("inf"),
    )
    assert flat.time_breakdown["comm_cp"] > 0
    total = sum(st["time_per_microbatch_s"] for st in piped.pipeline["stages"]) * m
    flat_total = flat.predicted.compute_s + flat.predicted.reshard_s + flat.time_breakdown["comm_cp"]
    assert total == pytest.approx(flat_total, rel=1e-6)


def _exposed_per_layer(plan, algorithm: str) -> float:
    """Seconds of `algorithm`'s exposed communication per layer and micro-batch, from the plan's priced line."""
    line = next(x for x in plan.context_parallel["priced"] if x.startswith(f"{algorithm}:"))
    return float(line.split(", ")[1].split(" ms")[0]) * 1e-3


@pytest.mark.integration
def test_a_stage_waits_for_its_cp_attention_s_exposed_communication():
    # The same pipeline with the attention algorithm pinned two ways: each stage runs one layer, so its time per
    # micro-batch differs by the two algorithms' exposed communication per layer and micro-batch (the plan's
    # priced lines, printed to a microsecond, hence the 2e-6 s), and the step's cp term is the bottleneck
    # stage's exposed communication over the m micro-batches.
    m = 4
    plans = {
        a: _plan("cpu:4", {"pp": 2, "cp": 2, "num_microbatches": m, "cp_attention": a}, seq=256)
        for a in ("allgather", "ring")
    }
    ag, ring = plans["allgather"], plans["ring"]
    delta = _exposed_per_layer(ag, "allgather") - _exposed_per_layer(ag, "ring")
    assert abs(delta) > 1e-5  # the two algorithms' exposed parts differ, so the check below can fail
    for a, b in zip(ag.pipeline["stages"], ring.pipeline["stages"], strict=True):
        assert a["num_layers"] == b["num_layers"] == 1
        assert a["time_per_microbatch_s"] - b["time_per_microbatch_s"] == pytest.approx(delta, abs=2e-6)
    for algorithm, plan in plans.items():
        assert plan.time_breakdown["comm_cp"] == pytest.approx(m * _exposed_per_layer(plan, algorithm), abs=m * 2e-6)
    assert (ag.predicted.step_time_s > ring.predicted.step_time_s) == (delta > 0)


def test_pp_times_cp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"pp=2 x cp=2 need a multiple of 4 devices"):
        _plan("cpu:2", {"pp": 2, "cp": 2})


@pytest.mark.integration
def test_a_cp_pipeline_is_compared_with_layouts_at_their_own_cp_degree():
    plan = _plan("cpu:4", {"pp": 2, "cp": 2}, compare=("tp=2,pp=2", "pp=2,cp=2", "pp=4,cp=2"))
    without, same, too_many = plan.comparisons
    assert without["feasible"] and "cp" not in without["mesh"]
    assert same["feasible"] and same["mesh"]["cp"] == 2 and same["mesh"]["pp"] == 2
    assert not too_many["feasible"] and "need a multiple of 8 devices" in too_many["reason"]


@pytest.mark.slow  # two searches of a preset over cp degrees and pipelines: about half a minute on two cores
def test_search_picks_a_pipeline_and_cp_together_where_both_pay():
    # llama3-8b at 64K tokens on two nodes of eight H100s joined by one 25 Gb/s Ethernet adapter each (3.125 GB/s):
    # across the nodes a pipeline sends each rank's chunk of the hidden state where a wider data or tensor axis
    # would send gradients or activations every layer through the node's one slow adapter, and inside a stage cp
    # splits the long sequence. (With the DGX's eight NDR adapters, a data axis over whole nodes gets eight
    # adapters' bandwidth, and at 64K tokens a step's compute hides the gradients: no pipeline pays; with one NDR
    # adapter, 48 GB/s, it still does not.) Searching pipelines at every cp degree must find a layout with both
    # axes that beats the best plan the search finds without a pipeline (pp pinned to 1, cp still searched; it may
    # or may not take a cp axis there).
    cluster = autopar.ClusterSpec.from_overrides(
        {
            "cluster": "2x8xH100-80GB",
            "device": {"nics_per_node": 1},
            "inter_node_link": {"name": "25gbe", "bandwidth_bytes_per_s": 3.125e9},
        },
        source="test",
    )
    kw = dict(global_batch_size=8, seq_len=65536)
    both = autopar.plan("llama3-8b", cluster, **kw)
    without = autopar.plan("llama3-8b", cluster, constraints={"pp": 1}, **kw)
    assert both.mesh["pp"] > 1 and both.mesh["cp"] > 1, both.mesh
    assert both.program == "pipeline"
    assert "pp" not in without.mesh
    assert both.predicted.step_time_s < without.predicted.step_time_s
    searched = {r["degree"]: r for r in both.context_parallel["search"]}
    assert searched[both.mesh["cp"]]["feasible"]
    assert searched[both.mesh["cp"]]["step_time_s"] == pytest.approx(both.predicted.step_time_s)


@pytest.mark.integration
def test_a_cp_pipeline_past_the_budget_names_dp_and_cp_apart():
    # the data axis of a stage block is dp x cp ranks; the message names them as the user pins them
    from autopar.errors import InfeasiblePlanError

    with pytest.raises(InfeasiblePlanError, match=r"leanest \(pp=2 dp=1 cp=2 tp=1 .*on its fullest stage"):
        _plan("cpu:4", {"pp": 2, "cp": 2}, memory_budget=4096)


@pytest.mark.integration
def test_a_layout_that_fits_only_with_full_recompute_is_not_dropped_by_the_estimate():
    # The layout estimate bounds each stage's activations per recompute mode: a mode that saves less keeps more
    # working memory (its recomputed segment), so no one mode is the leanest at every layer count. At this budget
    # (bytes, found by planning the pins below) the layout fits with full recompute and not without recompute.
    from autopar.errors import InfeasiblePlanError

    budget = 900_000
    with pytest.raises(InfeasiblePlanError):
        _plan("cpu:4", {"pp": 2, "cp": 2, "recompute": "none"}, seq=64, memory_budget=budget, alternatives=False)
    plan = _plan("cpu:4", {"pp": 2, "cp": 2}, seq=64, memory_budget=budget, alternatives=False)
    assert plan.predicted.peak_memory_bytes <= budget
    assert any(st["recompute"] != "none" for st in plan.pipeline["stages"])


@pytest.mark.integration
def test_where_memory_binds_the_pipeline_runs_the_leaner_cp_algorithm():
    # Recompute pinned off, 256 tokens: all-gather is the fastest per layer here but keeps each layer's gathered
    # K/V until the backward, which ring does not. Unbounded, the search runs all-gather. Under a budget between
    # the two pinned plans' peaks all-gather still fits, but only by a slower layout, and under a budget just
    # above ring's peak it does not fit at all: both times the search runs every stage on ring, at the pinned
    # ring plan's step, and says why in the plan.
    c = {"pp": 2, "cp": 2, "recompute": "none", "num_microbatches": 4}

    def plan(budget=None, **pins):
        return _plan("cpu:4", c | pins, seq=256, memory_budget=budget, alternatives=False)

    ag, ring = plan(cp_attention="allgather"), plan(cp_attention="ring")
    assert ag.predicted.step_time_s < ring.predicted.step_time_s
    assert ring.predicted.peak_memory_bytes < ag.predicted.peak_memory_bytes
    assert plan().context_parallel["algorithm"] == "allgather"
    between = (ring.predicted.peak_memory_bytes + ag.predicted.peak_memory_bytes) / 2
    assert plan(between, cp_attention="allgather").predicted.step_time_s > ring.predicted.step_time_s
    tight = ring.predicted.peak_memory_bytes * 1.001
    with pytest.raises(autopar.InfeasiblePlanError):
        plan(tight, cp_attention="allgather")
    for budget in (between, tight):
        got = plan(budget)
        assert got.context_parallel["algorithm"] == "ring", budget
        assert got.predicted.step_time_s == pytest.approx(ring.predicted.step_time_s, rel=1e-9)
        assert any(
            line.startswith("allgather: faster per layer, but under the memory budget")
            for line in got.context_parallel["priced"]
        )


@pytest.mark.integration
def test_where_memory_rules_out_configurations_the_pipeline_runs_the_leaner_cp_algorithm():
    # Micro-batches free, 8 sequences of 256 tokens, recompute off. At 4 micro-batches all-gather is faster than
    # ring and holds more. Under a budget between the two's peaks there, all-gather's 4 micro-batches (and ring's 2)
    # no longer fit at the memory floors, so all-gather's search prices 8 only, none of whose stages is
    # memory-bound: the search must still try ring, whose 4 micro-batches fit and win.
    c = {"pp": 2, "cp": 2, "recompute": "none"}

    def plan(budget=None, **pins):
        return _plan("cpu:4", c | pins, batch=8, seq=256, memory_budget=budget, alternatives=False)

    ag, ring = plan(cp_attention="allgather", num_microbatches=4), plan(cp_attention="ring", num_microbatches=4)
    assert ag.predicted.step_time_s < ring.predicted.step_time_s
    between = (ring.predicted.peak_memory_bytes + ag.predicted.peak_memory_bytes) / 2
    assert plan(between, cp_attention="allgather").predicted.step_time_s > ring.predicted.step_time_s
    got = plan(between)
    assert got.context_parallel["algorithm"] == "ring"
    assert got.num_microbatches == 4
    assert got.predicted.step_time_s == pytest.approx(ring.predicted.step_time_s, rel=1e-9)

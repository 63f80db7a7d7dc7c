"""Pipeline layouts in the plan: chosen by the search across nodes, pinned by constraints, kept by JSON."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.passes.pipeline.step_cost import BACKWARD_SHARE
from tests.plan_snapshots import CASES, GOLDEN

CASE = dict(global_batch_size=64, seq_len=2048)
PINNED = "gpt3-1.3b-2x8xA100-80GB-pp2"  # the golden plan of this pinned pipeline


@pytest.fixture(scope="module")
def pinned():
    """The plan of gpt3-1.3b with a pinned 2-stage 1F1B pipeline, read from its golden file: planning it takes 10 to
    20 s on a busy 2-core machine, and tests/test_plan_snapshots.py checks that planning it gives that file, byte
    for byte (wall-clock figures aside)."""
    assert CASES[PINNED] == ("gpt3-1.3b", "2x8xA100-80GB", {**CASE, "constraints": {"pp": 2, "schedule": "1f1b"}})
    return autopar.Plan.from_json((GOLDEN / f"{PINNED}.json").read_text())


@pytest.mark.integration
def test_pinned_pipeline_is_in_the_plan(pinned):
    assert pinned.mesh["pp"] == 2 and pinned.mesh["pp"] * pinned.mesh["dp"] * pinned.mesh["tp"] == 16
    info = pinned.pipeline
    assert info["schedule"] == "1f1b" and len(info["stages"]) == 2
    covered = sorted(i for st in info["stages"] for a, b in st["layers"] for i in range(a, b))
    assert covered == list(range(24)), "every layer on exactly one stage"
    # the bubble of 1F1B as Megatron states it: (p - 1) / m of the time without one
    m = pinned.num_microbatches
    assert info["bubble_fraction"] == pytest.approx(1 / m, rel=1e-6)
    assert pinned.predicted.peak_memory_bytes == pytest.approx(max(st["memory_bytes"] for st in info["stages"]))
    # every parameter of the model has a placement, layers included
    assert sum(1 for n in pinned.param_placements if n.startswith("transformer.h.")) == 24 * 12
    report = pinned.explain()
    assert "## Pipeline" in report and "1f1b" in pinned.summary()
    # the layouts the search priced, the chosen one among them at the plan's predicted step time
    assert "Layouts priced" in report and "### Meshes solved" not in report
    chosen = [c for c in info["priced"] if c["pp"] == 2 and c["step_time_s"] is not None]
    # the plan's step adds the step guard's passes to what the search priced
    assert info["step_guard_s"] > 0
    assert min(c["step_time_s"] for c in chosen) + info["step_guard_s"] == pytest.approx(pinned.predicted.step_time_s)


@pytest.mark.integration
def test_pipeline_plan_round_trips(pinned):
    again = autopar.Plan.from_json(pinned.to_json())
    assert again.pipeline == pinned.pipeline and again.mesh == pinned.mesh
    # what a planned plan writes (the golden file) is what the plan read from it writes: no field dropped or changed
    assert json.loads(pinned.to_json()) == json.loads((GOLDEN / f"{PINNED}.json").read_text())


@pytest.mark.integration
def test_pipeline_plan_at_zero23_is_refused(pinned):
    """A plan file whose pipeline stages say ZeRO-2 or 3 (the search never makes one) is refused when read."""
    from autopar.errors import PlanFormatError

    d = json.loads(pinned.to_json())
    d["pipeline"]["stages"][1]["zero_stage"] = 3
    with pytest.raises(PlanFormatError, match="pipeline stages at ZeRO-3"):
        autopar.Plan.from_json(json.dumps(d))


@pytest.mark.slow
@pytest.mark.integration
def test_free_search_across_nodes_is_no_slower_than_without_a_pipeline(pinned):
    free = autopar.plan("gpt3-1.3b", "2x8xA100-80GB", **CASE)
    flat = autopar.plan("gpt3-1.3b", "2x8xA100-80GB", constraints={"pp": 1}, **CASE)
    assert "pp" not in flat.mesh and not flat.pipeline
    assert free.predicted.step_time_s <= flat.predicted.step_time_s * (1 + 1e-9)
    assert free.predicted.step_time_s <= pinned.predicted.step_time_s * (1 + 1e-9)


@pytest.mark.integration
def test_one_node_plans_without_a_pipeline_unless_asked():
    plan = autopar.plan("gpt3-1.3b", "8xA100-80GB", **CASE)
    assert "pp" not in plan.mesh and not plan.pipeline


@pytest.mark.integration
def test_pipeline_pins_without_a_pipeline_search_warn():
    from tests.models import make_batch, make_model

    model = make_model("llama")
    args, kwargs = make_batch("llama")
    with pytest.warns(UserWarning, match=r"\['schedule'\] apply to pipeline layouts.*searches none"):
        plan = autopar.plan(model, "cpu:2", args, kwargs, constraints={"schedule": "gpipe"})
    assert plan.mesh.get("pp", 1) == 1


@pytest.mark.integration
def test_pipeline_plan_reports_its_exposed_and_hidden_communication(pinned):
    """The pp and dp parts of the step, exposed (in the time breakdown) and hidden (not in the step), as the search
    priced them: the transfers of the slowest stage over m micro-batches, the sync of the stage that ends the step."""
    info, terms, hidden = pinned.pipeline, pinned.time_breakdown, pinned.hidden_communication
    m = pinned.num_microbatches
    stages = info["stages"]
    slowest = max(stages, key=lambda st: st["time_per_microbatch_s"] + st["transfer_exposed_per_microbatch_s"])
    assert terms["comm_pp"] == pytest.approx(m * slowest["transfer_exposed_per_microbatch_s"], rel=1e-9)
    wire = m * (slowest["transfer_per_microbatch_s"] - slowest["transfer_exposed_per_microbatch_s"])
    assert wire > 0 and hidden["comm_pp"] == pytest.approx(wire, rel=1e-9)
    assert sum(terms.values()) == pytest.approx(pinned.predicted.step_time_s, rel=1e-9)
    # the first stage ends the step: its sync hides behind its own last backward alone (all but its last bucket)
    first = stages[0]
    assert 0.0 < first["grad_sync_hidden_s"] < first["grad_sync_s"]
    assert first["grad_sync_hidden_s"] <= BACKWARD_SHARE * first["time_per_microbatch_s"] + 1e-15
    report = pinned.explain()
    assert "pp: " in report and "hidden (stage sends overlapping compute)" in report
    assert "pipeline transfers are posted ahead" in report
    off = autopar.plan(  # pinned: the layouts a report prices beside it could not replace it, and are not asked for
        "gpt3-1.3b",
        "2x8xA100-80GB",
        constraints={"pp": 2, "schedule": "1f1b", "overlap": False},
        alternatives=False,
        **CASE,
    )
    assert not off.hidden_communication and not off.overlap
    assert all(
        st["transfer_exposed_per_microbatch_s"] == st["transfer_per_microbatch_s"] for st in off.pipeline["stages"]
    )
    assert off.predicted.step_time_s >= pinned.predicted.step_time_s

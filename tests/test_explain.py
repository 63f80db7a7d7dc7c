"""Strategy-explain reports: the numbers are the plan's, the alternatives are real plans, reports survive JSON."""

from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar import explain
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.errors import ConfigError
from autopar.plan import WALL_CLOCK_KEYS
from autopar.rationale import TERM_LABELS, TERMS, loss_reason, parse_layout
from autopar.report_charts import schedule_order, simulate
from tests.models import MLPBlock, make_batch, make_model

SECTIONS = (
    "Summary",
    "Memory per device",
    "Time breakdown",
    "Layer table",
    "Why this plan",
    "Your layout",
    "Assumptions",
)


def _plan(name: str, **kw):
    args, kwargs = make_batch(name, batch=8, seq=16)
    return autopar.plan(make_model(name), "cpu:2", args, kwargs, **kw)


@pytest.fixture(scope="module")
def plans() -> dict:
    """One plan per report kind: plain (free, with compared layouts), pipeline (pinned), offload."""
    return {
        "plain": _plan("llama", compare=["tp=2", "dp=2,zero=3", "tp=3"]),
        "pipeline": _plan("gpt2", constraints={"pp": 2, "num_microbatches": 4}),
        "offload": _plan("llama", offload=True),
    }


@pytest.mark.integration
def test_sections_come_in_the_issue_order(plans):
    md = plans["plain"].explain()
    heads = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert [h for h in heads if h in SECTIONS] == list(SECTIONS)
    pipe = [line[3:] for line in plans["pipeline"].explain().splitlines() if line.startswith("## ")]
    assert pipe.index("Layer table") < pipe.index("Pipeline") < pipe.index("Why this plan")


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["plain", "pipeline", "offload"])
def test_report_numbers_are_the_plans_fields(plans, kind):
    plan = plans[kind]
    md = plan.explain()
    p = plan.predicted
    assert f"{p.step_time_s * 1e3:,.2f} ms" in md
    assert f"{p.mfu:.1%}" in md and f"{p.tokens_per_s:,.0f}" in md
    for term, seconds in plan.time_breakdown.items():
        if seconds:
            assert f"| {TERM_LABELS[term]} | {seconds * 1e3:,.2f} |" in md, term
    for b in plan.baselines:
        assert b["reason"] in md
        if b["feasible"]:
            assert f"| {b['step_time_s'] * 1e3:,.2f} |" in md
    if plan.pipeline:
        for st in plan.pipeline["stages"]:
            assert f"{st['time_per_microbatch_s'] * 1e3:,.3f}" in md
    if plan.offload:
        assert f"{plan.offload['host_bytes_per_device'] / 1024**3:,.2f} GiB" in md


@pytest.mark.integration
def test_reports_price_nothing(plans, monkeypatch):
    """Rendering reads the plan: with every solver and estimator unusable, the report is the same."""
    before = {k: (p.explain(), p.explain("html")) for k, p in plans.items()}

    def boom(*a, **k):
        raise AssertionError("the report priced something")

    import autopar.cost_model.compute as compute
    import autopar.passes.pipeline as ps
    import autopar.passes.sharding.search as ss

    monkeypatch.setattr(ss, "solve_sharding", boom)
    monkeypatch.setattr(ps, "search_pipeline", boom)
    monkeypatch.setattr(compute, "estimate_node_cost", boom)
    assert {k: (p.explain(), p.explain("html")) for k, p in plans.items()} == before


class _MLPStack(torch.nn.Module):
    """An embedding and two pre-norm MLP blocks: a model whose tp=2 layout is Megatron's (one all-reduce)."""

    def __init__(self, hidden: int, layers: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(128, hidden)
        self.layers = torch.nn.ModuleList([MLPBlock(hidden) for _ in range(layers)])

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _collectives(plan, **match) -> list[dict]:
    return [
        c
        for e in plan.layer_ops
        for op in e["ops"]
        for c in op["collectives"]
        if all(c[k] == v for k, v in match.items())
    ]


def test_layer_table_collectives_of_a_tp2_mlp_match_a_hand_computation():
    batch, seq, hidden = 4, 8, 256
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    plan = autopar.plan(
        _MLPStack(hidden), "cpu:2", (ids,), constraints={"tp": 2, "dp": 1}, precision="fp32", alternatives=False
    )
    (layer,) = [e for e in plan.layer_ops if e["layer"] == "layers"]
    assert layer["num_layers"] == 2 and layer["stages"] == []
    ops = {op["node"]: op for op in layer["ops"]}
    assert ops["layers.0.up.weight"]["output"] == "S(0)" and ops["layers.0.down.weight"]["output"] == "S(1)"
    # Megatron's MLP: the block output (the row-parallel projection's partial sums) is all-reduced once per layer
    # in forward, batch x seq x hidden fp32 values on the one data-parallel rank, for each of the 2 layers
    (fwd,) = _collectives(plan, **{"pass": "forward"})
    assert fwd["kind"] == "all_reduce" and fwd["axis"] == "tp" and fwd["placements"] == "P -> R"
    assert ops[fwd["from"]]["strategy"] == "row parallel"
    assert fwd["bytes"] == batch * seq * hidden * 4 and fwd["per_step"] == 2
    assert fwd["time_s"] == estimate_collective_time(
        Collective.ALL_REDUCE, fwd["bytes"], 2, plan.cluster.intra_node_link
    )
    # backward: the column-parallel projection's input gradient, the same bytes
    (bwd,) = _collectives(plan, **{"pass": "backward"})
    assert bwd["kind"] == "all_reduce" and bwd["bytes"] == fwd["bytes"]
    # every resharding the solver priced is in the table: the step's tp communication term is their sum
    total = sum(c["time_s"] * c["per_step"] for c in _collectives(plan, axis="tp"))
    assert total == pytest.approx(plan.predicted.reshard_s, rel=1e-9)  # float sums in another order
    md = plan.explain()
    row = (
        f"| all_reduce of `{fwd['from']}` (P -> R) | tp | forward | 32.00 KiB | {fwd['time_s'] * 1e3:,.3f} | 2 | "
        f"{2 * fwd['time_s'] * 1e3:,.3f} |"
    )
    assert row in md


@pytest.mark.integration
def test_layer_table_dp_rows_are_the_gradient_sync_and_pipeline_stages_are_named(plans):
    plan = _plan("llama", constraints={"dp": 2, "tp": 1, "zero": 1}, alternatives=False)
    rows = _collectives(plan, axis="dp")
    assert rows and all(c["kind"].startswith("reduce_scatter") for c in rows)
    # the rows are the whole sync, what overlap hides included, but the one latency a step pays for its buckets
    # (in no row); the hidden part is the whole less the exposed part, an LP variable solved to HiGHS's
    # feasibility tolerance (1e-7 of a row's terms), hence 1e-5 relative
    floor = estimate_collective_time(Collective.REDUCE_SCATTER, 1.0, 2, plan.cluster.intra_node_link)
    whole = plan.predicted.grad_sync_s + plan.predicted.grad_sync_hidden_s
    assert sum(c["time_s"] * c["per_step"] for c in rows) + floor == pytest.approx(whole, rel=1e-5)
    pipe = plans["pipeline"]
    assert sorted(s for e in pipe.layer_ops for s in e["stages"] if e["layer"]) == [0, 1]
    assert "pipeline stage 0)" in pipe.explain() and "pipeline stage 1)" in pipe.explain()


@pytest.mark.integration
def test_time_terms_add_up_to_the_step(plans):
    for plan in plans.values():
        assert set(plan.time_breakdown) == set(TERMS)
        # float sums of a handful of terms: relative error well under 1e-9
        assert sum(plan.time_breakdown.values()) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


@pytest.mark.integration
def test_alternatives_are_real_plans_and_never_faster_than_a_free_plan(plans):
    plan = plans["plain"]
    names = {b["name"] for b in plan.baselines}
    assert {"dp", "zero3", "megatron", "runner_up"} <= names
    args, kwargs = make_batch("llama", batch=8, seq=16)
    for b in plan.baselines:
        if not b["feasible"]:
            assert b["reason"]
            continue
        assert b["step_time_s"] >= plan.predicted.step_time_s * (1 - 1e-12), b["name"]
        again = autopar.plan(
            make_model("llama"), "cpu:2", args, kwargs, constraints=b["constraints"], alternatives=False
        )
        assert again.predicted.step_time_s == pytest.approx(b["step_time_s"], rel=1e-9), b["name"]
        assert again.predicted.peak_memory_bytes == pytest.approx(b["peak_memory_bytes"], rel=1e-9)


@pytest.mark.integration
def test_an_infeasible_layout_is_listed_with_its_reason(plans):
    by_name = {c["name"]: c for c in plans["plain"].comparisons}
    assert set(by_name) == {"tp=2", "dp=2,zero=3", "tp=3"}
    assert not by_name["tp=3"]["feasible"] and "does not divide" in by_name["tp=3"]["reason"]
    assert "Cannot run: ConfigError" in plans["plain"].explain()
    # one that does not fit in memory: a budget between ZeRO-3's peak and DDP's
    base = {b["name"]: b for b in plans["plain"].baselines}
    budget = (base["dp"]["peak_memory_bytes"] + base["zero3"]["peak_memory_bytes"]) / 2
    assert base["zero3"]["peak_memory_bytes"] < budget < base["dp"]["peak_memory_bytes"]
    # recompute pinned off: recomputing layers would fit it
    tight = _plan(
        "llama", memory_budget=budget, offload=False, alternatives=False, compare=["dp=2,zero=0,m=1,recompute=none"]
    )
    (entry,) = tight.comparisons
    assert not entry["feasible"] and "InfeasiblePlanError" in entry["reason"] and "short" in entry["reason"]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["plain", "pipeline", "offload"])
def test_reports_of_a_plan_read_back_from_json_are_identical(plans, kind):
    plan = plans[kind]
    again = autopar.Plan.from_json(plan.to_json(timings=True))
    assert again == plan
    assert again.explain() == plan.explain()
    assert again.explain("html") == plan.explain("html")
    # the default plan file leaves the wall-clock figures out (it is byte-identical across runs): its report
    # lacks them, and says the planning time is not kept, and differs in nothing else
    lean = autopar.Plan.from_json(plan.to_json()).explain().splitlines()
    full = plan.explain().splitlines()
    gone = [line for line in full if line not in lean]
    assert gone and all("planning time" in line or any(k in line for k in WALL_CLOCK_KEYS) for line in gone)
    (added,) = [line for line in lean if line not in full]
    assert "planning time" in added and "not kept in plan files" in added


@pytest.mark.integration
def test_compare_adds_layouts_to_a_plan(plans):
    args, kwargs = make_batch("llama", batch=8, seq=16)
    plan = autopar.Plan.from_json(plans["offload"].to_json())
    out = autopar.compare(plan, "dp=2,zero=0", model=make_model("llama"), example_inputs=args, example_kwargs=kwargs)
    (entry,) = out.comparisons
    assert entry["feasible"] and entry["mesh"] == {"dp": 2, "tp": 1} and entry["zero_stage"] == 0
    assert "## Your layout" in out.explain() and "### dp=2,zero=0" in out.explain()


@pytest.mark.integration
def test_parse_layout():
    assert parse_layout("tp=8,pp=4,zero=1") == {"tp": 8, "pp": 4, "zero": 1}
    assert parse_layout("m=4 schedule=1f1b") == {"num_microbatches": 4, "schedule": "1f1b"}
    for bad in ("tp=two", "tp", "foo=1", ""):
        with pytest.raises(ConfigError):
            parse_layout(bad)


def _priced(step_s: float, dp_s: float, zero: int):
    from types import SimpleNamespace

    return SimpleNamespace(
        predicted=SimpleNamespace(step_time_s=step_s),
        time_breakdown={"comm_dp": dp_s, "compute": step_s - dp_s},
        mesh={"dp": 8},
        zero_stage=zero,
        num_microbatches=1,
        recompute="none",
        layer_modes=None,
        expert_parallel={},
        offload=None,
        pipeline={},
        cluster=SimpleNamespace(devices_per_node=8, num_nodes=1),
    )


def test_a_loss_reason_gives_a_grown_term_in_percent_or_from_what_it_was():
    chosen = _priced(1.0, 0.10, 0)
    # dp communication 0.10 -> 0.25 s: +150%, said so (up to 10 times its size the percentage stays)
    assert loss_reason(_priced(1.15, 0.25, 3), chosen).endswith("+150.00 ms (+150%)")
    # from 0.2 ms to 266 ms: a percentage (+133000%) says nothing, the term's size before does
    tiny = _priced(0.9, 0.0002, 0)
    assert loss_reason(_priced(1.1662, 0.2662, 3), tiny).endswith("+266.00 ms (from 0.20 ms)")
    assert loss_reason(_priced(1.1, 0.1, 3), _priced(1.0, 0.0, 0)).endswith("+100.00 ms")  # none before


@pytest.mark.integration
def test_html_is_self_contained(plans):
    for plan in plans.values():
        page = plan.explain("html")
        assert page.count("<svg") >= 3
        # the only URL is the SVG namespace, an identifier that is never fetched
        assert set(re.findall(r"https?://[^\"' )]+", page)) <= {"http://www.w3.org/2000/svg"}
        for fetching in ("<script", "<link", "<img", "@import", "<iframe"):
            assert fetching not in page
        # url() only names a pattern of the page itself (the hatching of hidden communication), never a resource
        assert all(ref.startswith("url(#") for ref in re.findall(r"url\([^)]*\)", page))


@pytest.mark.integration
def test_markdown_charts_are_text(plans):
    md = plans["pipeline"].explain()
    assert "<svg" not in md
    assert re.search(r"^stage  0 [FB.]+$", md, re.M) and re.search(r"^stage  1 [FB.]+$", md, re.M)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_gantt_schedule_runs_every_microbatch_once(schedule, v):
    pp, m = 4, 8
    slots = simulate(schedule_order(schedule, pp, m, v), 1.0, 2.0)
    assert len(slots) == 2 * pp * m * v
    for stage in range(pp):
        mine = sorted((s for s in slots if s.stage == stage), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:], strict=False))  # one box at a time
    if schedule == "1f1b":  # the textbook makespan: (m + p - 1) (f + b)
        assert max(s.end for s in slots) == pytest.approx((m + pp - 1) * 3.0)


# `make test-all`: the CLI runs in a subprocess in test_cli; this one checks where its progress lines go
@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_progress_goes_to_stderr_never_into_stdout_or_json(tmp_path):
    import json
    import os
    import subprocess
    import sys

    base = [
        sys.executable,
        "-m",
        "autopar",
        "plan",
        "--model",
        "tiny-llama",
        "--cluster",
        "cpu:2",
        "--global-batch-size",
        "8",
        "--seq-len",
        "16",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = tmp_path / "plan.json"
    done = subprocess.run(
        base + ["--json", str(out), "--report", str(tmp_path / "r.html"), "--compare", "tp=1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("\n") == 1 and "[autopar]" not in done.stdout  # the summary, nothing else
    plan = autopar.Plan.from_json(out.read_text())
    assert json.loads(out.read_text())["comparisons"][0]["name"] == "tp=1" == plan.comparisons[0]["name"]
    ours = [line for line in done.stderr.splitlines() if line.startswith("[autopar]")]
    assert ours and not any(line.startswith("[autopar] mesh dp=") for line in ours)  # no line per candidate
    quiet = subprocess.run(base + ["--quiet"], capture_output=True, text=True, timeout=600, env=env)
    assert quiet.returncode == 0 and "[autopar]" not in quiet.stderr and quiet.stdout.count("\n") == 1


def test_progress_line_updates_in_place_on_a_terminal():
    import io

    from autopar.progress import PlanProgress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    msgs = [
        "tracing m",
        "traced 10 nodes",
        "mesh dp=2 tp=1 micro-batches=1: 1 ms",
        "mesh dp=1 tp=2 micro-batches=1: 2 ms",
        "pipeline pp=2 dp=1 tp=1: 3 ms",
        "pricing alternative dp: tp=1",
    ]
    quick = Tty()
    bar = PlanProgress(quick, after_s=3600.0)  # a plan found before the line is due draws nothing
    for m in msgs:
        bar(m)
    bar.close()
    assert quick.getvalue() == ""
    tty = Tty()
    bar = PlanProgress(tty, after_s=0.0)
    for m in msgs:
        bar(m)
    assert "\n" not in tty.getvalue() and tty.getvalue().count("\r") == len(msgs)
    bar.close()
    last = tty.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert "2 meshes, 1 pipeline layouts, 1 alternatives priced" in last
    log = io.StringIO()
    verbose = PlanProgress(log, verbose=True)
    for m in msgs:
        verbose(m)
    assert log.getvalue().count("\n") == len(msgs)  # --verbose: every candidate on its own line


# ------------------------------------------------------------------ hidden and exposed communication, per mesh axis


@pytest.fixture(scope="module")
def overlapped():
    """A GPU data-parallel plan (dp=8, no tensor axis, ZeRO-0): its gradient all-reduces overlap backward, and with
    GPT-2's 0.5 GB of fp32 gradients in 25 MiB buckets most of them hide."""
    return autopar.plan(
        "gpt2",
        "8xA100-80GB",
        global_batch_size=16,
        seq_len=256,
        constraints={"dp": 8, "tp": 1, "zero": 0},
        alternatives=False,
    )


@pytest.mark.integration
def test_hidden_communication_is_the_solvers_figure_per_axis(overlapped):
    p = overlapped.predicted
    assert overlapped.program == "data-parallel" and p.grad_sync_hidden_s > 0
    # the data axis is the one axis whose communication overlaps; its exposed part is the step's dp term
    assert overlapped.hidden_communication == {"comm_dp": p.grad_sync_hidden_s}
    assert overlapped.time_breakdown["comm_dp"] == p.grad_sync_s
    # no overlap: nothing hidden, on any axis
    off = autopar.plan(
        "gpt2",
        "8xA100-80GB",
        global_batch_size=16,
        seq_len=256,
        alternatives=False,
        constraints={"dp": 8, "tp": 1, "zero": 0, "overlap": False},
    )
    assert off.hidden_communication == {} and off.predicted.grad_sync_hidden_s == 0
    # what overlap hides is what the step no longer waits for (float sums in another order)
    whole = off.time_breakdown["comm_dp"]
    assert p.grad_sync_s + p.grad_sync_hidden_s == pytest.approx(whole, rel=1e-9)


@pytest.mark.integration
def test_layer_table_dp_rows_give_their_exposed_part(overlapped):
    rows = _collectives(overlapped, axis="dp")
    assert rows and all("exposed_s" in c for c in rows)
    p, dp = overlapped.predicted, overlapped.mesh["dp"]
    # the bucketed all-reduces of every parameter plus the one bucket latency a step pays are the whole sync
    floor = estimate_collective_time(Collective.ALL_REDUCE, 1.0, dp, overlapped.cluster.link_for_axis(dp, 1))
    whole = p.grad_sync_s + p.grad_sync_hidden_s
    assert sum(c["time_s"] * c["per_step"] for c in rows) + floor == pytest.approx(whole, rel=1e-5)
    # the exposed part is apportioned pro rata: one fraction for every row, E / whole, and with the latency's share
    # the rows' exposed parts add up to the step's exposed sync
    fraction = p.grad_sync_s / whole
    for c in rows:
        assert c["exposed_s"] == pytest.approx(c["time_s"] * fraction, rel=1e-12)
    exposed = sum(c["exposed_s"] * c["per_step"] for c in rows) + floor * fraction
    assert exposed == pytest.approx(p.grad_sync_s, rel=1e-9)
    md = overlapped.explain()
    c = max(rows, key=lambda c: c["time_s"])
    assert (
        f"| {c['time_s'] * 1e3:,.3f} | {c['per_step']:,.4g} | {c['time_s'] * c['per_step'] * 1e3:,.3f} | "
        f"{c['exposed_s'] * c['per_step'] * 1e3:,.3f} |"
    ) in md
    assert "pro rata to its sync time" in md


@pytest.mark.integration
def test_time_breakdown_shows_hidden_apart_from_the_step(overlapped):
    md, page = overlapped.explain(), overlapped.explain("html")
    hidden, exposed = overlapped.hidden_communication["comm_dp"], overlapped.time_breakdown["comm_dp"]
    label = TERM_LABELS["comm_dp"]
    share = exposed / overlapped.predicted.step_time_s
    assert f"| {label} | {exposed * 1e3:,.2f} | {share:.1%} | {hidden * 1e3:,.2f} |" in md
    assert f"dp: {exposed * 1e3:,.2f} ms exposed, {hidden * 1e3:,.2f} ms hidden" in md
    # the text bar's total is the step; the hidden part follows it, drawn apart
    step = overlapped.predicted.step_time_s
    assert re.search(rf"^chosen plan [^ ]*/+ {step * 1e3:,.2f} ms \(\+ {hidden * 1e3:,.2f} ms hidden\)$", md, re.M)
    # the SVG draws it hatched, after the bar, and leaves it out of the total
    assert 'fill="url(#hatch-step-time-ms-comm_dp)"' in page
    assert f"{step * 1e3:,.2f} (+ {hidden * 1e3:,.2f} hidden)" in page


def test_hidden_bars_stay_out_of_the_total():
    from autopar.report_charts import bars_svg, bars_text

    rows = [("a", {"x": 2.0, "y": 1.0})]
    lines = bars_text(rows, unit="s", scale=1.0, hidden={"a": {"y": 3.0}})
    assert lines[0].endswith(" 3.00 s (+ 3.00 s hidden)") and lines[0].count("/") == 25  # half of the 6 s axis
    svg = bars_svg(rows, unit="s", scale=1.0, title="t", hidden={"a": {"y": 3.0}})
    assert ">3.00 (+ 3.00 hidden)<" in svg and svg.count('fill="url(#hatch-t-y)"') == 2  # the bar and the legend
    assert "hidden" not in "".join(bars_text(rows, unit="s", scale=1.0))


@pytest.mark.integration
def test_an_overlapped_plan_read_back_from_json_reports_identically(overlapped):
    import json

    again = autopar.Plan.from_json(overlapped.to_json(timings=True))  # the default file leaves the planning time out
    assert again == overlapped
    assert again.explain() == overlapped.explain() and again.explain("html") == overlapped.explain("html")
    # a file written before plans carried hidden communication per axis: the data axis's, from predicted
    old = json.loads(overlapped.to_json())
    del old["hidden_communication"]
    assert autopar.Plan.from_json(json.dumps(old)).hidden_communication == overlapped.hidden_communication
    # and a plan without overlap writes no field, as before
    assert "hidden_communication" not in json.loads(
        autopar.Plan.from_json(
            json.dumps(old | {"predicted": old["predicted"] | {"grad_sync_hidden_s": 0.0}})
        ).to_json()
    )


# ------------------------------------------------------------------------------------------------ host memory


@pytest.mark.integration
def test_host_memory_is_charted_by_kind_against_its_capacity(plans):
    plan = plans["offload"]
    off, cluster = plan.offload, plan.cluster
    assert off["host_capacity_bytes_per_device"] == cluster.host_memory_bytes_per_device  # the solver's own capacity
    md, page = plan.explain(), plan.explain("html")
    gib = 1024**3
    host = md[md.index("### Host memory") : md.index("## Time breakdown")]
    assert f"| optimizer states | {off['optimizer_bytes_per_device'] / gib:,.2f} |" in host
    assert f"| gradients | {off['grad_bytes_per_device'] / gib:,.2f} |" in host
    assert f"| host capacity | {cluster.host_memory_bytes_per_device / gib:,.2f} |" in host
    assert re.search(r"^host, per device .*\| [\d.,]+ GiB$", host, re.M) and "| host capacity" in host
    svg = page[page.index('aria-label="Host memory per device (GiB)"') :].split("</svg>")[0]
    assert "stroke-dasharray" in svg and ">host capacity<" in svg  # the capacity line
    assert "optimizer states: " in svg and "gradients: " in svg  # a segment per kind
    # a plan that keeps everything on the device has no host chart
    assert "### Host memory" not in plans["plain"].explain()


@pytest.mark.integration
def test_host_memory_holds_offloaded_activations_too():
    # llama2-70b on one node of A100-80GB: states and activations both go to the host (the golden offload case)
    plan = autopar.plan("llama2-70b", "8xA100-80GB", global_batch_size=32, seq_len=4096, alternatives=False)
    assert plan.offload and plan.activation_offload
    md, gib = plan.explain(), 1024**3
    held = (
        plan.offload["optimizer_bytes_per_device"]
        + plan.offload["grad_bytes_per_device"]
        + plan.activation_offload["bytes_per_device"]
    )
    assert f"| activations | {plan.activation_offload['bytes_per_device'] / gib:,.2f} |" in md
    assert f"| **total** | {held / gib:,.2f} |" in md
    # what the solver let each device put there stays within its share of the node's host memory
    assert held <= plan.cluster.host_memory_bytes_per_device
    assert f"{held / plan.cluster.host_memory_bytes_per_device:.1%} of it" in md


# ------------------------------------------------------------------- the chosen plan is never the slower one


@pytest.mark.integration
def test_a_free_plan_beaten_by_an_alternative_adopts_it(monkeypatch):
    """A search that misses the best layout (made to answer with ZeRO-3's) is beaten by DDP, which the plan adopts;
    the search's answer becomes an alternative, and the report stays consistent."""
    from autopar import planning

    solve = planning.solve

    def missing(job, constraints, **kw):
        return solve(job, constraints or {"zero": 3, "tp": 1}, **kw)

    monkeypatch.setattr(planning, "solve", missing)
    plan = _plan("llama", compare=["dp=2,zero=1"])
    entries = {b["name"]: b for b in plan.baselines + plan.comparisons}
    search = entries["search"]
    assert search["zero_stage"] == 3 and search["step_time_s"] > plan.predicted.step_time_s
    fitting = [b["step_time_s"] for b in entries.values() if b["feasible"]]
    assert plan.predicted.step_time_s == min(fitting)  # never slower than any alternative that fits
    adopted = entries[plan.stats["adopted"]]
    assert adopted["step_time_s"] == plan.predicted.step_time_s and adopted["reason"] == "the chosen plan's layout"
    # the grid point is priced again once the search's answer (taken as the best grid point) is beaten
    assert entries["megatron"]["step_time_s"] <= search["step_time_s"]
    assert entries["megatron"]["layout"] != search["layout"]
    md = plan.explain()
    assert f"The search's own answer ({search['layout']}, {search['step_time_s'] * 1e3:,.2f} ms) was beaten by" in md
    assert "(the search's answer)" in md and "(chosen)" not in md  # the meshes table is the search's
    again = autopar.Plan.from_json(plan.to_json(timings=True))  # with the planning time the report shows
    assert again == plan and again.explain() == md


def test_the_search_is_never_beaten_on_the_golden_cases():
    """Over the golden presets and clusters planned free, the search's own plan is at least as fast as every
    alternative that fits: none had to be adopted (test_plan_snapshots keeps these files the planner's)."""
    import json

    from tests.plan_snapshots import CASES, GOLDEN

    free = [name for name, (_, _, kw) in CASES.items() if not kw.get("constraints")]
    assert len(free) >= 5
    for name in free:
        d = json.loads((GOLDEN / f"{name}.json").read_text())
        assert d["baselines"], name
        assert not any(b["name"] == "search" for b in d["baselines"]), name
        step = d["predicted"]["step_time_s"]
        for b in d["baselines"]:
            if b["feasible"]:
                assert step <= b["step_time_s"] * (1 + 1e-12), (name, b["name"])


@pytest.mark.integration
def test_the_search_tries_lean_gradients_on_one_device():
    """llama2-7b on one A100-40GB offloads states: under mixed precision a ZeRO stage >= 1 holds gradients in bf16,
    half of stage 0's fp32, so less goes to the host. The search once tried stage 0 only on a one-rank data axis,
    and the ZeRO-3 alternative beat it; now the search's own plan is the fastest, with nothing to adopt."""
    plan = autopar.plan("llama2-7b", "1xA100-40GB", global_batch_size=8, seq_len=2048)
    assert plan.mesh == {"dp": 1, "tp": 1} and plan.offload and "adopted" not in plan.stats
    assert not any(b["name"] == "search" for b in plan.baselines)
    fitting = [b for b in plan.baselines if b["feasible"]]
    assert {b["name"] for b in fitting} >= {"dp", "zero3"}
    assert all(plan.predicted.step_time_s <= b["step_time_s"] * (1 + 1e-12) for b in fitting)
    # ZeRO-0 (fp32 gradients) is the slower of the two: it keeps more on the host
    ddp = next(b for b in fitting if b["name"] == "dp")
    assert plan.zero_stage >= 1 and ddp["step_time_s"] > plan.predicted.step_time_s


@pytest.mark.integration
def test_compare_prices_layouts_against_the_plan_it_is_given():
    """A layout compared with a pinned plan afterwards says how it compares with that plan, not with the plan a new
    search would make (which, here, is that very layout)."""
    args, kwargs = make_batch("llama", batch=8, seq=16)
    pinned = _plan("llama", constraints={"tp": 2}, alternatives=False)
    out = autopar.compare(pinned, "dp=2,zero=0", model=make_model("llama"), example_inputs=args, example_kwargs=kwargs)
    assert out.predicted == pinned.predicted and out.mesh == {"dp": 1, "tp": 2}  # the plan stays what it was
    (entry,) = out.comparisons
    assert entry["feasible"] and entry["step_time_s"] < pinned.predicted.step_time_s
    share = 1 - entry["step_time_s"] / pinned.predicted.step_time_s
    assert entry["reason"].startswith(f"{share:.1%} faster than the chosen plan, which was planned before")
    assert f"In one line: {entry['reason']}." in out.explain()


@pytest.mark.integration
def test_a_searched_cp_plan_reports_its_degree_algorithm_and_the_degrees_priced():
    # The wide two-layer LLaMA of the cp search tests under a budget only cp fits: the report names the degree,
    # the algorithm with one priced line per algorithm (all-to-all refused with its reason where the heads do
    # not divide), and every degree searched with its memory per device or why it was not priced.
    from tests.passes.test_context_parallel import _search, _wide_llama

    model, args, kwargs = _wide_llama(16384, heads=6, kv_heads=3, hidden=768)
    plan = _search(model, args, kwargs, memory_budget="200MiB")
    md = plan.explain()
    section = md[md.index("## Context parallelism") : md.index("## Time breakdown")]
    cp = plan.context_parallel
    assert f"split over cp={plan.mesh['cp']} ranks" in section and f"**{cp['algorithm']}**" in section
    for line in cp["priced"]:
        assert f"- {line}" in section
    assert "- alltoall: 6 heads not divisible by cp=4" in section
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| cp ")]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == [str(r["degree"]) for r in cp["search"]]
    for row, r in zip(rows, cp["search"], strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == (f"{r['peak_memory_bytes'] / 2**30:,.2f}" if r["feasible"] else "-")
        if r["degree"] == plan.mesh["cp"]:
            assert cells[4] == "chosen"
        elif r["feasible"]:
            assert cells[4] == f"{r['step_time_s'] / plan.predicted.step_time_s - 1:.1%} slower"
        else:
            assert cells[4] == r["reason"] and r["reason"]
    again = autopar.Plan.from_json(plan.to_json(timings=True))  # with the planning time the report shows
    assert again.explain() == md


@pytest.mark.integration
def test_a_cp_plan_is_compared_with_layouts_at_their_own_cp_degree():
    # The same wide LLaMA at 16K tokens under a budget only cp fits (the cp search tests check that cp=1 does not
    # fit there). The hand layouts are priced without cp, on the plan without cp's own trace: they do not fit, and
    # say so. The user's layouts are priced at their own degree: "cp=4" is a real plan with a cp axis, "cp=3"
    # cannot split the world of 4, and "cp=2" agrees with what the search found at that degree.
    from tests.passes.test_context_parallel import _wide_llama

    model, args, kwargs = _wide_llama(16384)
    plan = autopar.plan(
        model,
        "4xH100-80GB",
        args,
        kwargs,
        memory_budget="300MiB",
        compare=["cp=4,tp=1,cp_attention=ring", "cp=3", "cp=2,tp=1"],
    )
    assert plan.mesh.get("cp", 1) > 1
    base = {b["name"]: b for b in plan.baselines}
    for name in ("dp", "zero3"):
        assert not base[name]["feasible"] and "InfeasiblePlanError" in base[name]["reason"], base[name]
    assert base["megatron"]["feasible"] is False  # tp inside the node, without cp: nothing fits either
    four, three, two = plan.comparisons
    assert four["feasible"] and four["mesh"]["cp"] == 4
    assert four["step_time_s"] >= plan.predicted.step_time_s * (1 - 1e-9)  # the search's optimum beats it
    assert not three["feasible"] and "does not divide the world size 4" in three["reason"]
    # cp=2 is what the search priced at that degree: here it does not fit, and the compared layout says so too
    searched = {r["degree"]: r for r in plan.context_parallel["search"]}
    assert not searched[2]["feasible"] and searched[2]["reason"].startswith("does not fit")
    assert not two["feasible"] and "InfeasiblePlanError" in two["reason"]
    md = plan.explain()
    assert "Your layout" in md and "cp=4" in md


@pytest.mark.integration
def test_compare_prices_a_cp_layout_next_to_a_plan_without_cp():
    # A plan without cp, compared afterwards with "cp=2": the layout is solved on the cp=2 trace, so its mesh has
    # the cp axis and its memory is that trace's: a micro-batch of one sequence on dp=2, against a micro-batch of
    # one sequence split over cp=2, holds half the tokens per device (no recompute on either)
    args, kwargs = make_batch("llama", batch=4, seq=32)
    pins = {"tp": 1, "dp": 2, "recompute": "none", "zero": 0, "num_microbatches": 2}
    plain = autopar.plan(make_model("llama"), "cpu:2", args, kwargs, constraints=pins, alternatives=False)
    out = autopar.compare(
        plain,
        "cp=2,dp=1,tp=1,recompute=none,zero=0,m=4",
        model=make_model("llama"),
        example_inputs=args,
        example_kwargs=kwargs,
    )
    (entry,) = out.comparisons
    assert entry["feasible"], entry["reason"]
    assert entry["mesh"] == {"dp": 1, "cp": 2, "tp": 1}
    assert entry["memory"]["activations"] < plain.predicted.memory_breakdown["activations"]


def test_assumptions_give_the_clusters_links_and_their_per_collective_figures():
    """A cluster file (or `bench run`'s fit) sets the links apart from the device preset's: the report gives the
    figures the plan was priced with, the per-collective ones on lines of their own."""
    cluster = autopar.ClusterSpec.from_overrides(
        {
            "cluster": "cpu:2",
            "intra_node_link": {
                "latency_s": 7.5e-4,
                "bandwidth_bytes_per_s": 1.3e9,
                "per_collective": {"reduce_scatter": {"latency_s": 8.25e-4, "bandwidth_bytes_per_s": 0.4e9}},
            },
        },
        source="test",
    )
    assert cluster.device.intra_node_link != cluster.intra_node_link  # the preset's stays on the device
    args, kwargs = make_batch("llama", batch=8, seq=16)
    plan = autopar.plan(make_model("llama"), cluster, args, kwargs, alternatives=False)
    md = explain.render_markdown(plan)
    assert "link inside a node: loopback-gloo | 1.3 GB/s per device, latency 750.0 µs" in md
    assert "link inside a node: reduce-scatter, measured on its own | 0.40 GB/s per device, latency 825.0 µs" in md

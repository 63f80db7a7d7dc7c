"""The free search weighs an expert axis (`autopar.ep_search`): which degrees it prices, and that it picks ep exactly
when the fastest plan that fits has one, checked against each layout planned on its own."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ep_search import ep_degrees
from autopar.errors import AutoparError
from autopar.expert_parallel import MoeShape
from tests.families import family_batch
from tests.models import tiny_llama

EP_CLUSTER = "8xH100-80GB"


def _shape(num_experts: int) -> MoeShape:
    return MoeShape(num_experts, 2, 64, ("m.experts",), ("m.experts.w",), 1)


@pytest.mark.parametrize(
    "experts, world, constraints, offload, degrees, why",
    [
        (8, 8, {}, None, [2, 4, 8], ""),
        (8, 12, {}, None, [2, 4], ""),  # 3, 6 and 12 do not divide 8 experts
        (6, 8, {}, None, [2], ""),
        (8, 8, {"num_microbatches": 2, "zero": 0}, False, [2, 4, 8], ""),  # pins ep runs with
        (8, 8, {"tp": 2}, None, [], "the constraints pin tp=2"),
        (8, 8, {"zero": 3}, None, [], "the constraints pin zero=3"),
        (8, 8, {"dp": 4}, None, [], "the constraints pin dp=4"),
        (8, 8, {}, True, [], "offload=True"),
        (3, 8, {}, None, [], "no ep > 1 divides both the data axis (dp=8) and the 3 experts"),
    ],
)
def test_the_degrees_a_free_plan_weighs(experts, world, constraints, offload, degrees, why):
    found, reason = ep_degrees(_shape(experts), constraints, world, offload)
    assert found == degrees
    assert why in reason and bool(reason) == bool(why)


def _big_experts():
    """A Mixtral of 32 experts of 16384 hidden units a layer on the meta device: expert weights (201M parameters)
    dwarf the rest, so splitting them weighs."""
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        config = MixtralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=16384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=32,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            use_cache=False,
            router_aux_loss_coef=0.0,
            attn_implementation="sdpa",
            experts_implementation="batched_mm",
        )
        return MixtralForCausalLM(config)


def _each_layout(model, budget):
    """The free plan, and each layout it weighs planned on its own: without ep (ep=1 pinned) and at every ep degree
    (a Plan, or the autopar error that says why it has none). 16 sequences: enough tokens that ep's all-to-alls
    outweigh ZeRO-1's gathers of the experts (their collectives and their unpacking) on the whole device."""
    args, kwargs = family_batch("mixtral", batch=16)

    def plan(constraints):
        try:
            return autopar.plan(
                model, EP_CLUSTER, args, kwargs, constraints=constraints, memory_budget=budget, alternatives=False
            )
        except AutoparError as e:
            return e

    free = plan({})
    return free, {d: plan({"ep": d}) for d in (1, 2, 4, 8)}


def _fastest(layouts: dict):
    fitting = {d: p for d, p in layouts.items() if isinstance(p, autopar.Plan)}
    return min(fitting.items(), key=lambda item: item[1].predicted.step_time_s)


@pytest.mark.integration
@pytest.mark.parametrize(
    "budget, pays",
    [
        # the states of ZeRO-0 and -1 exceed 1200 MiB: without ep the search must shard (ZeRO-3) and offload, which
        # ep=8 (1/8 of the experts a device, nothing gathered) beats
        ("1200MiB", True),
        # with the whole device the search's ZeRO-1 plan needs no all-to-all and shards the optimizer step over all
        # eight ranks: no ep degree beats it
        (None, False),
    ],
)
def test_the_free_search_picks_ep_only_where_it_is_faster(budget, pays):
    free, layouts = _each_layout(_big_experts(), budget)
    best_degree, best = _fastest(layouts)
    assert (best_degree > 1) is pays, f"the case no longer shows what it is for: fastest layout ep={best_degree}"
    assert free.predicted.step_time_s == pytest.approx(best.predicted.step_time_s, rel=1e-9)
    assert free.expert_parallel.get("degree", 1) == best_degree
    assert free.program == ("expert-parallel" if pays else layouts[1].program)
    # the plan's record of what it weighed: the same prices, each degree's line against the plan
    record = free.expert_parallel["search"]
    assert record["degrees"] == [2, 4, 8] and record["chosen"] == best_degree
    entries = {e["name"]: e for e in record["entries"]}
    for d in (2, 4, 8):
        e = entries[f"ep{d}"]
        if isinstance(layouts[d], autopar.Plan):
            assert e["feasible"] and e["step_time_s"] == pytest.approx(layouts[d].predicted.step_time_s, rel=1e-9)
        else:
            assert not e["feasible"] and "per device" in e["reason"]
    assert entries["no_ep"]["step_time_s"] == pytest.approx(layouts[1].predicted.step_time_s, rel=1e-9)
    report = free.explain()
    assert "The search weighed ep in {2, 4, 8}" in report
    if pays:
        assert f"ep={best_degree} is faster and fits" in report
        assert "| the search's plan without ep |" in report and "step time, most of it" in entries["no_ep"]["reason"]
    else:
        assert "none beats the plan, so it has no expert axis" in report
    assert autopar.Plan.from_json(free.to_json()).expert_parallel == free.expert_parallel


def test_a_dense_model_weighs_no_expert_axis():
    (ids,), kwargs = family_batch("llama", batch=4)
    plan = autopar.plan(tiny_llama(), "cpu:2", (ids,), kwargs, alternatives=False)
    assert plan.expert_parallel == {} and "Expert parallelism" not in plan.explain()


@pytest.mark.integration  # plans the tiny Mixtral (about 2 s)
def test_pins_that_rule_ep_out_are_said():
    args, kwargs = family_batch("mixtral", batch=4)
    from tests.families import make_family

    plan = autopar.plan(make_family("mixtral"), "cpu:2", args, kwargs, constraints={"zero": 1}, alternatives=False)
    record = plan.expert_parallel["search"]
    assert record["degrees"] == [] and "the constraints pin zero=1" in record["reason"]
    assert "the search weighed no expert axis: the constraints pin zero=1" in plan.explain()

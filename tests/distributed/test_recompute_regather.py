"""Recompute in the sharded program without overlap at ZeRO-1/2: it gathers each weight at each use, so a
recomputed forward gathers the weights of its layers over the data axis again. The runtime's collectives are
counted, and the plan prices them by hand.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.comm import Collective, estimate_collective_time
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

CASES = [{"dp": 2, "tp": 1, "zero": z, "overlap": False, "recompute": r} for z in (1, 3) for r in ("none", "full")]


def _layer_params() -> list[int]:
    """Element counts of the tiny LLaMA's parameters inside its repeated layers (what full recompute runs again)."""
    return [p.numel() for name, p in make_model("llama").named_parameters() if ".layers." in f".{name}"]


def _gathers(rank: int, world_size: int, cases):
    """Per case, the all-gathers of a second training step (the first one's set-up left out): every gather of a
    split weight without overlap goes through `overlap.gather_split`, wherever it runs (a forward, a recomputed
    forward, a saved-tensor hook of the backward, which a dispatch mode such as CommDebugMode does not see)."""
    from autopar.runtime import overlap

    real = overlap.gather_split
    out = []
    for constraints in cases:
        args, kwargs = make_batch("llama")
        pm = autopar.compile(make_model("llama"), f"cpu:{world_size}", args, kwargs, constraints=constraints)
        pm.train_step(*args, **kwargs)
        calls = []
        overlap.gather_split = lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k)
        try:
            pm.train_step(*args, **kwargs)
        finally:
            overlap.gather_split = real
        out.append(len(calls))
    return out


@pytest.mark.distributed
def test_recompute_gathers_its_layers_weights_again_at_zero1_without_overlap():
    z1_none, z1_full, z3_none, z3_full = run_distributed(_gathers, 2, CASES)[0]
    layer_params = len(_layer_params())
    assert layer_params == 18  # two layers of nine weights
    # ZeRO-1: every weight once per micro-batch, and the layers' weights again in the recomputed forward
    assert z1_full == z1_none + layer_params
    # ZeRO-3: recompute's gather is the one the backward makes anyway (after the forward released the weight); the
    # released weights are gathered again in the backward, so more gathers than ZeRO-1's once per micro-batch
    assert z3_full == z3_none
    assert z3_none > z1_none


@pytest.mark.integration
def test_the_plan_prices_recompute_s_second_gathers():
    # The same layouts planned: full recompute costs its forwards at every stage, and at ZeRO-1 without overlap
    # also the all-gather of each layer's weights (fp32 on CPU, one micro-batch) on the data axis's link: each
    # weight's bytes, one latency per layer (the program gathers a layer in one collective) and the copies out of
    # the gathered buffers; with overlap (each weight held for the step) and at ZeRO-3 nothing more. 1e-9: the
    # figures are sums of the same terms.
    args, kwargs = make_batch("llama")

    def step(**pins) -> float:
        constraints = {"dp": 2, "tp": 1, "num_microbatches": 1, **pins}
        plan = autopar.plan(make_model("llama"), "cpu:2", args, kwargs, constraints=constraints, alternatives=False)
        assert plan.recompute == pins["recompute"] and plan.zero_stage == pins["zero"]
        return plan.predicted.step_time_s

    def recompute_cost(**pins) -> float:
        return step(recompute="full", **pins) - step(recompute="none", **pins)

    forwards = recompute_cost(zero=1, overlap=True)
    assert forwards > 0
    link = autopar.ClusterSpec.parse("cpu:2").link_for_axis(2, 1)
    latency = estimate_collective_time(Collective.ALL_GATHER, 1.0, 2, link)
    layers = 2  # of nine weights each
    gathers = sum(estimate_collective_time(Collective.ALL_GATHER, 4 * n, 2, link) - latency for n in _layer_params())
    gathers += layers * latency
    # and each weight's copy out of its layer's gathered buffer: its bytes read and written at the rank's memory
    # bandwidth
    device = autopar.ClusterSpec.parse("cpu:2").device
    gathers += sum(2 * 4 * n for n in _layer_params()) / (
        device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    )
    assert recompute_cost(zero=1, overlap=False) == pytest.approx(forwards + gathers, rel=1e-9)
    assert recompute_cost(zero=3, overlap=False) == pytest.approx(forwards, rel=1e-9)

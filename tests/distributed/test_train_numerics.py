"""Numerics: parallel training on 2 and 4 gloo ranks gives the single-process losses and parameters."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
MODELS = ("llama", "gpt2", "bert")
# fp32 on CPU: collectives change the order of summation, so losses agree to rounding (~1e-6 relative),
# well inside the 1e-4.
LOSS_RTOL = 1e-4
# AdamW divides each gradient by its running RMS: for gradients near eps, rounding-level differences
# (from a different summation order over ranks) become update differences. eps=1e-6 (instead of 1e-8)
# damps that; single elements still differ by up to ~2.5e-5 after two steps at lr=1e-2 (seen: 1 of
# 16384 in GPT-2's c_proj on 4 ranks). So each element may differ by 1e-4 (1% of lr) and the mean
# difference of a tensor by at most 1e-6: a wrong shard or a missing reduction moves most elements
# of a tensor by ~lr = 1e-2, four orders of magnitude more.
ADAM_EPS = 1e-6
PARAM_ATOL, PARAM_RTOL = 1e-4, 1e-4
PARAM_MEAN_ATOL = 1e-6


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _reference(name: str) -> tuple[list[float], dict]:
    model = make_model(name)
    args, kwargs = make_batch(name)
    return train_locally(model, args, kwargs, _optimizer(model.parameters()), 2)


def _train_cases(rank: int, world_size: int, cases):
    out = []
    for name, constraints, budget in cases:
        model = make_model(name)
        args, kwargs = make_batch(name)
        pm = autopar.compile(
            model,
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_optimizer,
            constraints=constraints,
            memory_budget=budget,
        )
        losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
        state = pm.state_dict()
        local = sum(p.numel() for p in pm.parameters())
        sharded = (
            pm.plan.zero_stage >= 1
            and pm.plan.mesh["dp"] > 1
            or any(p != "R" for p in pm.plan.param_placements.values())
        )
        out.append(
            {
                "losses": losses,
                "state": state if rank == 0 else None,
                "mesh": dict(pm.plan.mesh),
                "local_numel": local,
                "num_microbatches": pm.plan.num_microbatches,
                "program": str(pm.plan.program),
                "zero": pm.plan.zero_stage,
                "recompute": getattr(pm.plan, "recompute", "none"),
                # checkpointed segments run: once in forward and once more in backward per micro-batch
                "segment_calls": getattr(getattr(pm, "_interp", None), "segment_calls", 0),
                "micro_batch_size": pm.plan.micro_batch_size,
                "full_numel": sum(p.numel() for p in model.parameters()),
                "sharded": sharded,
                "tp_sharded": any(p != "R" for p in pm.plan.param_placements.values()),
            }
        )
    return out


def _check(world_size: int, cases) -> None:
    results = run_distributed(_train_cases, world_size, cases)
    for i, (name, constraints, budget) in enumerate(cases):
        ref_losses, ref_state = _reference(name)
        got = results[0][i]
        for r in range(world_size):  # every rank reports the same loss
            assert results[r][i]["losses"] == pytest.approx(got["losses"], rel=1e-6)
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (name, constraints, got["mesh"])
        if "tp" in constraints:
            assert got["mesh"]["tp"] == constraints["tp"]
        # DDP's layout runs as the plain data-parallel program; everything else on DTensors
        plain = got["mesh"]["tp"] == 1 and got["zero"] == 0 and got.get("recompute", "none") == "none"
        assert got["program"] == ("data-parallel" if plain else "sharded"), (name, constraints)
        if "recompute" in constraints:
            assert got["recompute"] == constraints["recompute"]
            if constraints["recompute"] != "none":  # the layers really ran under checkpointing
                assert got["segment_calls"] > 0 and got["segment_calls"] % 2 == 0, (name, constraints)
        if "num_microbatches" in constraints:
            assert got["num_microbatches"] == constraints["num_microbatches"]
        if "micro_batch_size" in constraints:
            assert got["micro_batch_size"] == constraints["micro_batch_size"]
        if budget is not None:  # the budget rules out replicated states: the layout must shard them
            assert got["sharded"], (name, constraints)
            if got["mesh"]["dp"] == 1:  # nothing to shard over but the tensor axis
                assert got["tp_sharded"], (name, constraints)
        assert set(got["state"]) == set(ref_state)
        for key, ref in ref_state.items():
            torch.testing.assert_close(
                got["state"][key],
                ref,
                atol=PARAM_ATOL,
                rtol=PARAM_RTOL,
                msg=lambda m, k=key, n=name, c=constraints: f"{n} {c} {k}: {m}",
            )
            if ref.is_floating_point():
                mean_diff = (got["state"][key] - ref).abs().mean().item()
                assert mean_diff <= PARAM_MEAN_ATOL, (name, constraints, key, mean_diff)
        # parameters() holds this rank's shards: smaller than the model wherever the plan shards anything
        if got["sharded"]:
            assert got["local_numel"] < got["full_numel"]
        else:
            assert got["local_numel"] == got["full_numel"]


# Per-device budgets below the replicated model states of each tiny model (bytes), so that the
# solver must shard weights on the tensor axis (Megatron-style) and, on 4 ranks, states over dp.
TP_BUDGET = {"llama": 1.8e6, "gpt2": 2.5e6, "bert": 1.8e6}
ZERO_BUDGET = {"llama": 3e6, "bert": 2.5e6}


def _cpu2_cases() -> list:
    cases = [(m, c, None) for m in MODELS for c in ({}, {"tp": 2})]
    # one micro-batch: the budgets are meant to force sharding, not gradient accumulation
    cases += [(m, {"tp": 2, "num_microbatches": 1}, TP_BUDGET[m]) for m in MODELS]
    # gradient accumulation: the llama batch has fewer kept labels in its first half, BERT's are uneven
    # everywhere, so only micro-batches weighted by their kept labels give the whole-batch loss
    cases += [("llama", {"num_microbatches": 2}, None), ("bert", {"dp": 2, "num_microbatches": 2}, None)]
    cases += [("bert", {"tp": 1, "zero": 0, "num_microbatches": 2}, None), ("gpt2", {"tp": 1, "zero": 0}, None)]
    # activation recompute: whole layers on the tensor axis, attention internals over the data axis
    cases += [("llama", {"tp": 2, "recompute": "full"}, None), ("gpt2", {"dp": 2, "recompute": "selective"}, None)]
    return cases


# `make test` trains these on 2 ranks: the tensor axis forced by a budget below the replicated states, gradient
# accumulation weighted by kept labels (LLaMA's first half keeps fewer; BERT's are uneven everywhere, with dp=2), and
# each recompute mode; every model free and on a pinned tp=2 trains in tests/distributed/test_family_matrix.py, and
# these cases for every model in `make test-all`
CPU2_FAST = [
    ("llama", {"tp": 2, "num_microbatches": 1}, TP_BUDGET["llama"]),
    ("llama", {"num_microbatches": 2}, None),
    ("bert", {"dp": 2, "num_microbatches": 2}, None),
    ("llama", {"tp": 2, "recompute": "full"}, None),
    ("gpt2", {"dp": 2, "recompute": "selective"}, None),
]


def test_cpu2_free_tp2_and_sharded():
    assert all(case in _cpu2_cases() for case in CPU2_FAST)
    _check(2, CPU2_FAST)


@pytest.mark.slow
def test_cpu2_free_tp2_and_sharded_every_model():
    _check(2, [case for case in _cpu2_cases() if case not in CPU2_FAST])


def _cpu4_cases() -> list:
    cases = [(m, c, None) for m in MODELS for c in ({}, {"tp": 2}, {"tp": 4})]
    cases += [(m, {"tp": 2, "zero": 3, "num_microbatches": 1}, b) for m, b in ZERO_BUDGET.items()]
    cases += [("gpt2", {"tp": 2, "micro_batch_size": 2}, None), ("llama", {"tp": 4, "num_microbatches": 8}, None)]
    # gradients of dp-replicated parameters summed over dp once per step, after two micro-batches
    cases += [("gpt2", {"tp": 2, "dp": 2, "zero": 0, "num_microbatches": 2}, None)]
    return cases


# `make test` trains these on 4 ranks: a free plan, tp=4, ZeRO-3 forced by a budget, a pinned micro-batch size
# and dp-replicated gradients summed after accumulation; the other cases (each model free, tp=2 and tp=4, more
# micro-batches) train in `make test-all`
CPU4_FAST = [
    ("bert", {}, None),
    ("llama", {"tp": 4}, None),
    ("llama", {"tp": 2, "zero": 3, "num_microbatches": 1}, ZERO_BUDGET["llama"]),
    ("gpt2", {"tp": 2, "micro_batch_size": 2}, None),
    ("gpt2", {"tp": 2, "dp": 2, "zero": 0, "num_microbatches": 2}, None),
]


def test_cpu4_free_tp2_tp4_and_zero3():
    assert all(case in _cpu4_cases() for case in CPU4_FAST)
    _check(4, CPU4_FAST)


@pytest.mark.slow
def test_cpu4_free_tp2_tp4_and_zero3_every_model():
    _check(4, [case for case in _cpu4_cases() if case not in CPU4_FAST])

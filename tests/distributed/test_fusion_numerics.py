"""Kernel fusion in compiled programs: the fused tiny LLaMA and GPT-2 train like the unfused single-process model.

`autopar.compile(..., fuse_kernels=True)` plans and runs the graph rewritten by `passes.fused_ops`: flash
attention, fused norms and the fused LM-head loss (Triton kernels, interpreted on the CPU, hence tiny shapes
and one step). Checked on one process, and on 2 gloo ranks with the tensor axis (the fused ops' sharding
rules) and with the data axis (DTensor program and plain data-parallel program).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

LR = 1e-2
ADAM_EPS = 1e-6  # as in test_train_numerics: keeps rounding-level gradient differences from becoming updates
# The kernels sum in another order than ATen (online softmax over key blocks, blocked row reductions, chunked
# GEMMs), and collectives reorder sums again: measured loss differences ~1e-7 relative. A wrong scale, mask,
# eps, ignore_index or a missing reduction moves the loss by more than 1e-3.
LOSS_RTOL = 1e-5
# One AdamW step at lr=1e-2 moves every element by about lr; measured differences up to ~3e-5 (AdamW turns
# rounding-level gradient differences of near-zero gradients into update differences, see
# test_train_numerics). A wrong gradient moves most elements of a tensor by ~lr = 1e-2.
PARAM_ATOL = 1e-4
PARAM_MEAN_ATOL = 1e-6
BATCH, SEQ = 4, 8


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _reference(name: str) -> tuple[float, dict]:
    model = make_model(name)
    args, kwargs = make_batch(name, batch=BATCH, seq=SEQ)
    opt = _optimizer(model.parameters())
    loss = model(*args, **kwargs).loss
    loss.backward()
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world_size: int, name: str, constraints: dict, shard_fused_ops: bool = False) -> dict:
    model = make_model(name)
    args, kwargs = make_batch(name, batch=BATCH, seq=SEQ)
    cluster = f"cpu:{world_size}"
    plan = autopar.plan(model, cluster, args, kwargs, constraints=constraints, fuse_kernels=True, alternatives=False)
    if shard_fused_ops:
        plan = _with_sharded_fused_ops(plan, model, args, kwargs)
    pm = autopar.compile(model, cluster, args, kwargs, optimizer=_optimizer, plan=plan)
    loss = pm.train_step(*args, **kwargs)
    graph = pm.traced.graph_module.graph if hasattr(pm, "_interp") else pm._gm.graph
    fused = {n.name: str(n.target) for n in graph.nodes if str(n.target).startswith("autopar.")}
    interp = getattr(pm, "_interp", None)
    state = pm.state_dict()  # gathers shards: every rank takes part
    return {
        "loss": loss,
        "state": state if rank == 0 else None,
        "program": str(pm.plan.program),
        "mesh": dict(pm.plan.mesh),
        "fusion": pm.plan.fusion,
        "fused": fused,
        "strategies": {n: pm.plan.node_strategy.get(n, "") for n in fused},
        "fallback": sorted(interp.fallback_ops) if interp is not None else [],
    }


def _with_sharded_fused_ops(plan, model, args, kwargs):
    """The plan with every fused op on its first sharded strategy (heads, rows, tokens) on the tensor axis.

    On CPU costs the solver keeps these tiny ops replicated (a gather is cheaper than their work); GPU plans
    shard them (see tests/test_fusion_plan.py). Forcing the rules' own strategies checks that the runtime
    runs each of them correctly: every other node keeps its placements, and values are redistributed to
    what each node asks for.
    """
    from autopar.passes.fused_ops import fuse_traced
    from autopar.passes.sharding_rules import placement_str, strategies_for
    from autopar.trace import trace_model

    graph = fuse_traced(trace_model(model, args, kwargs)).graph_module.graph
    inputs, outputs, names = dict(plan.node_inputs), dict(plan.node_output), dict(plan.node_strategy)
    for node in graph.nodes:
        if str(node.target).startswith("autopar."):
            strategy = strategies_for(node, plan.mesh["tp"])[1]  # [0] is the replicated one
            inputs[node.name] = tuple(placement_str(p) for p in strategy.inputs)
            outputs[node.name] = placement_str(strategy.output)
            names[node.name] = strategy.name
    return dataclasses.replace(plan, node_inputs=inputs, node_output=outputs, node_strategy=names)


def _check(got: dict, name: str) -> None:
    ref_loss, ref_state = _reference(name)
    assert got["loss"] == pytest.approx(ref_loss, rel=LOSS_RTOL)  # LOSS_RTOL: summation order only
    for key, ref in ref_state.items():
        diff = (got["state"][key] - ref).abs()
        assert float(diff.max()) < PARAM_ATOL, key  # see PARAM_ATOL: rounding through AdamW
        assert float(diff.mean()) < PARAM_MEAN_ATOL, key
    assert not [op for op in got["fallback"] if op.startswith("autopar")], got["fallback"]  # ran on shards


@pytest.fixture
def one_rank_group():
    """compile joins a one-rank group on cpu:1; leave none behind for the next test."""
    yield
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
        torch.distributed.destroy_process_group()


LLAMA_OPS = {"flash_attention": 2, "rms_norm": 5, "linear_cross_entropy": 1}
GPT2_OPS = {"flash_attention": 2, "layer_norm": 5, "linear_cross_entropy": 1}


@pytest.mark.integration
# GPT-2 in `make test-all`: its fused ops (layer norm among them) are checked against the original graph in
# tests/passes/test_fused_ops.py
@pytest.mark.parametrize("name, ops", [("llama", LLAMA_OPS), pytest.param("gpt2", GPT2_OPS, marks=pytest.mark.slow)])
def test_fused_model_trains_like_the_original_on_one_process(name, ops, one_rank_group):
    got = _train(0, 1, name, {})  # the DTensor program runs the fused ops in the two-rank test below
    assert got["program"] == "data-parallel"
    assert got["fusion"]["enabled"] and {k: v for k, v in got["fusion"]["counts"].items() if v} == ops
    assert sorted(set(got["fused"].values())) == sorted(f"autopar.{op}.default" for op in ops)
    _check(got, name)


def _train_cases(rank: int, world_size: int, cases) -> list[dict]:
    return [_train(rank, world_size, "llama", constraints, shard) for constraints, shard in cases]


@pytest.mark.distributed
# slow: the Triton kernels run in the interpreter on both ranks (35 s on a busy 2-core machine); `make test` trains
# the fused model on one rank against the unfused one above
@pytest.mark.slow
def test_fused_llama_on_two_ranks_tensor_and_data_axes():
    # tensor axis with the fused ops sharded; data axis through DTensor (ZeRO-1) and through the plain
    # data-parallel program. The batch's ignored labels sit unevenly over the ranks (tests/models.py).
    cases = [({"tp": 2, "dp": 1}, True), ({"dp": 2, "tp": 1, "zero": 1}, False), ({"dp": 2, "tp": 1}, False)]
    ranks = run_distributed(_train_cases, 2, cases)
    for i, run in enumerate(ranks[0]):
        assert ranks[1][i]["loss"] == pytest.approx(run["loss"], rel=1e-6)  # every rank reports the same loss
        assert run["fusion"]["counts"]["flash_attention"] == 2
        _check(run, "llama")
    tp_run, zero_run, dp_run = ranks[0]
    assert tp_run["mesh"] == {"dp": 1, "tp": 2} and zero_run["mesh"] == dp_run["mesh"] == {"dp": 2, "tp": 1}
    programs = [run["program"] for run in ranks[0]]
    assert programs == ["sharded", "sharded", "data-parallel"]
    assert set(tp_run["strategies"].values()) == {"head parallel", "rows S(0)", "split tokens S(0)"}

"""Kernel fusion in planning: on by default for GPU clusters, off on CPUs, recorded in the plan and its report.

GPU plans are made on the meta device (llama2-7b, two traced layers standing for 32), so nothing runs a kernel.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.passes.fused_ops import FUSED_OPS
from tests.models import make_batch, make_model

GPU = "8xA100-80GB"
BATCH, SEQ = 16, 4096  # the HF causal mask is 16 x 1 x 4096 x 4096: proven causal in blocks


@pytest.fixture(scope="module")
def gpu_plans() -> dict:
    """llama2-7b on one 8-GPU node: the default (fused) plan, the unfused one, and a fused plan pinned to tp=8."""
    # no alternatives: what these tests read is the chosen plan, and pricing the layouts not chosen for the report
    # is as long again as planning
    kw = {"global_batch_size": BATCH, "seq_len": SEQ, "alternatives": False}
    return {
        "fused": autopar.plan("llama2-7b", GPU, **kw),
        "unfused": autopar.plan("llama2-7b", GPU, fuse_kernels=False, **kw),
        "tp8": autopar.plan("llama2-7b", GPU, constraints={"tp": 8, "dp": 1}, **kw),
    }


@pytest.mark.integration
def test_gpu_plan_fuses_every_layer_by_default(gpu_plans):
    plan = gpu_plans["fused"]
    # 32 layers: one attention and two norms each, the final norm, one LM-head loss
    counts = {"flash_attention": 32, "rms_norm": 65, "layer_norm": 0, "linear_cross_entropy": 1}
    assert plan.fusion == {"enabled": True, "skipped": [], "counts": counts}
    assert any(name.startswith("flash_attention") for name in plan.node_strategy)  # the plan names the fused graph
    assert not any(name.startswith("scaled_dot_product_attention") for name in plan.node_strategy)
    report = plan.explain()
    assert "| kernel fusion | on: 32 flash_attention, 65 rms_norm, 1 linear_cross_entropy |" in report
    assert gpu_plans["unfused"].fusion["enabled"] is False
    assert "| kernel fusion | off (ATen ops) |" in gpu_plans["unfused"].explain()


@pytest.mark.integration
def test_fused_plan_is_predicted_no_slower(gpu_plans):
    # flash attention skips the s x s scores (bytes, and half the FLOPs when causal); the fused loss skips the logits
    assert gpu_plans["fused"].predicted.step_time_s <= gpu_plans["unfused"].predicted.step_time_s


@pytest.mark.integration
def test_solver_shards_the_fused_ops_on_the_tensor_axis(gpu_plans):
    strategies = {name: s for name, s in gpu_plans["tp8"].node_strategy.items() if s and not s.startswith("follows")}
    fused = {name: s for name, s in strategies.items() if name.split("_default")[0] in FUSED_OPS}
    assert fused, strategies
    assert all(s != "replicate" for s in fused.values()), fused  # each one runs on 1/8 of the heads, rows or tokens


@pytest.mark.integration
def test_fusion_survives_json(gpu_plans):
    plan = gpu_plans["fused"]
    again = autopar.Plan.from_json(plan.to_json())
    assert again.fusion == plan.fusion
    assert "kernel fusion" in again.explain("html")


@pytest.mark.integration
def test_cpu_plans_do_not_fuse_unless_asked():
    model = make_model("llama", num_layers=1)
    args, kwargs = make_batch("llama", batch=2, seq=8)
    off = autopar.plan(model, "cpu:1", args, kwargs)
    assert off.fusion["enabled"] is False and not any(off.fusion["counts"].values())
    assert any(name.startswith("scaled_dot_product_attention") for name in off.node_strategy)
    on = autopar.plan(model, "cpu:1", args, kwargs, fuse_kernels=True)
    assert on.fusion["counts"] == {"flash_attention": 1, "rms_norm": 3, "layer_norm": 0, "linear_cross_entropy": 1}
    assert torch.isfinite(torch.tensor(on.predicted.step_time_s))


@pytest.mark.integration
def test_plan_fuses_only_the_kinds_named():
    # a program that calls flash attention and runs its norms and loss as eager ATen ops (torchtitan's eager runs)
    model = make_model("llama", num_layers=1)
    args, kwargs = make_batch("llama", batch=2, seq=8)
    plan = autopar.plan(model, "cpu:1", args, kwargs, fuse_kernels=("attention",))
    assert plan.fusion["counts"] == {"flash_attention": 1, "rms_norm": 0, "layer_norm": 0, "linear_cross_entropy": 0}
    assert plan.fusion["kinds"] == ["attention"]
    assert any(name.startswith("flash_attention") for name in plan.node_strategy)
    assert autopar.Plan.from_json(plan.to_json()).fusion == plan.fusion
    every = autopar.plan(model, "cpu:1", args, kwargs, fuse_kernels=True)
    assert "kinds" not in every.fusion


def test_fusion_kinds_read_every_form_of_the_setting():
    from autopar.errors import ConfigError
    from autopar.passes.fused_ops import FUSION_KINDS, fusion_kinds, fusion_setting

    assert fusion_kinds(True) == FUSION_KINDS and fusion_kinds(False) == ()
    assert fusion_kinds("norms") == ("norms",)
    assert fusion_kinds(["cross_entropy", "attention"]) == ("attention", "cross_entropy")  # in FUSION_KINDS order
    with pytest.raises(ConfigError, match="unknown kinds"):
        fusion_kinds(["attention", "rope"])
    assert fusion_setting({"enabled": False}) is False
    assert fusion_setting({"enabled": True, "counts": {}}) is True
    assert fusion_setting({"enabled": True, "kinds": ["attention"]}) == ("attention",)

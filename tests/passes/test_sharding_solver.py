"""Planner tests on the meta device: the solver picks what an expert would, and says why when it cannot."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError
from tests.models import make_batch, tiny_llama

GIB = 1024**3


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, hidden: int = 2048, num_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(hidden) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def _meta_mlp(hidden=2048, num_layers=2):
    with torch.device("meta"):
        return MLPStack(hidden, num_layers)


def test_megatron_mlp_with_tp_pinned():
    model = _meta_mlp()
    x = torch.randn(4, 256, 2048, device="meta")
    plan = autopar.plan(model, "8xA100-80GB", (x,), constraints={"tp": 8})
    assert plan.mesh == {"dp": 1, "tp": 8}
    pp = plan.param_placements
    for i in range(2):
        assert pp[f"layers.{i}.up.weight"] == "S(0)", "column parallel: output features split"
        assert pp[f"layers.{i}.down.weight"] == "S(1)", "row parallel: input features split"
        assert pp[f"layers.{i}.up.bias"] == "S(0)"
    # the only Partial values are the outputs of the row-parallel linears: one all-reduce per block in forward
    partial = [n for n, p in plan.node_output.items() if p == "P"]
    assert len(partial) == 2
    assert all(plan.node_strategy[n] == "row parallel" for n in partial)


def test_pure_data_parallel_for_small_model_large_batch():
    model = tiny_llama().to("meta")
    (ids,), kw = make_batch("llama", batch=256, seq=64)
    plan = autopar.plan(model, "8xA100-80GB", (ids.to("meta"),), {"labels": kw["labels"].to("meta")})
    assert plan.mesh == {"dp": 8, "tp": 1}
    assert plan.zero_stage == 0


def test_memory_budget_forces_sharded_states():
    model = _meta_mlp(hidden=2048, num_layers=4)
    x = torch.randn(8, 128, 2048, device="meta")
    free = autopar.plan(model, "8xA100-80GB", (x,), constraints={"tp": 1})
    states = sum(free.predicted.memory_breakdown[k] for k in ("params", "grads", "optimizer"))
    assert free.zero_stage == 0
    budget = 0.6 * free.predicted.peak_memory_bytes
    tight = autopar.plan(model, "8xA100-80GB", (x,), constraints={"tp": 1}, memory_budget=budget)
    assert tight.zero_stage >= 1
    assert tight.predicted.peak_memory_bytes <= budget
    tight_states = sum(tight.predicted.memory_breakdown[k] for k in ("params", "grads", "optimizer"))
    assert tight_states < states


def test_infeasible_budget_says_needed_and_available():
    model = _meta_mlp()
    x = torch.randn(8, 128, 2048, device="meta")
    with pytest.raises(InfeasiblePlanError) as info:
        autopar.plan(model, "8xA100-80GB", (x,), memory_budget="10MB")
    msg = str(info.value)
    assert "per device" in msg and "needs at least" in msg and "budget is 9.54 MiB per device" in msg


@pytest.mark.parametrize("cluster", ["6xA100-80GB", "12xH100-80GB", "cpu:3"])
def test_non_power_of_two_meshes(cluster):
    model = tiny_llama().to("meta")
    (ids,), kw = make_batch("llama", batch=12, seq=16)
    plan = autopar.plan(model, cluster, (ids.to("meta"),), {"labels": kw["labels"].to("meta")})
    assert plan.mesh["dp"] * plan.mesh["tp"] == autopar.ClusterSpec.parse(cluster).world_size
    assert len(plan.alternatives) >= 2


def test_op_without_rule_falls_back_to_replicated_with_warning():
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return torch.flip(self.lin(x), dims=[1]).sum()

    with torch.device("meta"):
        model = Flip()
    x = torch.randn(8, 16, 64, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, "2xA100-80GB", (x,), constraints={"tp": 2})
    assert any("aten.flip" in str(w.message) for w in caught)
    assert "aten.flip.default" in plan.unruled_ops
    assert "aten.flip.default" in plan.explain()


def test_identical_layers_are_solved_once():
    groups = {}
    for layers in (2, 8):
        model = tiny_llama(num_layers=layers).to("meta")
        (ids,), kw = make_batch("llama", batch=8, seq=16)
        plan = autopar.plan(model, "8xA100-80GB", (ids.to("meta"),), {"labels": kw["labels"].to("meta")},
                            constraints={"tp": 2})  # fmt: skip
        groups[layers] = plan.stats["decision_groups"]
        assert plan.stats["deduplicated_layers"] == layers - 1
    assert groups[2] == groups[8]


def test_bad_constraints_and_batch():
    model = tiny_llama().to("meta")
    (ids,), kw = make_batch("llama", batch=6, seq=16)
    args = ((ids.to("meta"),), {"labels": kw["labels"].to("meta")})
    with pytest.raises(ConfigError, match="does not divide the world size"):
        autopar.plan(model, "8xA100-80GB", *args, constraints={"tp": 3})
    with pytest.raises(ConfigError, match="does not divide over the data axis"):
        autopar.plan(model, "8xA100-80GB", *args, constraints={"dp": 4})
    with pytest.raises(ConfigError, match="unknown constraints"):
        autopar.plan(model, "8xA100-80GB", *args, constraints={"pp": 2, "tp": 2})

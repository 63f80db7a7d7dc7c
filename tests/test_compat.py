"""autopar.compat on the torch it runs on, including the paths older releases take (forced here): the same results
either way. The smoke tier (`make test-torch TORCH=2.11.0`) runs the programs on an older release itself."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from autopar import compat


@pytest.fixture(scope="module")
def one_rank_group():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:`torch.distributed.*` is deprecated:FutureWarning")  # the older names, forced
def test_collectives_take_the_older_names_where_the_new_ones_are_missing(one_rank_group, monkeypatch):
    shard = torch.arange(6.0)
    for missing in (False, True):
        if missing:  # as on torch 2.11, which has only all_gather_into_tensor / reduce_scatter_tensor
            monkeypatch.delattr(dist, "all_gather_single", raising=False)
            monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
        full = torch.empty(6)
        compat.all_gather_single(full, shard, async_op=True).wait()
        assert torch.equal(full, shard)
        piece = torch.empty(6)
        compat.reduce_scatter_single(piece, shard * 2)
        assert torch.equal(piece, shard * 2)


def test_from_local_keeps_the_gradient_in_grad_placements_on_every_path(one_rank_group, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    grads = []
    # False: the backward autopar runs where from_local lacks grad_placements (True only where torch's takes it)
    for native in sorted({False, compat._FROM_LOCAL_TAKES_GRAD_PLACEMENTS}):
        monkeypatch.setattr(compat, "_FROM_LOCAL_TAKES_GRAD_PLACEMENTS", native)
        local = torch.arange(4.0, requires_grad=True)
        dt = compat.dtensor_from_local(
            local, mesh, (Replicate(), Replicate()), grad_placements=(Partial(), Replicate())
        )
        (dt * dt).sum().backward()
        grads.append(local.grad)
    assert all(torch.equal(g, 2 * torch.arange(4.0)) for g in grads)


def _graph_with_a_no_grad_region() -> fx.GraphModule:
    """x -> (sin(x) * 2, cos(x)) computed under no_grad as 2.11's export writes it, then summed."""
    inner = fx.Graph()
    x = inner.placeholder("x")
    inner.output(
        (
            inner.call_function(torch.ops.aten.mul.Tensor, (inner.call_function(torch.sin, (x,)), 2)),
            inner.call_function(torch.cos, (x,)),
        )
    )
    root = torch.nn.Module()
    root.submod_1 = fx.GraphModule(torch.nn.Module(), inner)
    g = fx.Graph()
    y = g.placeholder("y")
    region = g.call_function(torch.ops.higher_order.wrap_with_set_grad_enabled, (False, g.get_attr("submod_1"), y))
    a, b = (g.call_function(operator.getitem, (region, i)) for i in range(2))
    g.output(g.call_function(torch.add, (a, b)))
    return fx.GraphModule(root, g)


def test_grad_mode_regions_are_inlined_to_the_same_result():
    gm = _graph_with_a_no_grad_region()
    y = torch.linspace(-1, 1, 5)
    before = gm(y)
    assert compat.inline_grad_mode_regions(gm) == 1
    assert torch.equal(gm(y), before) and torch.equal(before, torch.sin(y) * 2 + torch.cos(y))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.sin in targets and torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    assert not hasattr(gm, "submod_1") and not any(n.op == "get_attr" for n in gm.graph.nodes)
    assert compat.inline_grad_mode_regions(gm) == 0  # nothing left: a graph 2.13's export gives is left alone


def test_a_trace_records_no_node_stacks_and_leaves_the_flag_as_it_was():
    from autopar.trace import trace_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu().sum()

    before = fx.config.do_not_emit_stack_traces
    with compat.without_stack_traces():
        assert fx.config.do_not_emit_stack_traces is True
    assert fx.config.do_not_emit_stack_traces == before
    # an export outside autopar records each op's stack; autopar's trace of the same module records none
    plain = torch.export.export(Tiny(), (torch.randn(2, 4),), strict=False)
    assert any(n.meta.get("stack_trace") for n in plain.graph.nodes if n.op == "call_function")
    traced = trace_model(Tiny(), (torch.randn(2, 4),))
    ops = [n for n in traced.exported.graph.nodes if n.op == "call_function"]
    assert ops and not any(n.meta.get("stack_trace") for n in ops)
    assert fx.config.do_not_emit_stack_traces == before

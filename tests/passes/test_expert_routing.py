"""The balancing-loss passes of the expert-parallel program (`autopar.runtime.expert_routing`) on a traced graph of
Hugging Face's `load_balancing_loss_func` plus a cross-entropy: which nodes they replace, and, on a one-rank process
group (the mean over one rank is the rank's own), that the graph computes what it computed before. The mean over
several ranks is checked against one process in tests/distributed/test_expert_parallel_qwen.py."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.expert_routing import MeanOverRanks, global_label_count_pass, global_routing_counts_pass

NUM_EXPERTS, TOP_K = 4, 2


class MoeLoss(nn.Module):
    """A cross-entropy (mean, labels -100 ignored) plus Hugging Face's balancing loss over two layers' logits."""

    def forward(self, logits, labels, router_a, router_b):
        from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

        aux = load_balancing_loss_func((router_a, router_b), NUM_EXPERTS, TOP_K)
        return nn.functional.cross_entropy(logits, labels) + 0.5 * aux


def _inputs():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 8, (16,), generator=g)
    labels[::3] = -100
    routers = [torch.randn(16, NUM_EXPERTS, generator=g) for _ in range(2)]
    return torch.randn(16, 8, generator=g), labels, *routers


@pytest.fixture
def one_rank():
    with tempfile.TemporaryDirectory() as folder:  # the store's file, removed by the store itself at the end
        own = not dist.is_initialized()  # a one-rank group left by an earlier test serves as well
        if own:
            dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
        assert dist.get_world_size() == 1, "these tests need a one-rank process group"
        try:
            yield None
        finally:
            if own:
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def exported():
    return torch.export.export(MoeLoss(), _inputs(), strict=False)


def _calls(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _modules(gm) -> int:
    return sum(
        1 for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), MeanOverRanks)
    )


def test_routing_counts_pass_follows_each_count_by_the_mean(one_rank, exported):
    gm = exported.module()  # a graph module of its own
    expected = gm(*_inputs())
    counts = _calls(gm, torch.ops.aten.histc.default)
    assert counts == 2  # one per layer
    global_routing_counts_pass(gm, None, num_experts=NUM_EXPERTS, group=None, num_ranks=1)
    assert gm.meta["autopar_routing_counts"] == 2 and _modules(gm) == 2
    for node in gm.graph.nodes:  # every reader of a count reads the mean instead
        if node.op == "call_function" and node.target == torch.ops.aten.histc.default:
            assert [u.op for u in node.users] == ["call_module"]
    torch.testing.assert_close(gm(*_inputs()), expected, rtol=0, atol=0)  # one rank: its own counts, same ops


def test_routing_counts_pass_leaves_other_histograms(one_rank, exported):
    gm = exported.module()  # a graph module of its own
    global_routing_counts_pass(gm, None, num_experts=NUM_EXPERTS + 1, group=None, num_ranks=1)
    assert gm.meta["autopar_routing_counts"] == 0 and _modules(gm) == 0


def test_label_count_pass_divides_the_sum_by_the_mean_count(one_rank, exported):
    gm = exported.module()  # a graph module of its own
    expected = gm(*_inputs())
    global_label_count_pass(gm, None, group=None, num_ranks=1)
    assert gm.meta["autopar_global_label_counts"] == 1 and _modules(gm) == 1
    (ce,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.cross_entropy_loss.default]
    assert ce.args[3] == 2  # the sum, divided by the count
    # the sum over the kept labels divided by their count, against the mean: float32 rounding (~1e-7 relative)
    torch.testing.assert_close(gm(*_inputs()), expected, rtol=1e-6, atol=0)

"""Persistent buffers (BatchNorm's running statistics) travel in training checkpoints: a program that loads
one holds the saved statistics and then steps exactly as the program that saved it, for the data-parallel
and the sharded program; buffers that are not persistent (derived tables) are left out, as `state_dict`
leaves them out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.checkpoint.reader import read_index


class _Normed(nn.Module):
    """A layer, a BatchNorm (running statistics a step changes) and a non-persistent scale buffer."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(8), persistent=False)

    def forward(self, x, y):
        return (((self.out(self.bn(self.lin(x) * self.scale)) - y) ** 2).mean(),)


def _compile(constraints: dict, x, y):
    torch.manual_seed(0)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    return autopar.compile(_Normed(), "cpu:1", (x, y), constraints=constraints, optimizer=sgd)


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "constraints"), [("data-parallel", {}), ("sharded", {"zero": 1})])
def test_running_statistics_survive_a_checkpoint(tmp_path, kind, constraints):
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    saving = _compile(constraints, x, y)
    assert str(saving.plan.program) == kind
    for _ in range(3):
        saving.train_step(x, y)
    saving.save_checkpoint(tmp_path / "ckpt")
    keys = set(read_index(tmp_path / "ckpt").state_dict_metadata)
    assert {"buffer.bn.running_mean", "buffer.bn.running_var", "buffer.bn.num_batches_tracked"} <= keys
    assert "buffer.scale" not in keys

    saved = saving.state_dict()
    loading = _compile(constraints, x, y)
    loading.load_checkpoint(tmp_path / "ckpt")
    ours = loading.state_dict()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(ours[name], saved[name]), name
    fresh = _compile(constraints, x, y)
    saving.eval(), loading.eval(), fresh.eval()
    # one eval step each, the same on both sides: these programs' eval graphs still run BatchNorm in training
    # mode (batch statistics, running statistics updated), so the statistics move alike on both
    evaluated = saving.eval_step(x, y)
    assert fresh.eval_step(x, y) != evaluated, "a program that loaded nothing agrees: the comparison shows nothing"
    assert loading.eval_step(x, y) == evaluated  # the same program on the same values: the same bits
    saving.train(), loading.train()
    assert loading.train_step(x, y) == saving.train_step(x, y)
    assert torch.equal(loading.state_dict()["bn.running_mean"], saving.state_dict()["bn.running_mean"])

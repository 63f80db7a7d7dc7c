"""compile() checks its launch, and one rank runs DDP's layout as the plain data-parallel program."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import LoweringError
from tests.distributed.harness import run_distributed
from tests.distributed.test_train_numerics import _optimizer, _reference
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed


def _compile_for_four(rank: int, world_size: int):
    args, kwargs = make_batch("llama")
    try:
        autopar.compile(make_model("llama"), "cpu:4", args, kwargs)
    except LoweringError as e:
        return str(e)
    return None


def test_world_size_that_does_not_match_the_cluster():
    messages = run_distributed(_compile_for_four, 2)
    for msg in messages:
        assert msg is not None and "2 ranks" in msg and "4" in msg, msg


def _one_rank(rank: int, world_size: int):
    args, kwargs = make_batch("llama")
    pm = autopar.compile(make_model("llama"), "cpu:1", args, kwargs, optimizer=_optimizer)
    losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
    with torch.no_grad():
        logits = pm(*args).logits
    return {"program": str(pm.plan.program), "losses": losses, "state": pm.state_dict(), "logits": logits}


def test_one_rank_matches_the_model():
    got = run_distributed(_one_rank, 1)[0]
    assert got["program"] == "data-parallel"
    losses, state = _reference("llama")
    model = make_model("llama")
    model.load_state_dict(state)
    args, _ = make_batch("llama")
    # One rank, one micro-batch: the exported graph runs the model's ops, but the loss is a sum divided
    # afterwards, so gradients differ by rounding (~1e-7 relative). AdamW normalises each gradient by
    # its RMS, which turns rounding of near-zero gradients into update differences: 1e-4 per element
    # (1% of lr; seen up to 1.5e-5), as in test_train_numerics. A wrong gradient moves elements by ~lr.
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["state"][k], v, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(*args).logits, atol=1e-4, rtol=1e-4)

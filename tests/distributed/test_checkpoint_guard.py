"""The step guard in a training checkpoint (`autopar.checkpoint.training`): the count of skipped steps is saved
and restored, and a save or load while `train_step(..., accumulate=True)` calls wait for their step is refused
with nothing written or changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed


def _compile(world: int):
    args, kwargs = make_batch("llama")
    pm = autopar.compile(
        make_model("llama"), f"cpu:{world}", args, kwargs, constraints={"dp": 2, "tp": 1}, on_nonfinite="skip"
    )
    return pm, args, kwargs


def _skip_one_step(pm, args, kwargs) -> None:
    """A step whose loss is not finite (one weight set to inf, then put back): skipped and counted."""
    first = next(iter(pm.parameters()))
    saved = first.detach().clone()
    with torch.no_grad():
        first.view(-1)[0] = float("inf")
    pm.train_step(*args, **kwargs)
    with torch.no_grad():
        first.copy_(saved)


def _refused(pm, call) -> tuple[str | None, bool]:
    """(the ConfigError `call` raised, or None; whether the program's state is as it was)."""
    before = pm.state_dict()
    try:
        call()
        message = None
    except autopar.ConfigError as e:
        message = str(e)
    return message, all(torch.equal(before[k], v) for k, v in pm.state_dict().items())


def _save_and_resume(rank: int, world: int, root: str):
    pm, args, kwargs = _compile(world)
    pm.train_step(*args, **kwargs)
    _skip_one_step(pm, args, kwargs)
    out = {"skipped": pm.last_step.skipped, "skipped_steps": pm.last_step.skipped_steps}
    pm.train_step(*args, accumulate=True, **kwargs)
    out["save"] = _refused(pm, lambda: pm.save_checkpoint(f"{root}/pending"))
    out["pending written"] = any(p.name.startswith("pending") for p in Path(root).iterdir())
    pm.train_step(*args, **kwargs)  # the step over the accumulated call and this one
    pm.save_checkpoint(f"{root}/step")
    pm.train_step(*args, accumulate=True, **kwargs)
    out["load"] = _refused(pm, lambda: pm.load_checkpoint(f"{root}/step"))

    fresh, args, kwargs = _compile(world)
    fresh.load_checkpoint(f"{root}/step")
    fresh.train_step(*args, **kwargs)
    out["resumed"] = {"num_steps": fresh.num_steps, "skipped_steps": fresh.last_step.skipped_steps}
    return out


def test_a_checkpoint_keeps_skipped_steps_and_refuses_pending_accumulation(tmp_path):
    runs = run_distributed(_save_and_resume, 2, str(tmp_path))
    for r, got in enumerate(runs):
        assert got["skipped"] and got["skipped_steps"] == 1, (r, got)
        for name in ("save", "load"):
            message, unchanged = got[name]
            assert message and "accumulate=True" in message and "not part of a checkpoint" in message, (r, message)
            assert unchanged, (r, name)
        assert not got["pending written"], r
        # steps 1 (trained), 2 (skipped), 3 (the accumulated call and the next one) saved; the resumed step is 4,
        # and the skipped one is still counted
        assert got["resumed"] == {"num_steps": 4, "skipped_steps": 1}, (r, got["resumed"])

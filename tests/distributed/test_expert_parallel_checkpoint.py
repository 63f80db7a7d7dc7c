"""Checkpoints and Hugging Face weights of the expert-parallel program: a tiny Mixtral on two gloo ranks (ep=2, each
rank holding 2 of the 4 experts of each layer) trains two steps, saves a checkpoint, trains two more and writes
`save_pretrained`. A fresh program of other initial weights loads the checkpoint and its next two steps give the
losses and weights of the uninterrupted run (the experts' blocks and their optimizer states read back on the ranks
that hold them); transformers' `from_pretrained` reads the weights written into one process, equal to the trained
ones. SGD with momentum, and AdamW (its moments of the experts round-trip too); the AdamW checkpoint is read by the
data-parallel program as well (every rank holding every expert), which resumes with the same losses. A Qwen2-MoE
(shared expert, balancing loss in the loss) round-trips the same way with SGD."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import autopar
from autopar.checkpoint.reader import read_index
from autopar.plan import Plan
from tests.distributed.harness import run_distributed
from tests.distributed.test_expert_parallel import _optimizer
from tests.distributed.test_expert_parallel_qwen import tiny_qwen2_moe
from tests.distributed.test_train_numerics import PARAM_ATOL, PARAM_MEAN_ATOL
from tests.families import family_batch, make_family
from tests.models import train_locally

pytestmark = pytest.mark.distributed

STEPS = 2
# The same program on the same layout runs the same operations in the same order before and after the load, so the
# losses agree to the last bit in practice (as in tests/distributed/test_checkpoint.py); an expert block or a
# moment read into the wrong rank moves the next loss by ~lr times a gradient, far more.
RESUME_RTOL = 1e-6
# Another program sums in another order (each expert's tokens on one rank, not dispatched): ~1e-7 relative per step
# in fp32 (tests/distributed/test_checkpoint.py's RESHARD_RTOL); an expert block read into the wrong experts moves
# the loss by far more.
RESHARD_RTOL = 1e-5
# The written weights against one process trained the same way: the ranks sum in another order (~1e-7 relative per
# step in fp32; tests/distributed/test_expert_parallel.py), relative to max(|reference|, 1e-2).
PARAM_RTOL, PARAM_FLOOR = 1e-4, 1e-2


def _model(family: str, seed: int) -> torch.nn.Module:
    if family == "qwen2_moe":
        return tiny_qwen2_moe(seed=seed)  # with the balancing loss in its loss
    return make_family("mixtral", seed=seed)


def _compile(world: int, plan_json: str, opt: str, seed: int, family: str):
    args, kwargs = family_batch("mixtral")
    pm = autopar.compile(
        _model(family, seed),
        f"cpu:{world}",
        args,
        kwargs,
        optimizer=_optimizer(opt),
        plan=Plan.from_json(plan_json),
    )
    assert str(pm.plan.program) == "expert-parallel"
    return pm, args, kwargs


def _first(rank: int, world: int, root: str, plan_json: str, optimizers: list[str], family: str) -> dict:
    """Per optimizer: 2 steps, a checkpoint, 2 steps, the Hugging Face weights."""
    del rank
    out = {}
    for opt in optimizers:
        pm, args, kwargs = _compile(world, plan_json, opt, seed=0, family=family)
        straight = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
        pm.save_checkpoint(f"{root}/{opt}/step{STEPS}", extra={"opt": opt})
        straight += [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
        pm.save_pretrained(f"{root}/{opt}/hf", max_shard_size="100KB")  # several files: experts cut across them
        out[opt] = {"straight": straight, "state": pm.state_dict()}
    return out


def _resume(rank: int, world: int, root: str, plan_json: str, optimizers: list[str], family: str) -> dict:
    del rank
    out = {}
    for opt in optimizers:
        pm, args, kwargs = _compile(
            world, plan_json, opt, seed=7, family=family
        )  # other initial weights: the load replaces them
        extra = pm.load_checkpoint(autopar.latest_checkpoint(f"{root}/{opt}"))
        losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
        out[opt] = {"extra": extra, "step": pm.num_steps - STEPS, "losses": losses, "state": pm.state_dict()}
    return out


def _resume_data_parallel(rank: int, world: int, root: str, opt: str) -> dict:
    """The ep checkpoint read by the data-parallel program (every rank holding every expert)."""
    del rank
    args, kwargs = family_batch("mixtral")
    model = make_family("mixtral", seed=7)
    pm = autopar.compile(model, f"cpu:{world}", args, kwargs, optimizer=_optimizer(opt), constraints={"dp": world})
    pm.load_checkpoint(autopar.latest_checkpoint(f"{root}/{opt}"))
    return {"program": str(pm.plan.program), "losses": [pm.train_step(*args, **kwargs) for _ in range(STEPS)]}


def _plan_json(family: str, world: int) -> str:
    args, kwargs = family_batch("mixtral")
    plan = autopar.plan(_model(family, 0), f"cpu:{world}", args, kwargs, constraints={"ep": 2}, alternatives=False)
    assert plan.program == "expert-parallel"
    return plan.to_json()


def _check(tmp_path, optimizers: list[str], family: str = "mixtral", world: int = 2) -> dict[str, list[float]]:
    """Run and check the above; the uninterrupted run's losses by optimizer."""
    args, kwargs = family_batch("mixtral")
    plan_json = _plan_json(family, world)
    first = run_distributed(_first, world, str(tmp_path), plan_json, optimizers, family, timeout_s=600)
    resumed = run_distributed(_resume, world, str(tmp_path), plan_json, optimizers, family, timeout_s=600)
    for opt in optimizers:  # each expert weight stored as its ep blocks of experts, each once
        index = read_index(tmp_path / opt / f"step{STEPS}").state_dict_metadata
        expert = index["model.model.layers.0.mlp.experts.down_proj"]
        assert sorted(tuple(c.offsets)[0] for c in expert.chunks) == [0, expert.size[0] // 2], expert.chunks
    for opt in optimizers:
        straight, trained = first[0][opt]["straight"], first[0][opt]["state"]
        for r in range(world):
            got = resumed[r][opt]
            assert got["extra"] == {"opt": opt} and got["step"] == STEPS
            assert got["losses"] == pytest.approx(straight[STEPS:], rel=RESUME_RTOL), (opt, r, got["losses"], straight)
            for key, ref in trained.items():
                torch.testing.assert_close(got["state"][key], ref, rtol=RESUME_RTOL, atol=0, msg=key)
        # the Hugging Face weights: what the program trained, read by transformers into one process
        files = sorted(p.name for p in (tmp_path / opt / "hf").glob("*.safetensors"))
        assert len(files) > 1, files
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / opt / "hf")
        assert type(loaded).__name__ == type(_model(family, 0)).__name__
        state = loaded.state_dict()
        assert set(state) == set(trained)
        for key, value in trained.items():
            assert torch.equal(state[key], value), key  # written as held: no arithmetic between
        model = _model(family, 0)
        _, ref_state = train_locally(model, args, kwargs, _optimizer(opt)(model.parameters()), 2 * STEPS)
        for key, ref in ref_state.items():
            if opt == "adamw":  # AdamW's bounds and their reason: tests/distributed/test_train_numerics.py
                torch.testing.assert_close(state[key], ref, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=key)
                assert (state[key] - ref).abs().mean().item() <= PARAM_MEAN_ATOL, key
                continue
            err = ((state[key] - ref).abs() / ref.abs().clamp_min(PARAM_FLOOR)).max().item()
            assert err <= PARAM_RTOL, (opt, key, err)
    return {opt: first[0][opt]["straight"] for opt in optimizers}


# in `make test` (the issue asks for the smallest form there): 4.8 s after the other ep tests warmed the pool of two
# ranks, 15 s as the first test of a run (2 cores, load ~7); AdamW and the data-parallel reload are slow
def test_expert_parallel_checkpoint_resumes_and_exports(tmp_path):
    _check(tmp_path, ["sgd"])


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_adamw(tmp_path):
    straight = _check(tmp_path, ["adamw"])["adamw"]
    # the same checkpoint in the data-parallel program: the experts' blocks and moments assembled whole
    runs = run_distributed(_resume_data_parallel, 2, str(tmp_path), "adamw", timeout_s=600)
    for run in runs:
        assert run["program"] == "data-parallel"
        assert run["losses"] == pytest.approx(straight[STEPS:], rel=RESHARD_RTOL), (run["losses"], straight)


@pytest.mark.slow
def test_qwen2_moe_checkpoint_resumes_and_exports(tmp_path):
    _check(tmp_path, ["sgd"], family="qwen2_moe")  # its shared expert, gate and balancing loss beside the experts


@pytest.mark.slow
def test_expert_parallel_checkpoint_of_two_expert_groups(tmp_path):
    # four ranks, two ep groups: each block of experts held by two ranks (the mesh's replica dim), written once
    _check(tmp_path, ["sgd"], world=4)

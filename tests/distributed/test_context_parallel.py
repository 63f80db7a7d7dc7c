"""Numerics: a pinned cp axis trains tiny LLaMA and GPT-2 on 2 and 4 gloo ranks to the single-process losses and
weights.

Each case compiles with constraints {"cp": ..., "cp_attention": ...}, runs one eval_step (forward only) and two
train_steps on the batch of `tests.models.make_batch` (half the rows with their second half of labels ignored,
so ranks hold different numbers of kept labels and the loss must divide by the global count), and compares
with the same model trained in one process.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import for_this_run, run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
# fp32 on CPU: the cp algorithms sum attention over key blocks and the loss and gradients over ranks in
# another order than one process does, so losses agree to rounding (~1e-6 relative); 1e-4 is the bound
# and a wrong position, label shift or mask moves the loss by far more (percents on this tiny model).
LOSS_RTOL = 1e-4
# State after two steps at lr=1e-2, each tensor's largest difference relative to max(|reference|, FLOOR):
# with SGD (momentum 0.9) rounding-level gradient differences move weights by ~1e-8 relative, while a missing
# cp reduction halves a gradient, moving weights by ~1e-3 of their size. AdamW turns near-zero gradient noise
# into ±lr steps on single elements (see test_train_numerics.py), hence its bound of a tenth of lr.
SGD_RTOL = 1e-5
ADAM_RTOL, ADAM_EPS = 1e-3, 1e-6
FLOOR = 1e-2  # never compare relative to a tensor that may be all zeros


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}


def _cases(rank: int, world_size: int, cases):
    out = []
    for constraints, opt, *family in cases:
        model = make_model(*family or ["llama"])
        args, kwargs = make_batch(*family or ["llama"], batch=4, seq=16)
        pm = autopar.compile(
            model, f"cpu:{world_size}", args, kwargs, optimizer=OPTIMIZERS[opt], constraints=constraints
        )
        evaluated = pm.eval_step(*args, **kwargs)  # forward only, across the cp group
        losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
        state = pm.state_dict()
        out.append(
            {
                "losses": losses,
                "state": state if rank == 0 else None,
                "mesh": dict(pm.plan.mesh),
                "program": str(pm.plan.program),
                "cp": dict(pm.plan.context_parallel),
                "zero": pm.plan.zero_stage,
                "eval": evaluated,
            }
        )
    return out


def _reference(opt: str, family: str = "llama"):
    model = make_model(family)
    args, kwargs = make_batch(family, batch=4, seq=16)
    return train_locally(model, args, kwargs, OPTIMIZERS[opt](model.parameters()), 2)


def _check(world_size: int, cases) -> None:
    results = run_distributed(_cases, world_size, cases, timeout_s=900)
    for i, (constraints, opt, *family) in enumerate(cases):
        ref_losses, ref_state = _reference(opt, *family)
        got = results[0][i]
        for r in range(world_size):
            assert results[r][i]["losses"] == pytest.approx(got["losses"], rel=1e-6)
        assert got["mesh"]["cp"] == constraints["cp"]
        assert all(got["mesh"][k] == v for k, v in constraints.items() if k in ("dp", "tp"))
        assert got["zero"] == constraints.get("zero", got["zero"])
        assert got["program"] == "sharded"
        assert got["cp"]["algorithm"] == constraints["cp_attention"]
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (constraints, opt)
        # eval_step before training is the untrained model's loss: the first training loss, no gradient taken
        assert got["eval"] == pytest.approx(ref_losses[0], rel=LOSS_RTOL), (constraints, opt)
        assert all(results[r][i]["eval"] == got["eval"] for r in range(world_size))
        rtol = SGD_RTOL if opt == "sgd" else ADAM_RTOL
        assert set(got["state"]) == set(ref_state)
        for name, ref in ref_state.items():
            rel = ((got["state"][name] - ref).abs().max() / max(ref.abs().max().item(), FLOOR)).item()
            assert rel <= rtol, (constraints, opt, name, rel)


# a minute or more each on two cores: all-gather in `make test`, the others with `make test-all`
@pytest.mark.parametrize(
    "algorithm",
    ["allgather", pytest.param("ring", marks=pytest.mark.slow), pytest.param("alltoall", marks=pytest.mark.slow)],
)
def test_cp2_on_two_ranks_matches_one_process(algorithm):
    _check(2, [({"cp": 2, "cp_attention": algorithm}, "sgd")])


@pytest.mark.slow
def test_cp2_adamw_on_two_ranks_matches_one_process():
    _check(2, [({"cp": 2, "cp_attention": "ring"}, "adamw")])


@pytest.mark.slow
def test_cp2_times_dp2_on_four_ranks_matches_one_process():
    _check(
        4,
        [
            ({"cp": 2, "dp": 2, "tp": 1, "cp_attention": "allgather"}, "sgd"),
            ({"cp": 2, "dp": 2, "tp": 1, "cp_attention": "alltoall"}, "sgd"),
        ],
    )


@pytest.mark.slow
def test_cp2_gpt2_and_zero3_on_two_ranks_match_one_process():
    # GPT-2: learned absolute positions, which must be the global ones on every chunk; ZeRO-3 with cp: states
    # sharded over the dp·cp data axis (here the two cp ranks)
    _check(
        2,
        [
            ({"cp": 2, "cp_attention": "ring"}, "sgd", "gpt2"),
            ({"cp": 2, "cp_attention": "allgather", "zero": 3}, "adamw"),
        ],
    )


@pytest.mark.slow
def test_cp2_times_tp2_on_four_ranks_matches_one_process():
    _check(
        4,
        [
            ({"cp": 2, "dp": 1, "tp": 2, "cp_attention": "ring", "zero": 0}, "sgd"),
            ({"cp": 2, "dp": 1, "tp": 2, "cp_attention": "alltoall", "zero": 3}, "sgd"),
            ({"cp": 2, "dp": 1, "tp": 2, "cp_attention": "allgather"}, "sgd", "gpt2"),
        ],
    )


def _searched_case(rank: int, world_size: int):
    import autopar.cp_search

    # the tiny model's sequence is far below the chunk a GPU search needs; the search itself is what is tested
    for_this_run(autopar.cp_search, "MIN_CP_CHUNK_TOKENS", 8)
    model = make_model("llama")
    args, kwargs = make_batch("llama", batch=1, seq=32)
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=_sgd, constraints={"tp": 1})
    losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
    state = pm.state_dict()  # a collective: every rank takes part
    return {
        "losses": losses,
        "state": state if rank == 0 else None,
        "mesh": dict(pm.plan.mesh),
        "search": pm.plan.context_parallel.get("search"),
    }


def test_compile_without_a_cp_pin_searches_the_degree_and_trains():
    # one sequence on two ranks with tp pinned to 1: no data axis can take it, so only cp=2 uses both ranks
    results = run_distributed(_searched_case, 2, timeout_s=900)
    got = results[0]
    assert got["mesh"] == {"dp": 1, "cp": 2, "tp": 1}
    search = {r["degree"]: r for r in got["search"]}
    assert not search[1]["feasible"] and "does not divide over the data axis" in search[1]["reason"]
    assert search[2]["feasible"]
    model = make_model("llama")
    args, kwargs = make_batch("llama", batch=1, seq=32)
    ref_losses, ref_state = train_locally(model, args, kwargs, _sgd(model.parameters()), 2)
    assert results[1]["losses"] == pytest.approx(got["losses"], rel=1e-6)
    assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    for name, ref in ref_state.items():
        rel = ((got["state"][name] - ref).abs().max() / max(ref.abs().max().item(), FLOOR)).item()
        assert rel <= SGD_RTOL, (name, rel)

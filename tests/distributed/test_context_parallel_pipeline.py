"""Numerics: a cp axis together with a pipeline (pp=2 x cp=2 on 4 gloo ranks, with dp=2 or tp=2 on 8) trains to the
single-process losses and weights.

Each case compiles with constraints {"pp": 2, "cp": 2, ...} and two or more micro-batches, runs one eval_step
(forward only, through both stages and across the cp groups) and two train_steps on the batch of
`tests.models.make_batch` (half the rows with their second half of labels ignored, so micro-batches and cp ranks
hold different numbers of kept labels and the loss must divide by the global count), and compares with the same
model trained in one process. GPT-2 ties its token embedding to its LM head, which sit on different stages.
"""

from __future__ import annotations

import pytest

import autopar
from tests.distributed.harness import for_this_run, run_distributed
from tests.distributed.test_context_parallel import ADAM_RTOL, FLOOR, LOSS_RTOL, OPTIMIZERS, SGD_RTOL, _sgd
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

# The tolerances and optimizers of the cp cases without a pipeline, for the same reasons: losses agree to rounding
# (~1e-7 relative measured here), while a wrong label shift, position or loss weight moves the loss by percents,
# and a gradient missing its cp or tie reduction moves weights by ~1e-3 of their size.
BATCH, SEQ = 4, 16


def _run(rank: int, world_size: int, model_name: str, constraints: dict, opt: str, layers: int) -> dict:
    model = make_model(model_name, num_layers=layers)
    args, kwargs = make_batch(model_name, batch=BATCH, seq=SEQ)
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=OPTIMIZERS[opt], constraints=constraints)
    evaluated = pm.eval_step(*args, **kwargs)
    losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
    state = pm.state_dict()  # a collective: every rank takes part
    return {
        "losses": losses,
        "eval": evaluated,
        "state": state if rank == 0 else None,
        "mesh": dict(pm.plan.mesh),
        "program": str(pm.plan.program),
        "algorithm": pm.plan.context_parallel.get("algorithm"),
        "schedule": pm.plan.pipeline.get("schedule"),
        "num_microbatches": pm.plan.num_microbatches,
    }


def _check(model_name: str, constraints: dict, opt: str, *, world: int = 4, layers: int = 2) -> None:
    results = run_distributed(_run, world, model_name, constraints, opt, layers, timeout_s=900)
    got = results[0]
    dp, tp = constraints.get("dp", 1), constraints.get("tp", 1)
    assert got["mesh"] == {"pp": 2, "dp": dp, "cp": 2, "tp": tp}
    assert got["program"] == "pipeline"
    assert got["algorithm"] == constraints["cp_attention"]
    assert got["schedule"] == constraints.get("schedule", "1f1b")
    assert got["num_microbatches"] == constraints["num_microbatches"] >= 2
    for r in range(world):  # every rank returns the loss of the whole batch
        assert results[r]["losses"] == pytest.approx(got["losses"], rel=1e-6)
        assert results[r]["eval"] == pytest.approx(got["eval"], rel=1e-6)
    model = make_model(model_name, num_layers=layers)
    args, kwargs = make_batch(model_name, batch=BATCH, seq=SEQ)
    ref_losses, ref_state = train_locally(model, args, kwargs, OPTIMIZERS[opt](model.parameters()), 2)
    assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    # eval_step before training is the untrained model's loss: the first training loss, no gradient taken
    assert got["eval"] == pytest.approx(ref_losses[0], rel=LOSS_RTOL)
    assert set(got["state"]) == set(ref_state)
    rtol = SGD_RTOL if opt == "sgd" else ADAM_RTOL
    for name, ref in ref_state.items():
        rel = ((got["state"][name] - ref).abs().max() / max(ref.abs().max().item(), FLOOR)).item()
        assert rel <= rtol, (name, rel)


@pytest.mark.slow
def test_pp2_cp2_1f1b_llama_matches_one_process():
    _check("llama", {"pp": 2, "cp": 2, "num_microbatches": 2, "cp_attention": "allgather"}, "sgd")


@pytest.mark.slow
def test_pp2_cp2_gpipe_llama_adamw_matches_one_process():
    _check("llama", {"pp": 2, "cp": 2, "num_microbatches": 2, "schedule": "gpipe", "cp_attention": "ring"}, "adamw")


@pytest.mark.slow
def test_pp2_cp2_gpt2_tied_embeddings_match_one_process():
    _check("gpt2", {"pp": 2, "cp": 2, "num_microbatches": 2, "cp_attention": "alltoall"}, "sgd")


@pytest.mark.slow
def test_pp2_cp2_interleaved_llama_matches_one_process():
    # four layers: two chunks of one layer on each of the two stage blocks
    _check(
        "llama",
        {
            "pp": 2,
            "cp": 2,
            "num_microbatches": 2,
            "schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "cp_attention": "ring",
        },
        "sgd",
        layers=4,
    )


@pytest.mark.slow  # eight ranks on two cores: a minute each
@pytest.mark.parametrize("axes", [{"dp": 2, "tp": 1}, {"dp": 1, "tp": 2}], ids=["dp2", "tp2"])
def test_pp2_cp2_with_a_data_or_tensor_axis_on_eight_ranks_matches_one_process(axes):
    # dp=2: the stage block's data axis is dp·cp = 4 ranks (ranks ordered dp, then cp) whose gradients are reduced
    # together; tp=2: the cp groups are strided by the tensor axis inside each block
    _check("llama", {"pp": 2, "cp": 2, "num_microbatches": 2, "cp_attention": "allgather"} | axes, "sgd", world=8)


def _searched(rank: int, world_size: int) -> dict:
    import autopar.cp_search

    # the tiny model's sequence is far below the chunk a GPU search needs; the search itself is what is tested
    for_this_run(autopar.cp_search, "MIN_CP_CHUNK_TOKENS", 8)
    model = make_model("llama")
    args, kwargs = make_batch("llama", batch=1, seq=32)
    pm = autopar.compile(model, f"cpu:{world_size}", args, kwargs, optimizer=_sgd, constraints={"pp": 2, "tp": 1})
    losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
    state = pm.state_dict()
    return {
        "losses": losses,
        "state": state if rank == 0 else None,
        "mesh": dict(pm.plan.mesh),
        "search": pm.plan.context_parallel.get("search"),
    }


@pytest.mark.slow
def test_compile_with_a_pipeline_pinned_searches_the_cp_degree_and_trains():
    # one sequence, two stages of two ranks, tp pinned to 1: no data axis can take the sequence, so only cp=2
    # uses each stage's two ranks
    results = run_distributed(_searched, 4, timeout_s=900)
    got = results[0]
    assert got["mesh"] == {"pp": 2, "dp": 1, "cp": 2, "tp": 1}
    search = {r["degree"]: r for r in got["search"]}
    assert not search[1]["feasible"] and search[2]["feasible"]
    model = make_model("llama")
    args, kwargs = make_batch("llama", batch=1, seq=32)
    ref_losses, ref_state = train_locally(model, args, kwargs, _sgd(model.parameters()), 2)
    assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    for name, ref in ref_state.items():
        rel = ((got["state"][name] - ref).abs().max() / max(ref.abs().max().item(), FLOOR)).item()
        assert rel <= SGD_RTOL, (name, rel)

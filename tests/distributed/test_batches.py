"""Batches: ranks that pass different global batches get an error at the first step; with `local_batch=True`
each data-parallel rank passes its own rows (from `Program.data_loader`, or split any other way) and the step
equals one over the union of the rows."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
# SGD with momentum: the programs and one process differ by summation order only (rounding only); rows
# trained twice or never move most elements by about lr * |g|, above 1e-4
PARAM_ATOL = 1e-6


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _dataset(rows: int = 32, seq: int = 16):
    """Token ids and labels with uneven padding (each row keeps a different number of labels)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (rows, seq), generator=g)
    labels = ids.clone()
    for r in range(rows):
        labels[r, 4 + (r * 5) % (seq - 4) :] = -100
    return torch.utils.data.TensorDataset(ids, labels)


def _mismatch(rank: int, world_size: int, constraints, local: bool):
    args, kwargs = make_batch("llama")
    pm = autopar.compile(
        make_model("llama"), f"cpu:{world_size}", args, kwargs, constraints=constraints, local_batch=local
    )
    rows = pm.local_batch_size
    theirs = make_batch("llama", seed=10 + rank)  # another batch on every rank
    try:
        pm.train_step(theirs[0][0][:rows], labels=theirs[1]["labels"][:rows])
    except autopar.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("constraints", "local"),
    [({"dp": 2, "tp": 1}, False), ({"tp": 2}, False), ({"tp": 2}, True)],
    ids=["data-parallel", "sharded", "tp-group-local"],
)
def test_ranks_passing_different_batches_get_an_error_at_the_first_step(constraints, local):
    for message in run_distributed(_mismatch, 2, constraints, local):
        assert message is not None and "different batches at the first step" in message, message


def _fed(rank: int, world_size: int, constraints, mode: str, steps: int):
    """Train `steps` steps from the loader; mode: "global" (the global batch everywhere), "loader" (local rows
    from Program.data_loader) or "split" (local rows: each data-parallel rank a contiguous half of the global
    batch, as a DistributedSampler over batches would give)."""
    dataset = _dataset()
    args, kwargs = make_batch("llama")
    pm = autopar.compile(
        make_model("llama"),
        f"cpu:{world_size}",
        args,
        kwargs,
        optimizer=_sgd,
        constraints=constraints,
        local_batch=mode != "global",
    )
    seen = []
    if mode == "split":
        global_loader = torch.utils.data.DataLoader(dataset, batch_size=pm.plan.global_batch_size)
        for ids, labels in list(global_loader)[:steps]:
            share = ids.shape[0] // pm.data_parallel_size
            lo = pm.data_parallel_rank * share
            pm.train_step(ids[lo : lo + share], labels=labels[lo : lo + share])
    else:
        for ids, labels in list(pm.data_loader(dataset, shuffle=True, seed=5))[:steps]:
            seen.append(ids.shape[0])
            pm.train_step(ids, labels=labels)
    state = pm.state_dict()
    return {"state": state if rank == 0 else None, "rows": seen, "dp_rank": pm.data_parallel_rank}


def _reference(batches) -> dict:
    model = make_model("llama")
    opt = _sgd(model.parameters())
    for ids, labels in batches:
        opt.zero_grad()
        model(ids, labels=labels).loss.backward()
        opt.step()
    return model.state_dict()


def _global_batches(batch: int, steps: int, shuffle: bool):
    """The global batches the programs train on: PlanSampler's order (seed 5) or the dataset's."""
    dataset = _dataset()
    if shuffle:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(5))
    else:
        order = torch.arange(len(dataset))
    return [dataset[order[s * batch : (s + 1) * batch]] for s in range(steps)]


# each case spawns three runs: the data-parallel one in the quick tier, the others with the slow tests
CASES_2 = [
    pytest.param({"dp": 2, "tp": 1}, id="data-parallel"),
    pytest.param({"dp": 2, "tp": 1, "zero": 1, "num_microbatches": 2}, id="sharded-zero1-mb2", marks=pytest.mark.slow),
    pytest.param({"pp": 2, "num_microbatches": 2}, id="pipeline", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("constraints", CASES_2)
def test_local_rows_train_as_the_global_batch(constraints):
    steps = 2
    runs = {mode: run_distributed(_fed, 2, constraints, mode, steps) for mode in ("global", "loader", "split")}
    batch = 8
    ref_shuffled = _reference(_global_batches(batch, steps, shuffle=True))
    ref_plain = _reference(_global_batches(batch, steps, shuffle=False))
    dp = constraints.get("dp", 1)
    assert runs["loader"][0]["rows"] == [batch // dp] * steps and runs["global"][0]["rows"] == [batch] * steps
    assert sorted(r["dp_rank"] for r in runs["loader"]) == sorted(range(dp)) * (2 // dp)
    for mode, ref in (("global", ref_shuffled), ("loader", ref_shuffled), ("split", ref_plain)):
        got = runs[mode][0]["state"]
        for key, value in ref.items():
            torch.testing.assert_close(
                got[key], value, atol=PARAM_ATOL, rtol=0, msg=lambda m, k=key, c=mode: f"{c} {k}: {m}"
            )
    # the loader gives the plan's rows of the same global batches: the same step as the global batch, bit for bit
    # where the program's sums run in the same order
    assert all(torch.equal(runs["loader"][0]["state"][k], runs["global"][0]["state"][k]) for k in ref_shuffled)


@pytest.mark.slow
def test_local_rows_on_a_tp_dp_mesh_are_shared_by_the_tp_group():
    """tp x dp = 2 x 2: the two tp ranks of each data-parallel group pass the same rows."""
    constraints = {"dp": 2, "tp": 2}
    runs = run_distributed(_fed, 4, constraints, "loader", 2)
    assert [r["dp_rank"] for r in runs] == [0, 0, 1, 1]
    ref = _reference(_global_batches(8, 2, shuffle=True))
    for key, value in ref.items():
        torch.testing.assert_close(runs[0]["state"][key], value, atol=PARAM_ATOL, rtol=0)

"""Training checkpoints on gloo ranks: resuming in a new process group gives the losses of an uninterrupted
run for every program kind, with SGD (momentum) and AdamW; a checkpoint of one layout on 4 ranks resumes on
2 ranks in another; a save cut short is skipped; retention keeps the newest; a save or load that fails on one
rank fails on every rank at once and changes nothing."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import autopar
from autopar.checkpoint.lock import LOCK
from autopar.checkpoint.training import MARKER
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

LR = 1e-2
# The same program on the same layout runs the same operations in the same order before and after a
# resume, so the losses agree to the last bit in practice; the issue asks for a relative error below 1e-6.
RESUME_RTOL = 1e-6
# Another layout sums in another order (rows over other ranks, matmuls split over tp, micro-batches):
# ~1e-7 relative per step in fp32; a moment or master read into the wrong place moves a loss by far more.
RESHARD_RTOL = 1e-5
CASES = {
    "data-parallel": ({"dp": 2, "tp": 1}, None),
    "sharded": ({"tp": 2}, None),
    "pipeline": ({"pp": 2, "num_microbatches": 2}, None),
    "offload": ({"tp": 1}, True),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}


def _runs():
    # the offload program runs AdamW over its chunks only
    return [(kind, opt) for kind in CASES for opt in OPTIMIZERS if not (kind == "offload" and opt == "sgd")]


# `make test` resumes these (a DTensor program with AdamW's moments, a pipeline with SGD's momentum and the save
# cut short); `make test-all` the others too
RESUME_FAST = [("sharded", "adamw"), ("pipeline", "sgd")]


def _compile(world: int, kind: str, opt: str, seed: int = 0, constraints=None, offload=None):
    args, kwargs = make_batch("llama")
    c, off = CASES[kind] if constraints is None else (constraints, offload)
    pm = autopar.compile(
        make_model("llama", seed=seed),
        f"cpu:{world}",
        args,
        kwargs,
        optimizer=OPTIMIZERS[opt],
        constraints=c,
        offload=off,
    )
    return pm, args, kwargs


def _first(rank: int, world: int, root: str, runs: list):
    """Per run: 6 steps straight, saving after each of the first 3 (keep_last=2); RNG draws after the last save.

    The saves sit inside the straight run (one compile per run instead of two): a save that changed the
    program's state would show as a resumed run that differs from this one."""
    out = {}
    for kind, opt in runs:
        pm, args, kwargs = _compile(world, kind, opt)
        assert str(pm.plan.program) == kind, pm.plan.program
        straight = []
        for step in (1, 2, 3):
            straight.append(pm.train_step(*args, **kwargs))
            pm.save_checkpoint(f"{root}/{kind}-{opt}/step{step}", extra={"step": step, "kind": kind}, keep_last=2)
        draws = torch.rand(4)  # what the generator gives after the save; a resumed rank must draw the same
        torch.manual_seed(1234 + rank)  # and the resumed generator must not depend on what ran before the load
        straight += [pm.train_step(*args, **kwargs) for _ in range(3)]
        out[(kind, opt)] = {"straight": straight, "draws": draws}
    return out


def _resume(rank: int, world: int, root: str, runs: list):
    out = {}
    for kind, opt in runs:
        pm, args, kwargs = _compile(world, kind, opt, seed=7)  # other initial weights: the load must replace them
        path = autopar.latest_checkpoint(f"{root}/{kind}-{opt}")
        extra = pm.load_checkpoint(path)
        draws = torch.rand(4)
        losses = [pm.train_step(*args, **kwargs) for _ in range(3)]
        out[(kind, opt)] = {
            "path": Path(path).name,
            "extra": extra,
            "step": pm.num_steps - 3,
            "draws": draws,
            "losses": losses,
        }
    return out


def test_resume_matches_uninterrupted(tmp_path):
    _check_resume(tmp_path, RESUME_FAST)


@pytest.mark.slow
def test_resume_matches_uninterrupted_every_program(tmp_path):
    _check_resume(tmp_path, [run for run in _runs() if run not in RESUME_FAST])


def _check_resume(tmp_path, runs: list) -> None:
    root = str(tmp_path)
    first = run_distributed(_first, 2, root, runs)
    for kind, opt in runs:
        kept = sorted(p.name for p in (tmp_path / f"{kind}-{opt}").iterdir() if p.name != LOCK)
        assert kept == ["step2", "step3"], (kind, opt, kept)  # keep_last=2
    if ("pipeline", "sgd") in runs:
        # a save cut short: the newest folder loses its marker and a shard file; the previous one is taken
        cut = tmp_path / "pipeline-sgd" / "step3"
        (cut / MARKER).unlink()
        next(cut.glob("*.distcp")).unlink()
        (tmp_path / "pipeline-sgd" / "step9.partial").mkdir()
        assert autopar.latest_checkpoint(tmp_path / "pipeline-sgd") == str(tmp_path / "pipeline-sgd" / "step2")
        with pytest.raises(AssertionError, match="ConfigError: .* is not a complete autopar checkpoint"):
            run_distributed(_load_one, 2, str(cut))
    # a new process group, as a job restarted after a failure would have
    resumed = run_distributed(_resume, 2, root, runs, fresh=True)
    for kind, opt in runs:
        a, b = first[0][(kind, opt)], resumed[0][(kind, opt)]
        for r in range(2):
            if (kind, opt) != ("pipeline", "sgd"):  # resumed from step 2, whose draws were not taken
                assert torch.equal(first[r][(kind, opt)]["draws"], resumed[r][(kind, opt)]["draws"]), (kind, r)
        if (kind, opt) == ("pipeline", "sgd"):  # resumed from step 2: steps 3..5 of the straight run
            assert b["path"] == "step2" and b["step"] == 2 and b["extra"] == {"step": 2, "kind": kind}
            assert b["losses"] == pytest.approx(a["straight"][2:5], rel=RESUME_RTOL), (kind, opt)
            continue
        assert b["path"] == "step3" and b["step"] == 3 and b["extra"] == {"step": 3, "kind": kind}
        assert b["losses"] == pytest.approx(a["straight"][3:], rel=RESUME_RTOL), (kind, opt, b["losses"], a)


def _load_one(rank: int, world: int, path: str):
    pm, _, _ = _compile(world, "pipeline", "sgd")
    pm.load_checkpoint(path)


# -------------------------------------------------------------------------------- another world and layout

RESHARD = [  # (layout on 4 ranks, program), (layout on 2 ranks, program), optimizer
    (({"tp": 2, "dp": 2, "zero": 1}, None), ({"pp": 2, "num_microbatches": 2}, None), "adamw"),
    (({"pp": 2, "dp": 2, "num_microbatches": 2}, None), ({"tp": 2}, None), "sgd"),
    (({"dp": 4, "tp": 1}, None), ({"tp": 1}, True), "adamw"),  # into the offload program's chunks
]


def _save_four(rank: int, world: int, root: str):
    out = []
    for i, ((c, off), _, opt) in enumerate(RESHARD):
        pm, args, kwargs = _compile(world, "", opt, constraints=c, offload=off)
        [pm.train_step(*args, **kwargs) for _ in range(3)]
        pm.save_checkpoint(f"{root}/{i}/step3")
        out.append(
            {
                "program": str(pm.plan.program),
                "mesh": dict(pm.plan.mesh),
                "losses": [pm.train_step(*args, **kwargs) for _ in range(3)],
            }
        )
    return out


def _load_two(rank: int, world: int, root: str):
    out = []
    for i, (_, (c, off), opt) in enumerate(RESHARD):
        pm, args, kwargs = _compile(world, "", opt, seed=7, constraints=c, offload=off)
        pm.load_checkpoint(autopar.latest_checkpoint(f"{root}/{i}"))
        out.append(
            {
                "program": str(pm.plan.program),
                "mesh": dict(pm.plan.mesh),
                "losses": [pm.train_step(*args, **kwargs) for _ in range(3)],
            }
        )
    return out


@pytest.mark.slow
def test_checkpoint_of_four_ranks_resumes_on_two_in_another_layout(tmp_path):
    saved = run_distributed(_save_four, 4, str(tmp_path))[0]
    loaded = run_distributed(_load_two, 2, str(tmp_path))[0]
    assert [s["program"] for s in saved] == ["sharded", "pipeline", "data-parallel"]
    assert [s["program"] for s in loaded] == ["pipeline", "sharded", "offload"]
    for s, g in zip(saved, loaded, strict=True):
        assert g["losses"] == pytest.approx(s["losses"], rel=RESHARD_RTOL), (s, g)


def test_latest_checkpoint_of_an_empty_or_missing_root(tmp_path):
    assert autopar.latest_checkpoint(tmp_path) is None
    assert autopar.latest_checkpoint(tmp_path / "nowhere") is None
    (tmp_path / "step1").mkdir()
    shutil.copy(__file__, tmp_path / "step1" / "x.distcp")
    assert autopar.latest_checkpoint(tmp_path) is None


# --------------------------------------------------------------------------- failures on one rank reach all

# A rank that waited for its peers' collective timeout would take the harness's default group timeout (30
# minutes); an error that every rank raises together comes within the step's own time.
AGREED_WITHIN_S = 60.0


def _preamble_fails_on_rank_0(rank: int, world: int, root: str):
    pm, args, kwargs = _compile(world, "data-parallel", "sgd")
    pm.train_step(*args, **kwargs)
    good = pm.save_checkpoint(f"{root}/step1", extra={"step": 1})
    Path(root, "a-file").write_text("not a folder")  # rank 0's mkdir of a/step2.partial fails; rank 1 does no I/O
    start = time.monotonic()
    try:
        pm.save_checkpoint(f"{root}/a-file/step2")
        error = None
    except autopar.AutoparError as e:
        error = f"{type(e).__name__}: {e}"
    return {
        "error": error,
        "seconds": time.monotonic() - start,
        "good": good,
        "latest": autopar.latest_checkpoint(root),
        "extra": pm.load_checkpoint(autopar.latest_checkpoint(root)),
    }


def _state_of(pm) -> dict:
    return {"state": pm.state_dict(), "step": pm.num_steps, "draws": torch.get_rng_state()}


def _load_fails_on_rank_1(rank: int, world: int, path: str):
    pm, args, kwargs = _compile(world, "data-parallel", "sgd", seed=7)
    pm.train_step(*args, **kwargs)
    before = _state_of(pm)
    try:
        pm.load_checkpoint(path)
        error = None
    except autopar.AutoparError as e:
        error = f"{type(e).__name__}: {e}"
    after = _state_of(pm)
    same = all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    return {"error": error, "same": same and before["step"] == after["step"] == 1}


def test_a_failure_on_one_rank_is_an_error_on_every_rank_and_changes_nothing(tmp_path):
    saved = run_distributed(_preamble_fails_on_rank_0, 2, str(tmp_path))
    for r, got in enumerate(saved):
        assert got["error"] and got["error"].startswith("ConfigError"), (r, got)
        assert "failed on rank 0" in got["error"] and "nothing was written" in got["error"], (r, got)
        assert got["seconds"] < AGREED_WITHIN_S, (r, got["seconds"])
        assert got["latest"] == got["good"] and got["extra"] == {"step": 1}, (r, got)  # the previous one stands
    # the same checkpoint with rank 1's generator states damaged: rank 0 reads all it needs, rank 1 cannot
    damaged = tmp_path / "damaged"
    entries = _load_state_dict_from_keys(checkpoint_id=str(tmp_path / "step1"))  # ours: trusted
    entries["autopar.rng.rank1"] = torch.frombuffer(bytearray(b"{not json"), dtype=torch.uint8).clone()
    dcp.save(entries, checkpoint_id=str(damaged), no_dist=True)
    shutil.copy(tmp_path / "step1" / MARKER, damaged / MARKER)
    loaded = run_distributed(_load_fails_on_rank_1, 2, str(damaged))
    for r, got in enumerate(loaded):
        assert got["error"] and "failed on rank 1" in got["error"] and "autopar.rng.rank1" in got["error"], (r, got)
        assert "the program is as it was" in got["error"] and got["same"], (r, got)

"""Smoke tier (`-m smoke`, what `make test-torch TORCH=<release>` runs on another torch release): every module
imports, a preset plans, and every program kind trains two steps on 2 gloo ranks to the single-process numerics.

The program kinds: data-parallel, sharded (tensor axis; ZeRO-3 over the data axis; a context-parallel axis),
pipeline and offload, each with SGD (momentum) and AdamW (offload: AdamW only, the one optimizer its chunks run),
tiny LLaMA in fp32 on the batch of `tests.models.make_batch` (some rows' labels ignored, so the loss must divide
by the global count of kept labels).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = [pytest.mark.smoke, pytest.mark.distributed]

LR = 1e-2
STEPS = 2
# (program kind the plan must name, constraints, offload)
CASES = (
    ("data-parallel", {"dp": 2, "tp": 1}, False),
    ("sharded", {"tp": 2}, False),
    ("sharded", {"dp": 2, "tp": 1, "zero": 3}, False),
    ("sharded", {"cp": 2, "cp_attention": "ring"}, False),
    ("pipeline", {"pp": 2, "num_microbatches": 2}, False),
    ("offload", {"tp": 1}, True),
)
# fp32 on CPU: the programs sum the loss and gradients over ranks (and attention over key blocks, matmuls over the
# tensor axis) in another order than one process does, so losses agree to rounding (~1e-6 relative); a missing
# reduction, a wrong shard or a wrong label count moves them by percents on this tiny model.
LOSS_RTOL = 1e-4
# State after two steps at lr=1e-2, each tensor's largest difference relative to max(|reference|, FLOOR): with
# SGD (momentum 0.9) rounding-level gradient differences move weights by ~1e-8 relative, while a gradient summed
# wrongly moves them by ~1e-3 of their size. AdamW turns near-zero gradient noise into ±lr steps on single
# elements (a key-projection bias), hence its bound of a tenth of lr.
SGD_RTOL = 1e-5
ADAM_RTOL, ADAM_EPS = 1e-3, 1e-6
FLOOR = 1e-2  # never compare relative to a tensor that may be all zeros


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}
RUNS = tuple((kind, c, off, opt) for kind, c, off in CASES for opt in OPTIMIZERS if opt == "adamw" or not off)


def test_every_module_imports():
    """Every module of the package imports on this torch (a name a release lacks fails here first)."""
    names = [
        m.name
        for m in pkgutil.walk_packages(autopar.__path__, "autopar.")
        if not m.name.endswith("__main__")  # runs the command line
    ]
    assert len(names) > 50, names  # the walk found the package, passes, cost model and kernels
    for name in names:
        importlib.import_module(name)
    major_minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert major_minor >= (2, 11), torch.__version__


def test_plan_a_preset():
    plan = autopar.plan("llama2-7b", "8xA100-80GB", global_batch_size=8, seq_len=2048)
    assert plan.mesh.get("pp", 1) * plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1) * plan.mesh["tp"] == 8
    assert 0 < plan.predicted.step_time_s < 60 and 0 < plan.predicted.mfu < 1
    assert plan.predicted.peak_memory_bytes <= 80e9


def _train(rank: int, world_size: int, runs):
    out = []
    for _kind, constraints, offload, opt in runs:
        model = make_model("llama")
        args, kwargs = make_batch("llama", batch=4, seq=16)
        pm = autopar.compile(
            model,
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=OPTIMIZERS[opt],
            constraints=constraints,
            offload=offload or None,
        )
        losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
        state = pm.state_dict()
        out.append({"program": str(pm.plan.program), "mesh": dict(pm.plan.mesh), "losses": losses, "state": state})
    return out


# `make test-torch` runs it (marked smoke); `make test` trains these kinds in test_programs, test_train_numerics,
# test_pipeline_numerics, test_offload and test_context_parallel, so it is left to `make test-all` there
@pytest.mark.slow
def test_every_program_kind_trains_two_steps_like_one_process():
    results = run_distributed(_train, 2, RUNS, timeout_s=1200)
    for i, (kind, constraints, _, opt) in enumerate(RUNS):
        model = make_model("llama")
        args, kwargs = make_batch("llama", batch=4, seq=16)
        ref_losses, ref_state = train_locally(model, args, kwargs, OPTIMIZERS[opt](model.parameters()), STEPS)
        got = results[0][i]
        what = (kind, constraints, opt)
        assert got["program"] == kind, what
        assert all(got["mesh"].get(axis) == size for axis, size in constraints.items() if axis in got["mesh"]), what
        assert results[1][i]["losses"] == pytest.approx(got["losses"], rel=1e-6), what  # every rank's is the same
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), what
        assert set(got["state"]) == set(ref_state), what
        rtol = SGD_RTOL if opt == "sgd" else ADAM_RTOL
        for name, ref in ref_state.items():
            rel = ((got["state"][name] - ref).abs().max() / max(ref.abs().max().item(), FLOOR)).item()
            assert rel <= rtol, (*what, name, rel)

"""PEFT: a LoRA model plans with its base weights frozen (no optimizer state, no gradient to reduce), trains on
every program kind as on one process, and `save_pretrained` writes what `PeftModel.from_pretrained` (adapters) and
the base model's `from_pretrained` (merged) load, with the trained model's logits."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model

peft = pytest.importorskip("peft", reason="PEFT is in the test extra: pip install -e .[test]")

pytestmark = pytest.mark.distributed

LR = 0.1  # LoRA's B starts at zero: a large step makes the adapters matter to the logits after two steps
STEPS = 2
# SGD with momentum, two steps: the programs and one process differ by summation order only (rounding only)
PARAM_ATOL = 1e-6
# logits of the loaded adapters against the trained model: the same tensors and ops (equal on one process); merged:
# W + s B A rounded once more in fp32 (2.3e-7 seen on one process); an adapter not loaded moves them by more
# than 1e-3 (asserted below)
LOGITS_ATOL = 1e-5


def lora_model() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(make_model("llama"), config)


def _adapter_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def test_a_peft_model_is_planned_with_its_base_frozen():
    model = lora_model()
    args, kwargs = make_batch("llama")
    plan = autopar.plan(model, "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1})
    full = autopar.plan(make_model("llama"), "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1})
    adapters = _adapter_numel(model)
    assert plan.num_parameters == adapters < full.num_parameters / 40
    # fp32 AdamW: two moments per trainable element, a gradient per trainable element; none for the base
    assert plan.predicted.memory_breakdown["optimizer"] == 8 * adapters
    assert plan.predicted.memory_breakdown["grads"] == 4 * adapters
    # the gradient all-reduce carries the adapters only (its latency stays)
    assert plan.predicted.grad_sync_s < full.predicted.grad_sync_s


def _peft_runs(rank: int, world_size: int, cases, folder: str):
    out = []
    args, kwargs = make_batch("llama")
    for i, (_, constraints, offload) in enumerate(cases):
        pm = autopar.compile(
            lora_model(),
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_adamw if offload else _sgd,
            constraints=constraints,
            offload=offload,
        )
        for _ in range(STEPS):
            pm.train_step(*args, **kwargs)
        pm.save_pretrained(f"{folder}/adapters{i}")
        pm.save_pretrained(f"{folder}/merged{i}", merged=True)
        state = pm.state_dict()  # a collective: every rank gathers
        out.append({"kind": str(pm.plan.program), "state": state if rank == 0 else None})
    return out


def _reference(make_opt) -> torch.nn.Module:
    model = lora_model()
    args, kwargs = make_batch("llama")
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for _ in range(STEPS):
        opt.zero_grad()
        model(*args, **kwargs).loss.backward()
        opt.step()
    return model


def test_peft_trains_on_every_program_and_saves_what_peft_and_transformers_load(tmp_path):
    from transformers import LlamaForCausalLM

    cases = [
        ("data-parallel", {"dp": 2, "tp": 1}, None),
        ("sharded", {"tp": 2}, None),
        ("pipeline", {"pp": 2, "num_microbatches": 2}, None),
        ("offload", {"tp": 1}, True),
    ]
    runs = run_distributed(_peft_runs, 2, cases, str(tmp_path))
    args, _ = make_batch("llama")
    refs = {False: _reference(_sgd), True: _reference(_adamw)}
    for i, (kind, constraints, offload) in enumerate(cases):
        got = runs[0][i]
        assert got["kind"] == kind, (kind, constraints)
        ref = refs[bool(offload)]
        for key, value in ref.state_dict().items():
            # AdamW (offload) turns rounding on a near-zero gradient into an update difference (single elements
            # up to ~1.2e-5 seen elsewhere); 1e-4 is 1% of its lr, far below a wrong update (about lr)
            atol = 1e-4 if offload else PARAM_ATOL
            torch.testing.assert_close(got["state"][key], value, atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        trained = lora_model()
        trained.load_state_dict(got["state"])
        with torch.no_grad():
            want = trained.eval()(*args).logits
            base = make_model("llama").eval()(*args).logits
            loaded = peft.PeftModel.from_pretrained(make_model("llama"), tmp_path / f"adapters{i}").eval()
            merged = LlamaForCausalLM.from_pretrained(tmp_path / f"merged{i}").eval()
            assert (want - base).abs().max() > 100 * LOGITS_ATOL  # the adapters change the logits
            torch.testing.assert_close(loaded(*args).logits, want, atol=LOGITS_ATOL, rtol=0)
            torch.testing.assert_close(merged(*args).logits, want, atol=LOGITS_ATOL, rtol=0)
        files = sorted(p.name for p in (tmp_path / f"adapters{i}").iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"], files

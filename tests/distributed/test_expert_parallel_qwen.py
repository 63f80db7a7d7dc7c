"""Expert parallelism trains a tiny Hugging Face Qwen2-MoE on gloo ranks as it trains in one process.

Qwen2-MoE's block adds to the routed experts a shared expert (a dense MLP every token runs) scaled by a sigmoid gate
of its own; both are replicated like the rest of the dense model, and its experts module (`Qwen2MoeExperts`, the
signature of Mixtral's) is dispatched over ep=2. Two SGD steps with momentum against one process, with the router's
auxiliary load-balancing loss in the loss (`output_router_logits`, `router_aux_loss_coef`): the expert-parallel
program counts the tokens routed to each expert over the whole batch, as one process does (a rank's own counts give
another loss and other router gradients).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.plan import Plan
from tests.distributed.harness import run_distributed
from tests.families import family_batch
from tests.models import VOCAB, train_locally

pytestmark = pytest.mark.distributed

STEPS = 2
LR = 1e-2
# fp32: the ranks sum each token's k expert outputs, and each expert's gradient over its tokens, in another order than
# one process does (~1e-7 relative per step; tests/distributed/test_expert_parallel.py gives the same bounds and
# what a wrong gradient moves). Parameters relative to max(|reference|, 1e-2).
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_FLOOR = 1e-4, 1e-2
AUX_COEF = 0.5  # large, so that a rank-local load-balancing loss moves the router's weights well past PARAM_RTOL


def tiny_qwen2_moe(seed: int = 0, aux: bool = True) -> torch.nn.Module:
    """A two-layer Qwen2-MoE (4 experts, top-2, a shared expert and its gate), built from its config."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
        use_cache=False,
        output_router_logits=aux,
        router_aux_loss_coef=AUX_COEF,
        attn_implementation="sdpa",
        experts_implementation="batched_mm",  # traceable (see tests/families.py's Mixtral)
    )
    return Qwen2MoeForCausalLM(config)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _train(rank: int, world: int, plan_json: str, aux: bool) -> dict:
    del rank
    args, kwargs = family_batch("mixtral")
    pm = autopar.compile(
        tiny_qwen2_moe(aux=aux), f"cpu:{world}", args, kwargs, optimizer=_sgd, plan=Plan.from_json(plan_json)
    )
    losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
    return {
        "program": str(pm.plan.program),
        "losses": losses,
        "eval": pm.eval_step(*args, **kwargs),
        "state": pm.state_dict(),
    }


def _check(aux: bool) -> None:
    args, kwargs = family_batch("mixtral")
    plan = autopar.plan(tiny_qwen2_moe(aux=aux), "cpu:2", args, kwargs, constraints={"ep": 2}, alternatives=False)
    assert plan.program == "expert-parallel" and len(plan.expert_parallel["params"]) == 4  # 2 layers x 2 weights
    ranks = run_distributed(_train, 2, plan.to_json(), aux, timeout_s=600)
    model = tiny_qwen2_moe(aux=aux)
    ref_losses, ref_state = train_locally(model, args, kwargs, _sgd(model.parameters()), STEPS)
    with torch.no_grad():
        ref_eval = float(model.eval()(*args, **kwargs).loss)
    for res in ranks:
        assert res["program"] == "expert-parallel"
        assert set(res["state"]) == set(ref_state)
        for key, ref in ref_state.items():
            err = ((res["state"][key] - ref).abs() / ref.abs().clamp_min(PARAM_FLOOR)).max().item()
            assert err <= PARAM_RTOL, (key, err)
        assert res["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
        assert res["eval"] == pytest.approx(ref_eval, rel=LOSS_RTOL)


# in `make test` (the smallest Qwen2-MoE case): 15.8 s as the first test of a run on a pool of two ranks (2 cores)
def test_qwen2_moe_expert_parallel_trains_as_in_one_process():
    _check(aux=True)

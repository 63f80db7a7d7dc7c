"""A vocabulary-split embedding trains on two ranks as on one: DTensor's masked partial sum, planned and run.

The embedding table is pinned split over the vocabulary on the tensor axis, and the vocabulary is large
enough (4096 rows against 64 hidden) that the solver looks the ids up where the rows live (the plan says
"MP", a masked partial sum) rather than gathering the table. BERT adds token, position and type embeddings
and normalises; the plain torch.nn model sums token and position embeddings.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.plan import ProgramKind
from tests.distributed.harness import run_distributed
from tests.models import train_locally

pytestmark = pytest.mark.distributed

VOCAB = 4096
TABLE = {"bert": "bert.embeddings.word_embeddings.weight", "torch": "tok.weight"}
LR, MOMENTUM = 0.1, 0.9
# fp32 on CPU: collectives reorder sums, so losses agree to rounding (~1e-6 relative); a wrong mask or a
# missing reduction of the lookup changes the first loss at the 1e-2 level
LOSS_RTOL = 1e-4
# SGD's update is lr x gradient: rounding-level gradient differences stay at ~1e-7 of weights of ~0.02-1
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-4


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
        )
        return BertForMaskedLM(cfg)
    from tests.families import TorchTransformer

    return TorchTransformer(vocab=VOCAB)


def _batch(name: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (8, 16), generator=g)  # over the whole vocabulary: both ranks' rows are hit
    labels = ids.clone()
    if name == "bert":
        labels[torch.rand(8, 16, generator=g) > 0.3] = -100
    return (ids,), {"labels": labels}


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _train(rank: int, world_size: int, names):
    out = []
    for name in names:
        model = _model(name)
        args, kwargs = _batch(name)
        pm = autopar.compile(
            model,
            f"cpu:{world_size}",
            args,
            kwargs,
            optimizer=_sgd,
            constraints={"tp": 2, "param_placements": {TABLE[name]: "S(0)"}},
        )
        lookups = {n: pm.plan.node_output[n] for n in pm.plan.node_output if n.startswith("embedding")}
        losses = [pm.train_step(*args, **kwargs) for _ in range(3)]
        state = pm.state_dict()  # a collective: every rank takes part
        out.append(
            {"losses": losses, "lookups": lookups, "state": state if rank == 0 else None, "program": pm.plan.program}
        )
    return out


def test_vocabulary_split_embeddings_train_as_on_one_rank():
    names = ("bert", "torch")
    results = run_distributed(_train, 2, names)
    for i, name in enumerate(names):
        got = results[0][i]
        assert got["program"] == ProgramKind.SHARDED
        assert "MP" in got["lookups"].values(), (name, got["lookups"])  # the lookup really ran vocabulary-split
        model = _model(name)
        args, kwargs = _batch(name)
        ref_losses, ref_state = train_locally(model, args, kwargs, _sgd(model.parameters()), 3)
        assert results[1][i]["losses"] == pytest.approx(got["losses"], rel=1e-6)
        assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), name
        for key, ref in ref_state.items():
            torch.testing.assert_close(
                got["state"][key], ref, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=lambda m, k=key, n=name: f"{n} {k}: {m}"
            )

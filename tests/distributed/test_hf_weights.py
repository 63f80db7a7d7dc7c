"""Hugging Face weights in and out on gloo ranks: a tiny LLaMA, a tiny GPT-2 (tied LM head) and a tiny BERT
masked-LM encoder (tied decoder) saved by transformers, built on the meta device and loaded by autopar (each
rank reading only its slices), trained two steps, saved with `save_pretrained` and loaded back by transformers'
matching auto class: its logits are those of the single-process model trained the same way, its config names
the model's class and dtype as transformers writes it, and a generation config is written for the models that
generate only."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import autopar
from tests.distributed.harness import run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
STEPS = 2
# fp32 on both sides; the parallel run sums in another order (rows over ranks, matmuls split over tp,
# micro-batches), ~1e-6 relative on the logits after two SGD steps. A slice read into the wrong place or a
# step missed moves them by ~lr times the gradient, orders of magnitude more.
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-4
CASES = [  # model, world, layout, source files sharded by transformers, files autopar writes
    ("llama", 2, {"tp": 2}, None, "2GB"),
    ("gpt2", 2, {"tp": 2}, "60KB", "2GB"),
    ("bert", 2, {"tp": 2}, None, "100KB"),  # an encoder, written sharded
    # four ranks take a minute each on two cores: run with `make test-all`
    pytest.param("llama", 4, {"pp": 2, "dp": 2, "num_microbatches": 2}, "60KB", "100KB", marks=pytest.mark.slow),
    pytest.param("gpt2", 4, {"pp": 2, "dp": 2, "num_microbatches": 2}, None, "100KB", marks=pytest.mark.slow),
]


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


AUTO = {"llama": AutoModelForCausalLM, "gpt2": AutoModelForCausalLM, "bert": AutoModelForMaskedLM}


def _on_meta(name: str):
    config = make_model(name).config
    with torch.device("meta"):
        return AUTO[name].from_config(config)


def _train_and_save(rank: int, world: int, name: str, layout: dict, src: str, out: str, max_shard: str):
    model = _on_meta(name)
    assert all(p.is_meta for p in model.parameters())
    args, kwargs = make_batch(name)
    pm = autopar.compile(model, f"cpu:{world}", args, kwargs, optimizer=_sgd, constraints=layout, pretrained=src)
    read = pm.pretrained_bytes_read
    losses = [pm.train_step(*args, **kwargs) for _ in range(STEPS)]
    pm.save_pretrained(out, max_shard_size=max_shard)
    return {"program": str(pm.plan.program), "read": read, "losses": losses}


@pytest.mark.parametrize(
    ("name", "world", "layout", "src_shard", "out_shard"),
    CASES,
    ids=["llama-cpu2", "gpt2-cpu2", "bert-cpu2", "llama-cpu4", "gpt2-cpu4"],
)
def test_hf_round_trip(tmp_path, name, world, layout, src_shard, out_shard):
    src, out = tmp_path / "src", tmp_path / "out"
    model = make_model(name)
    model.save_pretrained(src, **({"max_shard_size": src_shard} if src_shard else {}))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    runs = run_distributed(_train_and_save, world, name, layout, str(src), str(out), out_shard)
    args, kwargs = make_batch(name)
    ref_losses, _ = train_locally(model, args, kwargs, _sgd(model.parameters()), STEPS)
    assert runs[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # no rank read the whole model: each read its slices (tp halves the matrices, pp the layers)
    for r, run in enumerate(runs):
        assert 0 < run["read"] < 0.8 * total, (r, run["read"], total)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if out_shard == "2GB":
        assert files == ["model.safetensors"]
    else:
        assert len(files) > 1, files
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["dtype"] == "float32", config
    # transformers gives a generation config to models that generate only (not to the encoder)
    assert (out / "generation_config.json").is_file() == (name != "bert"), sorted(p.name for p in out.iterdir())
    loaded, info = AUTO[name].from_pretrained(out, output_loading_info=True)
    assert type(loaded) is type(model)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # a tied head is saved once, under the name Hugging Face keeps, and tied on load
    head, embedding = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert (head.data_ptr() == embedding.data_ptr()) == model.config.tie_word_embeddings, name
    model.eval()
    loaded.eval()
    with torch.no_grad():
        want = model(args[0]).logits
        got = loaded(args[0]).logits
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)

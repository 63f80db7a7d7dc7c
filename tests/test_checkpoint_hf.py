"""Hugging Face weights in, in one process: slices read into rectangular and flat pieces, dtype conversion,
and the errors for weights of another model or damaged files (each names the tensor and the file)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from autopar.checkpoint import hf
from autopar.checkpoint.pieces import Piece
from autopar.checkpoint.protocol import ModelNames
from autopar.errors import ConfigError
from tests.models import make_model


class _Holder:
    """A test double of the `Checkpointable` protocol as load_pretrained uses it: names, shapes and this rank's
    pieces of each master."""

    def __init__(self, model, cut=None):
        self.checkpoint_names = ModelNames.of(model)
        self.pieces = {n: (cut or _whole)(torch.zeros(s)) for n, s in self.checkpoint_names.shapes.items()}

    def checkpoint_masters(self):
        return self.pieces

    def after_checkpoint_load(self):
        pass


def _whole(t):
    return Piece(t, tuple(t.shape), offsets=(0,) * t.ndim)


def _second_half_rows(t):  # a tp/ZeRO-like shard: rows n//2.. of dim 0
    n = t.shape[0]
    return Piece(t[n // 2 :].clone(), tuple(t.shape), offsets=(n // 2,) + (0,) * (t.ndim - 1))


def _flat_middle(t):  # a chunk shard: a flat range that cuts rows anywhere
    n = t.numel()
    a, b = n // 3 + 1, max(n // 3 + 2, 2 * n // 3 + 1)
    return Piece(torch.zeros(b - a), tuple(t.shape), flat=(a, b))


@pytest.mark.parametrize("cut", [_whole, _second_half_rows, _flat_middle])
@pytest.mark.parametrize("sharded", [False, True])
def test_reads_exactly_the_slices_of_its_pieces(tmp_path, cut, sharded):
    model = make_model("gpt2")  # tied LM head: the files hold it once
    model.save_pretrained(tmp_path, **({"max_shard_size": "60KB"} if sharded else {}))
    holder = _Holder(model, cut)
    read = hf.load_pretrained(holder, tmp_path)
    state = dict(model.named_parameters())
    for name, piece in holder.pieces.items():
        full = state[name].detach()
        if piece.flat is not None:
            want = full.reshape(-1)[piece.flat[0] : piece.flat[1]]
        else:
            want = full
            for d, (o, s) in enumerate(zip(piece.offsets, piece.tensor.shape, strict=True)):
                want = want.narrow(d, o, s)
        assert torch.equal(piece.tensor, want), name
    held = sum(p.tensor.numel() for p in holder.pieces.values()) * 4
    if cut is _second_half_rows:
        assert read == held  # only the slices' bytes
    if cut is _flat_middle:  # whole rows around each range: at most one row more on either side
        extra = sum(2 * math.prod(s[1:]) * 4 for s in holder.checkpoint_names.shapes.values() if len(s) > 1)
        assert held <= read <= held + extra


def test_bf16_weights_become_fp32_masters(tmp_path):
    model = make_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    holder = _Holder(model)
    hf.load_pretrained(holder, tmp_path)
    for name, p in model.named_parameters():
        assert holder.pieces[name].tensor.dtype == torch.float32
        assert torch.equal(holder.pieces[name].tensor, p.detach().float()), name


def _files(tmp_path, model, change):
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    change(state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    model = make_model("llama")
    _files(tmp_path, model, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"lack 'model.layers.1.mlp.up_proj.weight'"):
        hf.load_pretrained(_Holder(model), tmp_path)


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    model = make_model("llama")
    _files(tmp_path, model, lambda s: s.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(
        ConfigError,
        match=r"model.safetensors holds 1 tensor\(s\) the model does not have, e.g. "
        r"\['model.layers.9.mlp.up_proj.weight'\]",
    ):
        hf.load_pretrained(_Holder(model), tmp_path)


def test_shape_mismatch_is_named_with_its_file(tmp_path):
    model = make_model("llama")
    _files(tmp_path, model, lambda s: s.update({"lm_head.weight": torch.zeros(100, 64)}))
    with pytest.raises(
        ConfigError,
        match=r"'lm_head.weight' in .*model.safetensors has shape \(100, 64\) but the "
        r"model's 'lm_head.weight' has \(128, 64\)",
    ):
        hf.load_pretrained(_Holder(model), tmp_path)


def test_corrupt_and_truncated_files_are_named(tmp_path):
    model = make_model("llama")
    _files(tmp_path, model, lambda s: None)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model.safetensors is cut short"):
        hf.load_pretrained(_Holder(model), tmp_path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[100:])
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        hf.load_pretrained(_Holder(model), tmp_path)
    path.unlink()
    with pytest.raises(ConfigError, match=r"holds no model.safetensors and no model.safetensors.index.json"):
        hf.load_pretrained(_Holder(model), tmp_path)


def test_shard_files_cut_in_model_order():
    sizes = {"a": 40, "b": 40, "c": 40, "d": 200, "e": 10}
    assert hf.shard_files(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert hf.file_names(1) == ["model.safetensors"]
    assert hf.file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]

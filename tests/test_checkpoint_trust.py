"""Loading a checkpoint never runs code from it: a payload (a pickle that runs a function when unpickled) planted
in each place a checkpoint or weights folder holds something (meta, extra, RNG states, DCP's index `.metadata`,
byte items, the marker, a safetensors file and its header) is refused with an autopar error naming the file,
and the payload never ran. `extra=` refuses values that are not data. One process, no process group spawned.
"""

from __future__ import annotations

import builtins
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import autopar
from autopar.checkpoint.marker import MARKER
from autopar.checkpoint.reader import INDEX, CheckpointReader, TensorsOnlyPlanner, read_index
from autopar.errors import AutoparError
from tests.models import MLPBlock

CANARY = "payload-ran"


def _plant_canary(path: str) -> None:
    """What a payload runs: leaves a file behind, so that a test sees it ran."""
    Path(path).write_text("ran")


class _Payload:
    """Unpickled, it calls `_plant_canary` (a module function, found by import, as an attacker's would be)."""

    def __init__(self, folder: Path):
        self.canary = str(folder / CANARY)

    def __reduce__(self):
        return (_plant_canary, (self.canary,))


class _ExecPayload(_Payload):
    """Unpickled, it runs Python source through builtins.exec."""

    def __reduce__(self):
        return (builtins.exec, (f"open({self.canary!r}, 'w').write('ran')",))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock(16) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x.square().mean(),)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-rank program after a step, a checkpoint of it, and every entry of that checkpoint."""
    torch.manual_seed(0)
    args = (torch.randn(4, 8, 16),)
    pm = autopar.compile(_Stack(), "cpu:1", args, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    pm.train_step(*args)
    root = tmp_path_factory.mktemp("trust")
    pm.save_checkpoint(root / "good", extra={"position": 3, "weights": torch.arange(4.0)})
    entries = _load_state_dict_from_keys(checkpoint_id=str(root / "good"))  # our own checkpoint: trusted
    return pm, root / "good", entries


@pytest.fixture
def folder(tmp_path):
    tmp_path.joinpath(CANARY).unlink(missing_ok=True)
    return tmp_path


def test_the_payloads_run_when_unpickled_plainly(folder):
    """The planted objects are real payloads: a plain unpickler runs them (so the tests below could fail)."""
    for payload in (_Payload(folder), _ExecPayload(folder)):
        pickle.loads(pickle.dumps(payload))
        assert (folder / CANARY).exists()
        (folder / CANARY).unlink()


def _rewritten(saved, folder: Path, change: dict) -> Path:
    """A copy of the good checkpoint with some entries replaced (a byte item where the value is not a tensor)."""
    _, good, entries = saved
    out = folder / "ckpt"
    dcp.save({**entries, **change}, checkpoint_id=str(out))
    shutil.copy(good / MARKER, out / MARKER)
    return out


def _refused(pm, path: Path, words: str, named: Path | None = None):
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    steps = pm.num_steps
    with pytest.raises(AutoparError, match=words) as e:
        pm.load_checkpoint(path)
    assert str(named or path) in str(e.value), str(e.value)
    assert not (path.parent / CANARY).exists(), "the payload ran"
    after = pm.state_dict()
    assert pm.num_steps == steps and all(torch.equal(before[k], after[k]) for k in before), "a failed load changed it"


_PLACES = ["autopar.meta", "autopar.extra", "autopar.rng.rank0", "autopar.rng.rank0.torch", "autopar.extra.tensor0"]


@pytest.mark.parametrize("key", _PLACES)
@pytest.mark.parametrize("payload", [_Payload, _ExecPayload])
def test_a_payload_as_a_byte_item_is_never_read(saved, folder, key, payload):
    path = _rewritten(saved, folder, {key: payload(folder)})
    _refused(saved[0], path, "other than a tensor|lacks|pickled bytes")


@pytest.mark.parametrize("key", ["autopar.meta", "autopar.extra", "autopar.rng.rank0"])
def test_a_pickle_in_place_of_json_is_not_json(saved, folder, key):
    raw = bytearray(pickle.dumps(_Payload(folder)))
    path = _rewritten(saved, folder, {key: torch.frombuffer(raw, dtype=torch.uint8).clone()})
    _refused(saved[0], path, "damaged plain data: .* is not valid JSON")


def test_a_byte_item_asked_for_directly_is_refused_by_the_reader_and_the_planner(saved, folder):
    path = _rewritten(saved, folder, {"x": _Payload(folder)})
    with pytest.raises(CheckpointException, match="UnsafeCheckpointError: .* holds 'x' as pickled bytes") as e:
        dcp.load({"x": b""}, storage_reader=CheckpointReader(str(path)), planner=TensorsOnlyPlanner())
    assert str(path) in str(e.value) and not (folder / CANARY).exists()
    planner = TensorsOnlyPlanner()
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})()})()
    with pytest.raises(AutoparError, match="pickled bytes"):
        planner.load_bytes(item, None)


@pytest.mark.parametrize("payload", [_Payload, _ExecPayload])
def test_a_payload_index_is_refused_naming_the_class(saved, folder, payload):
    _, good, _ = saved
    path = folder / "ckpt"
    shutil.copytree(good, path)
    (path / INDEX).write_bytes(pickle.dumps(payload(folder)))
    _refused(saved[0], path, "asks for .*(_plant_canary|exec), which a checkpoint index never holds", path / INDEX)


def test_a_payload_inside_a_real_index_is_refused(saved, folder):
    _, good, _ = saved
    path = folder / "ckpt"
    shutil.copytree(good, path)
    index = read_index(good)
    index.planner_data = {"model.layers.0.fc1.weight": _ExecPayload(folder)}
    (path / INDEX).write_bytes(pickle.dumps(index))
    _refused(saved[0], path, "builtins.exec, which a checkpoint index never holds", path / INDEX)


def test_an_index_naming_a_file_outside_the_folder_is_refused(saved, folder):
    _, good, _ = saved
    path = folder / "ckpt"
    shutil.copytree(good, path)
    index = read_index(good)
    info = next(iter(index.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (path / INDEX).write_bytes(pickle.dumps(index))
    _refused(saved[0], path, "not a file of the checkpoint folder", path / INDEX)


def test_a_payload_marker_is_skipped_and_refused(saved, folder):
    _, good, _ = saved
    shutil.copytree(good, folder / "older")
    shutil.copytree(good, folder / "newer")
    (folder / "newer" / MARKER).write_bytes(pickle.dumps(_Payload(folder)))
    assert autopar.latest_checkpoint(folder) == str(folder / "older")
    _refused(saved[0], folder / "newer", f"its {MARKER} is not valid JSON")


def test_the_good_checkpoint_loads_with_its_extra(saved, folder):
    pm, good, _ = saved
    extra = pm.load_checkpoint(good)
    assert extra["position"] == 3 and torch.equal(extra["weights"], torch.arange(4.0))
    assert not (folder / CANARY).exists()


# -------------------------------------------------------------------------------------- Hugging Face files


@pytest.fixture(scope="module")
def pretrained(saved, tmp_path_factory):
    pm = saved[0]
    path = tmp_path_factory.mktemp("hf")
    pm.save_pretrained(path)
    return path


def test_a_pickle_in_place_of_safetensors_is_refused(saved, pretrained, folder):
    path = folder / "weights"
    shutil.copytree(pretrained, path)
    (path / "model.safetensors").write_bytes(pickle.dumps(_ExecPayload(folder)))
    with pytest.raises(AutoparError, match="safetensors") as e:
        saved[0].load_pretrained(path)
    assert str(path / "model.safetensors") in str(e.value) and not (folder / CANARY).exists()


def test_pickled_weights_beside_safetensors_are_never_read(saved, pretrained, folder):
    path = folder / "weights"
    shutil.copytree(pretrained, path)
    torch.save({"w": _Payload(folder)}, path / "pytorch_model.bin")
    header = _header(path / "model.safetensors")
    header["__metadata__"] = {"format": "pt", "payload": pickle.dumps(_Payload(folder)).hex()}
    _write_header(path / "model.safetensors", header)
    saved[0].load_pretrained(path)  # the header's strings are data; the .bin file is not opened
    assert not (folder / CANARY).exists()


def _header(file: Path) -> dict:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


def _write_header(file: Path, header: dict) -> None:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


# ------------------------------------------------------------------------------------------------ extra=


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"f": lambda: 0}, r"extra\['f'\] is a .*function"),
        ({"a": [1, {"b": object()}]}, r"extra\['a'\]\[1\]\['b'\] is a builtins.object"),
        ({1: "x"}, "has the key 1 .*string keys only"),
        ({"p": Path("x")}, r"extra\['p'\] is a pathlib"),
        ([1], "extra must be a dict"),
    ],
)
def test_extra_refuses_what_is_not_data_before_writing(saved, folder, extra, words):
    with pytest.raises(autopar.ConfigError, match=words):
        saved[0].save_checkpoint(folder / "ckpt", extra=extra)
    assert not (folder / "ckpt").exists() and not (folder / "ckpt.partial").exists()


def test_extra_round_trips_data_and_tensors(saved, folder):
    pm = saved[0]
    extra = {
        "n": 1,
        "x": 0.5,
        "s": "a",
        "none": None,
        "flag": True,
        "seq": (1, [2, torch.ones(2)]),
        "nan": float("nan"),
    }
    pm.save_checkpoint(folder / "ckpt", extra=extra)
    back = pm.load_checkpoint(folder / "ckpt")
    assert back["n"] == 1 and back["x"] == 0.5 and back["s"] == "a" and back["none"] is None and back["flag"] is True
    assert back["seq"][0] == 1 and back["seq"][1][0] == 2 and torch.equal(back["seq"][1][1], torch.ones(2))
    assert back["nan"] != back["nan"]  # NaN comes back as NaN


def test_a_failed_load_into_a_fresh_program_leaves_its_optimizer_without_states(saved, folder):
    """Reading a checkpoint with optimizer states first creates the program's (a step at lr 0); a load that then
    fails takes them away again, as the program had none."""
    args = (torch.randn(4, 8, 16),)
    fresh = autopar.compile(_Stack(), "cpu:1", args, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    raw = bytearray(b"{not json")
    path = _rewritten(saved, folder, {"autopar.meta": torch.frombuffer(raw, dtype=torch.uint8).clone()})
    _refused(fresh, path, "damaged plain data")
    assert not fresh.optimizer.state and fresh.num_steps == 0

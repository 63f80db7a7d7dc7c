"""Fuzzing what a user hands autopar: cluster strings and files, constraints, plan files (real plan files,
mutated) and checkpoint metadata. Every input either works or raises an `autopar.AutoparError`; nothing else
may escape (a KeyError, a TypeError from deep inside, an OverflowError, a hang).

Examples are bounded so that the file runs in seconds; the deadline is off because the examples that plan or
load a checkpoint take a few hundred milliseconds on a loaded two-core machine.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import autopar
from autopar.checkpoint.training import MARKER
from autopar.cluster import ClusterSpec
from autopar.constraints import KEYS as CONSTRAINT_KEYS
from autopar.cost_model.devices import DEVICE_PRESETS
from autopar.errors import AutoparError
from tests.models import MLPBlock

GOLDEN = Path(__file__).parent / "golden" / "plans"
FUZZ = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
# examples that plan or read a checkpoint cost a few hundred milliseconds each
SLOW_FUZZ = settings(FUZZ, max_examples=25)

# any JSON value, nested a little
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def works_or_autopar_error(fn, *args, **kwargs):
    """fn's result, or None when it raised an autopar error; anything else fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # settings a path ignores warn, and that is fine here
            return fn(*args, **kwargs)
    except AutoparError:
        return None


# ------------------------------------------------------------------------------------------ clusters

_COUNT = st.one_of(st.integers(-3, 64), st.integers(2**19, 2**70)).map(str) | st.text("0123456789x-+. ", max_size=6)
_KIND = st.sampled_from(sorted(DEVICE_PRESETS)) | st.text(max_size=10)
CLUSTER_STRINGS = st.one_of(
    st.text(max_size=30),
    st.builds(lambda n, m, k: f"{n}x{m}x{k}", _COUNT, _COUNT, _KIND),
    st.builds(lambda m, k: f"{m}x{k}", _COUNT, _KIND),
    st.builds(lambda n: f"cpu:{n}", _COUNT),
)


@pytest.mark.integration
@FUZZ
@given(CLUSTER_STRINGS)
def test_cluster_strings_parse_or_raise_autopar_errors(text):
    spec = works_or_autopar_error(ClusterSpec.parse, text)
    if spec is not None:  # what parses round-trips through the plan file's form
        assert spec.world_size == spec.num_nodes * spec.devices_per_node >= 1
        assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


_QUANTITY = st.one_of(
    JSON,
    st.builds(
        lambda x, u: f"{x}{u}",
        st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 10**30),
        st.sampled_from(["", "GB", "GiB", "GB/s", "TFLOP/s", "us", "ms", "B", "x", "KiB/s"]),
    ),
)
_DEVICE_FIELDS = [
    "name",
    "kind",
    "memory_bytes",
    "memory_bandwidth_bytes_per_s",
    "matmul_flops_per_s",
    "vector_flops_per_s",
    "matmul_efficiency",
    "memory_efficiency",
    "kernel_overhead_s",
    "host_adamw_params_per_s",
    "intra_node_link",
    "bogus",
]
_LINK = st.dictionaries(st.sampled_from(["name", "bandwidth_bytes_per_s", "latency_s", "speed"]), _QUANTITY, max_size=3)
CLUSTER_FILES = st.fixed_dictionaries(
    {"cluster": st.sampled_from(["cpu:2", "2x8xA100-80GB", "8xH100-80GB"]) | CLUSTER_STRINGS},
    optional={
        "device": st.dictionaries(st.sampled_from(_DEVICE_FIELDS), _QUANTITY, max_size=3) | JSON,
        "inter_node_link": _LINK | JSON,
        "intra_node_link": _LINK,
        "host_link": _LINK,
        "host_memory_bytes": _QUANTITY,
        "nodes": JSON,
    },
)


@pytest.mark.integration
@FUZZ
@given(CLUSTER_FILES)
def test_cluster_files_load_or_raise_autopar_errors(data):
    spec = works_or_autopar_error(ClusterSpec.from_overrides, data)
    if spec is not None:
        assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_cluster_file_read_from_disk_with_an_infinite_figure_is_refused(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster: cpu:2\ndevice: {memory_bytes: 1e999}\n")
    with pytest.raises(autopar.ConfigError, match="finite"):
        ClusterSpec.from_file(path)


# --------------------------------------------------------------------------------------- constraints


class _Stack(nn.Module):
    """Two MLP blocks and a scalar loss: the smallest model with layers to cut and matmuls to split."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock(16) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x.square().mean(),)


_VALUE = st.one_of(
    st.integers(-2, 9),
    st.none(),
    st.booleans(),
    st.floats(-1, 2),
    st.text(max_size=6),
    st.sampled_from(["none", "full", "selective", "1f1b", "gpipe", "ring", "fp32", "bf16"]),
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
)
CONSTRAINTS = st.dictionaries(st.sampled_from(sorted(CONSTRAINT_KEYS) + ["bogus"]), _VALUE, max_size=4)


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return _Stack(), (torch.randn(4, 8, 16),)


@pytest.mark.integration
@SLOW_FUZZ
@given(CONSTRAINTS)
def test_constraints_plan_or_raise_autopar_errors(stack, constraints):
    model, args = stack
    plan = works_or_autopar_error(autopar.plan, model, "cpu:4", args, constraints=constraints, alternatives=False)
    if plan is not None:
        for key in ("tp", "dp", "pp"):  # a pin that planned is honoured
            if isinstance(constraints.get(key), int) and not isinstance(constraints[key], bool):
                assert plan.mesh.get(key, 1) == constraints[key], (key, plan.mesh)


# ----------------------------------------------------------------------------------------- plan files


def _golden_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(GOLDEN.glob("*.json"))}


GOLDEN_TEXTS = _golden_texts()


def _paths(value, prefix=()):
    """Every path (tuple of keys and indices) into a parsed JSON value."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):  # the first entries of a long table stand for the rest
            yield from _paths(v, (*prefix, i))


def _mutated(doc, path, replacement, delete: bool):
    if not path:
        return replacement
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return doc


class _Mutant(str):
    """A mutated plan text that shows as what was done to which file (hypothesis prints failing examples)."""

    how: str

    def __repr__(self) -> str:
        return f"<{self.how}>"


@st.composite
def mutated_plans(draw):
    name = draw(st.sampled_from(sorted(GOLDEN_TEXTS)))
    text = GOLDEN_TEXTS[name]
    if draw(st.integers(0, 3)) == 0:  # damage the text itself: cut it, or overwrite a stretch
        start, cut, junk = draw(st.integers(0, len(text))), draw(st.integers(0, 8)), draw(st.text(max_size=8))
        out = _Mutant(text[:start] + junk + text[start + cut :])
        out.how = f"{name}: {cut} characters at {start} replaced by {junk!r}"
        return out
    doc = json.loads(text)
    path = draw(st.sampled_from(list(_paths(doc))))
    value, delete = draw(JSON), draw(st.booleans())
    out = _Mutant(json.dumps(_mutated(doc, path, value, delete)))
    out.how = f"{name}: {list(path)} " + ("deleted" if delete else f"set to {value!r}")
    return out


def test_golden_plan_files_read_back():
    assert GOLDEN_TEXTS, f"no golden plan files under {GOLDEN}"
    for text in GOLDEN_TEXTS.values():
        autopar.Plan.from_json(text).summary()  # the unmutated files are valid: the mutations start from plans


@pytest.mark.integration
@FUZZ
@given(mutated_plans())
def test_mutated_plan_files_read_or_raise_autopar_errors(text):
    plan = works_or_autopar_error(autopar.Plan.from_json, text)
    if plan is not None:  # what reads back can be reported and written again
        works_or_autopar_error(plan.summary)
        works_or_autopar_error(plan.explain)
        assert autopar.Plan.from_json(plan.to_json()).to_json() == plan.to_json()


@pytest.mark.parametrize("version", [None, 0, 2, "1", True, 1.5])
def test_plan_file_of_another_or_no_version_names_both(version):
    doc = json.loads(next(iter(GOLDEN_TEXTS.values())))
    if version is None:
        del doc["format_version"]
    else:
        doc["format_version"] = version
    with pytest.raises(autopar.PlanFormatError) as e:
        autopar.Plan.from_json(json.dumps(doc))
    found = "no format_version" if version is None else f"version {version!r}"
    assert found in str(e.value) and "reads version 1" in str(e.value)


# ---------------------------------------------------------------------------------- checkpoint metadata


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-rank program of the stack after one step, and a checkpoint of it."""
    torch.manual_seed(0)
    args = (torch.randn(4, 8, 16),)
    pm = autopar.compile(_Stack(), "cpu:1", args, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    pm.train_step(*args)
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    pm.save_checkpoint(root / "good", extra={"step": 1})
    return pm, root / "good"


_MARKER_KEYS = st.sampled_from(["format", "version", "step", "world_size", "program", "mesh", "model", "time", "x"])
MARKERS = st.one_of(
    st.dictionaries(_MARKER_KEYS, JSON, max_size=5),
    st.fixed_dictionaries({"format": st.just("autopar-checkpoint"), "version": st.just(1) | JSON, "step": JSON}),
    JSON,
)


@SLOW_FUZZ
@given(MARKERS, st.booleans())
def test_checkpoint_markers_load_or_raise_autopar_errors(saved, tmp_path_factory, marker, as_text):
    pm, good = saved
    root = tmp_path_factory.mktemp("marker")
    shutil.copytree(good, root / "older")
    shutil.copytree(good, root / "newer")
    (root / "newer" / MARKER).write_text(json.dumps(marker) if not as_text else str(marker))
    latest = works_or_autopar_error(autopar.latest_checkpoint, root)
    assert latest in (str(root / "older"), str(root / "newer"))  # a bad marker is skipped, never an error
    extra = works_or_autopar_error(pm.load_checkpoint, root / "newer")
    assert extra in (None, {"step": 1})


@pytest.mark.integration
@SLOW_FUZZ
@given(st.sampled_from([".metadata", "__0_0.distcp"]), st.integers(0, 4000), st.binary(max_size=16))
def test_damaged_checkpoint_files_load_or_raise_autopar_errors(saved, tmp_path_factory, name, at, junk):
    pm, good = saved
    copy = tmp_path_factory.mktemp("damaged") / "ckpt"
    shutil.copytree(good, copy)
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[:at] + junk + data[at + len(junk) :])
    works_or_autopar_error(pm.load_checkpoint, copy)

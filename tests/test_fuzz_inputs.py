"""Fuzzing what a user hands autopar: cluster strings and files, constraints, plan files (real plan files,
mutated) and checkpoint metadata. Every input either works or raises an `autopar.AutoparError`; nothing else
may escape (a KeyError, a TypeError from deep inside, an OverflowError, a hang). Every file reader (plan, cluster,
safetensors header, checkpoint marker, DCP's index) is fed the shapes that blow readers up (size, depth, huge
counts, YAML aliases) under a time and memory bound per case (`bounded`).

Examples are bounded so that the file runs in seconds; the deadline is off because the examples that plan or
load a checkpoint take a few hundred milliseconds on a loaded two-core machine.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import time
import tracemalloc
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

# many generated cases each, under time and memory bounds: `make test`, not the unit loop of `make check`
pytestmark = pytest.mark.integration

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


def test_a_plan_whose_hidden_communication_was_emptied_writes_what_it_reads():
    """A case the fuzzing found: with `hidden_communication` emptied, the plan was written without it, and read
    back as an older file, which takes the data axis's hidden time from `predicted`."""
    doc = json.loads(GOLDEN_TEXTS["gpt3-1.3b-2x8xA100-80GB.json"])
    assert doc["predicted"]["grad_sync_hidden_s"] > 0
    doc["hidden_communication"] = {}
    plan = autopar.Plan.from_json(json.dumps(doc))
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


_MARKER_KEYS = st.sampled_from(
    ["format", "version", "step", "run", "world_size", "program", "mesh", "model", "time", "x"]
)
MARKERS = st.one_of(
    st.dictionaries(_MARKER_KEYS, JSON, max_size=5),
    st.fixed_dictionaries(
        {"format": st.just("autopar-checkpoint"), "version": st.just(2) | JSON, "step": JSON},
        optional={"run": st.just("r") | JSON, "time": st.just(1.0) | JSON},
    ),
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
@pytest.mark.usefixtures("traced_allocations")
def test_damaged_checkpoint_files_load_or_raise_autopar_errors(saved, tmp_path_factory, name, at, junk):
    pm, good = saved
    copy = tmp_path_factory.mktemp("damaged") / "ckpt"
    shutil.copytree(good, copy)
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[:at] + junk + data[at + len(junk) :])
    works_or_autopar_error(pm.load_checkpoint, copy)


# ------------------------------------------------------------------------- size, depth, counts, aliases

# Each reader bounds what it reads before it allocates or renders: a hostile file is refused (or read) within
# these. They guard against hangs and blow-ups (the issue measured 40 s and 1.2-3.8 GB), not speed: a bounded
# read takes milliseconds, and the limits leave room for a loaded two-core machine and tracemalloc's slowdown.
# CPU seconds of this process, not wall time: a reader that works through a crafted count spends them, while a
# machine busy with other work only stretches the wall clock (a wall bound failed at 5.4 s under a load of 27).
CASE_S = 5.0
CASE_PEAK_BYTES = 256 * 2**20


@contextlib.contextmanager
def _tracing():
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.fixture
def traced_allocations():
    """Trace Python allocations for the whole test, started and stopped once, not around each case: `tracemalloc.stop()`
    races with a thread outside Python taking the GIL (CPython gh-128679, fixed in 3.12.9 and 3.13.2; a worker that
    ran gloo ranks has such threads), and stopping it after every case crashed a test process with a segmentation
    fault. Only the tests that bound their cases trace (tracing slows the others several times)."""
    with _tracing():
        yield


def bounded(fn, *args):
    """works_or_autopar_error(fn, *args) within CASE_S CPU seconds and CASE_PEAK_BYTES of Python allocations (in a
    test that uses `traced_allocations`)."""
    assert tracemalloc.is_tracing(), "a test that calls bounded() uses the traced_allocations fixture"
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.process_time()
    try:
        return works_or_autopar_error(fn, *args)
    finally:
        seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1] - before
        assert seconds < CASE_S, f"took {seconds:.1f} s"
        assert peak < CASE_PEAK_BYTES, f"allocated {peak / 2**20:.0f} MiB"


HUGE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**20, 2**20 + 1, 10**6, 2**31, 2**62, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_COUNT_PATHS = [
    ("num_microbatches",),
    ("global_batch_size",),
    ("mesh", "pp"),
    ("mesh", "dp"),
    ("cluster", "num_nodes"),
    ("cluster", "devices_per_node"),
    ("pipeline", "virtual_stages"),
    ("pipeline", "stages", 0, "dp"),
    ("pipeline", "stages", 0, "layers", 0, 1),
]
_PIPELINED = sorted(name for name, text in GOLDEN_TEXTS.items() if json.loads(text)["pipeline"])


@st.composite
def counted_plans(draw):
    """A pipelined golden plan with one count set to a huge, negative or odd value (a second count sometimes)."""
    doc = json.loads(GOLDEN_TEXTS[draw(st.sampled_from(_PIPELINED))])
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(_COUNT_PATHS))
        _mutated(doc, path, draw(HUGE), delete=False)
    return json.dumps(doc)


def _read_and_render(text: str):
    plan = autopar.Plan.from_json(text)
    plan.summary()
    plan.explain()
    return plan


@FUZZ
@given(counted_plans())
@pytest.mark.usefixtures("traced_allocations")
def test_plan_files_with_huge_counts_are_read_or_refused_within_bounds(text):
    bounded(_read_and_render, text)


@FUZZ
@given(
    st.sampled_from(sorted(GOLDEN_TEXTS)),
    st.sampled_from(_COUNT_PATHS[:1] + [("param_placements",)]),
    st.integers(1, 3000),
)
@pytest.mark.usefixtures("traced_allocations")
def test_deeply_nested_plan_files_are_refused_within_bounds(name, path, depth):
    doc = json.loads(GOLDEN_TEXTS[name])
    text = json.dumps(_mutated(doc, path, "NEST", delete=False)).replace('"NEST"', "[" * depth + "0" + "]" * depth)
    assert bounded(autopar.Plan.from_json, text) is None  # a count or a table as nested lists: refused


def test_an_oversized_plan_file_is_refused_before_it_is_parsed(tmp_path):
    doc = json.loads(next(iter(GOLDEN_TEXTS.values())))
    doc["param_placements"] = {f"p{i}": ["R"] * 8 for i in range(800_000)}  # about 40 MB of placements
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with _tracing():  # the reading only: tracing the 40 MB the test writes would take most of its time
        assert bounded(autopar.Plan.from_file, path) is None
    with pytest.raises(autopar.PlanFormatError, match="more than the .* a plan file is read up to"):
        autopar.Plan.from_file(path)


_ALIAS_BOMB_LEVELS = st.integers(1, 12)


@FUZZ
@given(_ALIAS_BOMB_LEVELS, st.integers(2, 10), st.booleans())
@pytest.mark.usefixtures("traced_allocations")
def test_yaml_alias_bombs_are_refused_within_bounds(tmp_path_factory, levels, fan_out, in_an_error):
    """Anchors that alias the one before `fan_out` times: 10 levels of 9 make a billion values when expanded.
    The bomb sits in the cluster string (rendered into an error) or in an override."""
    lines = ['a0: &a0 "x"']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan_out)}]")
    lines.append(f"cluster: *a{levels}" if in_an_error else f"cluster: cpu:2\ndevice: {{name: *a{levels}}}")
    path = tmp_path_factory.mktemp("bomb") / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    bounded(ClusterSpec.from_file, path)


@FUZZ
@given(st.integers(1, 20000), st.sampled_from(["[", "{a: ", "- "]))
@pytest.mark.usefixtures("traced_allocations")
def test_deeply_nested_cluster_files_are_refused_within_bounds(tmp_path_factory, depth, opener):
    closer = {"[": "]", "{a: ": "}", "- ": ""}[opener]
    if opener == "- ":
        text = "cluster:\n" + "".join("  " * (i + 1) + "- \n" for i in range(min(depth, 300)))
    else:
        text = "cluster: " + opener * depth + "1" + closer * depth
    path = tmp_path_factory.mktemp("deep") / "cluster.yaml"
    path.write_text(text)
    bounded(ClusterSpec.from_file, path)


def _safetensors(folder: Path, header_bytes: bytes, declared: int | None = None, payload: int = 64) -> Path:
    n = len(header_bytes) if declared is None else declared
    (folder / "model.safetensors").write_bytes(n.to_bytes(8, "little", signed=False) + header_bytes + bytes(payload))
    return folder


_HEADER_ENTRY = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F32", "BF16", "I64", "X9"]) | JSON, "shape": st.lists(HUGE, max_size=3) | JSON},
    optional={"data_offsets": st.lists(HUGE, max_size=3) | JSON},
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=6), _HEADER_ENTRY | JSON, max_size=4),
    st.one_of(st.none(), st.sampled_from([0, 1, 7, 2**62, 2**64 - 1, 100_000_001]), st.integers(0, 10**9)),
    st.integers(0, 3000),
)
@pytest.mark.usefixtures("traced_allocations")
def test_safetensors_headers_are_read_or_refused_within_bounds(tmp_path_factory, header, declared, depth):
    from autopar.checkpoint.hf import WeightFiles

    text = json.dumps(header)
    if depth:  # nested past what json.dumps writes
        text = '{"__metadata__": ' + "[" * depth + "]" * depth + ", " + text[1:] if header else text
    text = text.encode()
    folder = _safetensors(tmp_path_factory.mktemp("st"), text, declared)
    bounded(WeightFiles, folder)


@SLOW_FUZZ
@given(st.integers(1, 5000), st.integers(0, 3 * 2**20))
@pytest.mark.usefixtures("traced_allocations")
def test_checkpoint_markers_of_any_depth_or_size_are_skipped_within_bounds(tmp_path_factory, depth, padding):
    from autopar.checkpoint.marker import latest_checkpoint, marker_problem

    root = tmp_path_factory.mktemp("markers")
    (root / "ckpt").mkdir()
    (root / "ckpt" / ".metadata").write_bytes(b"")
    marker = {"format": "autopar-checkpoint", "version": 2, "step": "NEST", "pad": "x" * padding}
    (root / "ckpt" / MARKER).write_text(json.dumps(marker).replace('"NEST"', "[" * depth + "1" + "]" * depth))
    assert bounded(latest_checkpoint, root) is None
    assert bounded(marker_problem, root / "ckpt") is not None


def _nested_list_pickle(depth: int) -> bytes:
    """Pickle opcodes of a list nested `depth` deep (written by hand: pickle.dumps recurses, the reader does not)."""
    return b"]" * depth + b"a" * (depth - 1)


_INDEX_MUTATIONS = ["size", "chunk offsets", "chunk sizes", "chunk count", "entry count", "storage", "nesting"]


@SLOW_FUZZ
@given(st.sampled_from(_INDEX_MUTATIONS), HUGE, st.sampled_from([0, 1, 2, 2**10, 2**16]), st.integers(0, 3))
@pytest.mark.usefixtures("traced_allocations")
def test_checkpoint_indexes_with_huge_counts_are_read_or_refused_within_bounds(
    saved, tmp_path_factory, how, n, count, i
):
    """DCP's index `.metadata` of a real checkpoint with a count set huge (a shape, a chunk's place, a count of
    chunks or entries made of shared references: a small file naming millions of things), or nested deep: read
    and loaded, or refused, within the case's bounds. (Counts stop at 2**16: past that, unpickling a million
    distinct keys is the time of reading a file that size, not a count the reader could refuse sooner.)"""
    from autopar.checkpoint.reader import INDEX, read_index

    pm, good = saved
    index = read_index(good)
    key = sorted(k for k in index.state_dict_metadata if k.startswith(("model.", "autopar.extra")))[i]
    entry = index.state_dict_metadata[key]
    if how == "size":
        entry.size = torch.Size([n % 2**62] * (1 + count % 3)) if isinstance(n, int) and n >= 0 else [n]
    elif how in ("chunk offsets", "chunk sizes"):
        field = "offsets" if how == "chunk offsets" else "sizes"
        setattr(entry.chunks[0], field, torch.Size([n % 2**62] * len(entry.size)) if isinstance(n, int) else [n])
    elif how == "chunk count":
        entry.chunks = entry.chunks * count  # one object referred to `count` times: a few bytes each
    elif how == "entry count":
        index.state_dict_metadata.update({f"{key}.copy{j}": entry for j in range(count)})
    elif how == "storage":
        info = next(iter(index.storage_data.values()))
        info.offset, info.length = (n, n) if isinstance(n, int) else (0, n)
    else:
        index.planner_data = "NEST"
    raw = pickle.dumps(index, protocol=2)  # no frames: the nested list below replaces bytes of the text
    if how == "nesting":
        raw = raw.replace(b"X\x04\x00\x00\x00NEST", _nested_list_pickle(1 + count % 100_000))
    copy = tmp_path_factory.mktemp("index") / "ckpt"
    shutil.copytree(good, copy)
    (copy / INDEX).write_bytes(raw)
    bounded(read_index, copy)
    assert bounded(pm.load_checkpoint, copy) in (None, {"step": 1})

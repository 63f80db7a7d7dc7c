"""ProfiledEstimator: times real ops on random inputs shaped like the graph's, and caches them."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.fx as fx

from autopar.cost_model import profiler
from autopar.cost_model.profiler import ProfiledEstimator, default_cache_path

aten = torch.ops.aten


def _meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.fixture
def graph() -> dict[str, fx.Node]:
    """A few hand-built nodes with meta values, as a torch.export graph would carry them."""
    g = fx.Graph()

    def placeholder(name, val):
        p = g.placeholder(name)
        p.meta["val"] = val
        return p

    def call(target, args, val, kwargs=None):
        n = g.call_function(target, args, kwargs or {})
        n.meta["val"] = val
        return n

    table, ids = placeholder("table", _meta(5, 16)), placeholder("ids", _meta(4, 32, dtype=torch.int64))
    w = placeholder("w", _meta(8, 16))
    emb = call(aten.embedding.default, (table, ids), _meta(4, 32, 16))
    lin = call(aten.linear.default, (emb, w), _meta(4, 32, 8))
    view = call(aten.view.default, (lin, [128, 8]), _meta(128, 8))
    labels = placeholder("labels", _meta(128, dtype=torch.int64))
    loss = call(aten.cross_entropy_loss.default, (view, labels), _meta())
    q = placeholder("q", _meta(2, 2, 16, 8))
    sdpa = call(aten.scaled_dot_product_attention.default, (q, q, q), _meta(2, 2, 16, 8), {"is_causal": True})
    return {"embedding": emb, "linear": lin, "view": view, "loss": loss, "sdpa": sdpa}


def test_times_ops_and_caches_them(graph, tmp_path):
    path = tmp_path / "profile.json"
    est = ProfiledEstimator(path, repeats=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # indices out of range would fall back with a warning
        times = {k: (est.forward_time_s(n, 1.0), est.backward_time_s(n, 1.0)) for k, n in graph.items()}
    assert est.failed_targets == set()
    assert times["view"] == (0.0, 0.0)
    for name in ("embedding", "linear", "loss", "sdpa"):
        assert times[name][0] > 0 and times[name][1] > 0, name
    assert est.num_timed == 4  # the view was not timed
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 4

    again = ProfiledEstimator(path, repeats=2)
    again._run = None  # any attempt to time would fail loudly
    for name, node in graph.items():
        assert (again.forward_time_s(node, 1.0), again.backward_time_s(node, 1.0)) == times[name]
    assert again.num_timed == 0


def test_divisor_scales_the_measured_time(graph, tmp_path):
    est = ProfiledEstimator(tmp_path / "p.json", repeats=1)
    full = est.forward_time_s(graph["linear"], 1.0)
    assert est.forward_time_s(graph["linear"], 4.0) == pytest.approx(full / 4)
    assert est.num_timed == 1


def test_thread_count_is_part_of_the_key(graph, tmp_path):
    path = tmp_path / "p.json"
    ProfiledEstimator(path, repeats=1, num_threads=1).forward_time_s(graph["linear"], 1.0)
    two = ProfiledEstimator(path, repeats=1, num_threads=2)
    two.forward_time_s(graph["linear"], 1.0)
    assert two.num_timed == 1
    assert len(json.loads(path.read_text())["entries"]) == 2


def test_untimeable_op_falls_back_with_a_warning(tmp_path):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _meta(4, 4)
    y = g.placeholder("y")
    y.meta["val"] = _meta(3, 3)
    node = g.call_function(aten.mm.default, (x, y))  # inner sizes 4 and 3 cannot multiply
    node.meta["val"] = _meta(4, 3)
    est = ProfiledEstimator(tmp_path / "p.json", repeats=1)
    with pytest.warns(UserWarning, match="cannot time"):
        assert est.forward_time_s(node, 1.0) > 0
    assert est.failed_targets == {str(aten.mm.default)}


def test_default_cache_path(monkeypatch, tmp_path):
    monkeypatch.delenv(profiler.CACHE_ENV, raising=False)
    assert default_cache_path("cpu").name == "profile-cpu.json"
    assert default_cache_path("cuda:0").name == "profile-cuda-0.json"
    monkeypatch.setenv(profiler.CACHE_ENV, str(tmp_path / "elsewhere.json"))
    assert ProfiledEstimator().cache_path == tmp_path / "elsewhere.json"

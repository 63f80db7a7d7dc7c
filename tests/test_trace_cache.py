"""Tests of autopar.trace_cache: a model of the same structure gets the same graph bound to its own tensors, anything
that changes the graph is another key, and a cached trace keeps no model or batch alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autopar.context_parallel.inputs import splitting_sequences
from autopar.presets import build_model, example_batch, load_config
from autopar.trace import trace_model
from autopar.trace_cache import CACHE, TraceCache, structure_key


class Block(torch.nn.Module):
    def __init__(self, width: int = 8, scale: float = 2.0) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("offset", torch.arange(width, dtype=torch.float32), persistent=False)
        self.scale = scale

    def forward(self, x):
        return (self.proj(x) * self.scale + self.offset).relu().sum()


def _llama(seed: int):
    torch.manual_seed(seed)
    model = build_model(load_config("tiny-llama"), device="cpu")
    return model.train()


def _uncached(monkeypatch, model, args, kwargs=None, **kw):
    monkeypatch.setenv("AUTOPAR_TRACE_CACHE", "0")
    try:
        return trace_model(model, args, kwargs, **kw)
    finally:
        monkeypatch.delenv("AUTOPAR_TRACE_CACHE")


@pytest.fixture(autouse=True)
def _empty_cache():
    CACHE.clear()
    yield
    CACHE.clear()


@pytest.mark.integration  # two exports of the tiny LLaMA (1.5-4 s)
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["own-dtype", "bf16"])
def test_a_model_built_alike_gets_the_graph_bound_to_its_own_tensors(monkeypatch, compute_dtype):
    config = load_config("tiny-llama")
    args, kwargs = example_batch(config, 2, 16)
    first, second = _llama(0), _llama(1)
    trace_model(first, args, kwargs, compute_dtype=compute_dtype)
    hits = CACHE.hits
    traced = trace_model(second, args, kwargs, compute_dtype=compute_dtype)
    assert CACHE.hits == hits + 1
    traced.exported.validate()  # the program's own checks (a parameter's entry must be a Parameter)
    reference = _uncached(monkeypatch, second, args, kwargs, compute_dtype=compute_dtype)
    assert traced.graph_module.code == reference.graph_module.code
    for field in ("param_names", "buffer_names", "placeholder_kinds", "user_input_paths", "num_layers"):
        assert getattr(traced, field) == getattr(reference, field)
    own = dict(second.named_parameters())
    for name, value in traced.exported.state_dict.items():
        if compute_dtype is None:  # traced from the model itself: its own tensors, as an export of it holds
            assert value is own[name]
        else:  # traced from a stand-in in the compute format: shapes only
            assert value.shape == own[name].shape and value.dtype == compute_dtype
    assert traced.exported.constants.keys() == reference.exported.constants.keys()
    for name, value in traced.exported.constants.items():  # the rotary frequencies, as the export takes them
        assert torch.equal(value, reference.exported.constants[name]), name
        assert value.dtype == reference.exported.constants[name].dtype


def test_each_hit_is_a_graph_of_its_own():
    x = torch.randn(4, 8)
    first = trace_model(Block(), (x,))
    expected = first.graph_module.code
    relu = next(n for n in first.graph_module.graph.nodes if n.target == torch.ops.aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])  # a pass rewriting the graph it was handed
    first.graph_module.graph.erase_node(relu)
    first.graph_module.recompile()
    second = trace_model(Block(), (x,))
    assert CACHE.hits == 1
    assert second.graph_module.code == expected
    third = trace_model(Block(), (x,))
    assert third.graph_module is not second.graph_module


def _patched_forward(self, x):
    return self.proj(x).sum()


@pytest.mark.parametrize(
    "change",
    [
        "shape",
        "dtype",
        "requires_grad",
        "eval",
        "attribute",
        "buffer",
        "instance forward",
        "class forward",
        "cp chunks",
        "compute dtype",
    ],
)
def test_what_changes_the_graph_is_another_key(monkeypatch, change):
    x = torch.randn(4, 8)
    base = structure_key(Block(), (x,), {}, None)[0]
    assert structure_key(Block(), (torch.randn(4, 8),), {}, None)[0] == base  # weights and values are not the graph
    model, args, compute_dtype = Block(), (x,), None
    if change == "shape":
        args = (torch.randn(2, 8),)
    elif change == "dtype":
        args = (x.double(),)
    elif change == "requires_grad":
        args = (x.requires_grad_(),)
    elif change == "eval":
        model.eval()
    elif change == "attribute":
        model.scale = 3.0
    elif change == "buffer":
        model.register_buffer("offset", torch.zeros(8), persistent=True)
    elif change == "instance forward":
        model.forward = _patched_forward.__get__(model)
    elif change == "class forward":
        monkeypatch.setattr(Block, "forward", _patched_forward)
    elif change == "compute dtype":
        compute_dtype = torch.bfloat16
    if change == "cp chunks":
        with splitting_sequences(True):
            key = structure_key(model, args, {}, compute_dtype)[0]
    else:
        key = structure_key(model, args, {}, compute_dtype)[0]
    assert key != base


def test_the_changed_class_forward_is_traced_again(monkeypatch):
    x = torch.randn(4, 8)
    trace_model(Block(), (x,))
    monkeypatch.setattr(Block, "forward", _patched_forward)
    traced = trace_model(Block(), (x,))
    assert CACHE.hits == 0
    assert torch.ops.aten.relu.default not in {n.target for n in traced.graph_module.graph.nodes}


def test_a_module_with_hooks_is_not_cached():
    model = Block()
    model.proj.register_forward_hook(lambda module, args, out: out * 2)
    assert structure_key(model, (torch.randn(4, 8),), {}, None) is None
    trace_model(model, (torch.randn(4, 8),))
    trace_model(model, (torch.randn(4, 8),))
    assert CACHE.hits == 0 and len(CACHE) == 0


def test_a_cached_trace_keeps_no_model_or_batch_alive():
    model, x = Block(width=256), torch.randn(4, 256)
    weight, batch = weakref.ref(model.proj.weight), weakref.ref(x)
    traced = trace_model(model, (x,))
    assert len(CACHE) == 1
    del model, x, traced
    gc.collect()
    assert weight() is None and batch() is None


def test_least_recently_used_traces_go_first():
    cache = TraceCache(keep=2)
    traced = {}
    for rows in (1, 2, 3):
        model, x = Block(), torch.randn(rows, 8)
        key, refs = structure_key(model, (x,), {}, None)
        traced[rows] = key
        cache.put(key, refs, trace_model(model, (x,)).exported, model, ((x,), {}), {})
    assert len(cache) == 2
    assert cache.get(traced[1], Block(), ((torch.randn(1, 8),), {})) is None
    assert cache.get(traced[3], Block(), ((torch.randn(3, 8),), {})) is not None


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TRACE_CACHE", "0")
    x = torch.randn(4, 8)
    trace_model(Block(), (x,))
    trace_model(Block(), (x,))
    assert CACHE.hits == 0 and len(CACHE) == 0

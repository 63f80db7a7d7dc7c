"""Tests of autopar.trace: exporting real, fake and meta models, signatures, layer ids, tied weights, errors."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.errors import ConfigError, TraceError
from autopar.presets import build_model, count_parameters, example_batch, load_config
from autopar.trace import TracedModel, layer_of, module_path_of, normalize_module_path, trace_model

LINEAR = torch.ops.aten.linear.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default
CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
# GPT-2's Conv1D projections export as addmm, the others' nn.Linear as linear.
MATMULS = (LINEAR, torch.ops.aten.addmm.default, torch.ops.aten.mm.default)

# Where each family keeps its repeated layers.
LAYER_CONTAINER = {"tiny-llama": "model.layers", "tiny-gpt2": "transformer.h", "tiny-bert": "bert.encoder.layer"}


def _trace_preset(name: str, device: str, **overrides):
    config = load_config(name, **overrides)
    torch.manual_seed(0)
    model = build_model(config, device=device)
    args, kwargs = example_batch(config, 2, 16, device=device)
    return config, model, args, kwargs, trace_model(model, args, kwargs)


@pytest.fixture(scope="module", params=[(n, d) for n in LAYER_CONTAINER for d in ("cpu", "meta")], ids=str)
def traced_preset(request):
    name, device = request.param
    return (name, *_trace_preset(name, device))


def _placeholders(traced: TracedModel) -> list[fx.Node]:
    return [n for n in traced.exported.graph.nodes if n.op == "placeholder"]


def _ops(traced: TracedModel, *targets) -> list[fx.Node]:
    return [n for n in traced.exported.graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.integration
def test_signature_describes_every_placeholder(traced_preset):
    _, _, model, _, _, traced = traced_preset
    placeholders = _placeholders(traced)
    assert len(traced.placeholder_kinds) == len(placeholders)
    # Tied tensors count once, so the params are exactly the deduplicated named_parameters, in placeholder order.
    unique = dict(model.named_parameters())
    assert sorted(traced.param_names) == sorted(unique)
    param_nodes = [n for n, k in zip(placeholders, traced.placeholder_kinds, strict=True) if k == "param"]
    for name, node in zip(traced.param_names, param_nodes, strict=True):
        assert tuple(node.meta["val"].shape) == tuple(unique[name].shape), name
    assert set(traced.buffer_names) == {n for n, _ in model.named_buffers()}
    assert traced.user_input_paths == ("args[0]", "kwargs['labels']")
    assert traced.graph_module is traced.exported.graph_module


def test_layers_are_found_and_every_layer_linear_has_its_index(traced_preset):
    name, config, _, _, _, traced = traced_preset
    assert traced.num_layers == config.num_hidden_layers == 2
    container = LAYER_CONTAINER[name]
    seen = set()
    for node in _ops(traced, *MATMULS):
        path = module_path_of(node)
        if path.startswith(container + "."):
            index = int(path[len(container) + 1 :].split(".")[0])
            assert layer_of(node) == (container, index), path
            seen.add(index)
        else:
            assert layer_of(node) == (None, None), path
    assert seen == {0, 1}
    assert any(layer_of(n) == (None, None) for n in _ops(traced, *MATMULS))  # the LM head


def test_loss_and_attention_are_single_ops(traced_preset):
    name, config, _, _, _, traced = traced_preset
    assert len(_ops(traced, SDPA)) == config.num_hidden_layers
    (loss,) = _ops(traced, CROSS_ENTROPY)
    assert layer_of(loss) == (None, None)
    # The output is a ModelOutput whose first leaf is the loss.
    first_output = next(iter(traced.exported.graph.output_node().args[0]))
    assert first_output is loss


@pytest.mark.integration
def test_llama_graph_has_rotary_buffers_and_real_numerics():
    config, model, args, kwargs, traced = _trace_preset("tiny-llama", "cpu")
    assert "model.rotary_emb.inv_freq" in traced.buffer_names
    assert traced.placeholder_kinds.count("param") == 21
    assert traced.param_aliases == ()
    model.eval()
    expected = model(*args, **kwargs).loss
    got = traced.exported.module()(*args, **kwargs).loss
    torch.testing.assert_close(got, expected)  # same ATen ops on the same inputs: float32 round-off only


def test_gpt2_tied_weights_are_one_placeholder_with_an_alias():
    config, model, args, kwargs, traced = _trace_preset("tiny-gpt2", "cpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert traced.param_aliases == (("lm_head.weight", "transformer.wte.weight"),)
    assert "lm_head.weight" not in traced.param_names and "transformer.wte.weight" in traced.param_names
    assert "lm_head.weight" not in traced.exported.state_dict
    placeholder_numel = sum(
        n.meta["val"].numel()
        for n, k in zip(_placeholders(traced), traced.placeholder_kinds, strict=True)
        if k == "param"
    )
    assert placeholder_numel == count_parameters(config)
    # The embedding and the head now read the same placeholder, and the program still computes the same loss.
    (wte,) = [n for n in _placeholders(traced) if n.name == "p_transformer_wte_weight"]
    assert {u.target for u in wte.users} >= {torch.ops.aten.embedding.default, LINEAR}
    model.eval()
    torch.testing.assert_close(traced.exported.module()(*args, **kwargs).loss, model(*args, **kwargs).loss)


def test_bert_tied_decoder_weight_and_bias_are_aliases():
    *_, traced = _trace_preset("tiny-bert", "meta")
    assert dict(traced.param_aliases) == {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }


@pytest.mark.integration
@pytest.mark.parametrize(
    "config_class",
    [transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config],
    ids=lambda c: c.__name__,
)
def test_grouped_query_attention_on_meta(config_class):
    config = config_class(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = build_model(config)
    args, kwargs = example_batch(config, 2, 16)
    traced = trace_model(model, args, kwargs)
    assert traced.num_layers == 3
    shapes = {n.target: n.meta["val"].shape for n in _placeholders(traced) if n.op == "placeholder"}
    k_proj = shapes["p_model_layers_0_self_attn_k_proj_weight"]
    assert tuple(k_proj) == (8, 32)  # 1 kv head of dim 32/4 = 8
    assert len(_ops(traced, SDPA)) == 3


def test_fake_inputs_trace():
    config = load_config("tiny-llama")
    model = build_model(config, device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.randint(0, config.vocab_size, (2, 16))
    traced = trace_model(model, (ids,), {"labels": ids})
    assert traced.num_layers == 2 and len(_ops(traced, SDPA)) == 2


@pytest.mark.integration
def test_llama2_7b_preset_traces_on_meta():
    config = load_config("llama2-7b", num_hidden_layers=2)
    model = build_model(config)
    args, kwargs = example_batch(config, 1, 128)
    traced = trace_model(model, args, kwargs)
    assert traced.num_layers == 2
    param_nodes = [n for n, k in zip(_placeholders(traced), traced.placeholder_kinds, strict=True) if k == "param"]
    assert sum(n.meta["val"].numel() for n in param_nodes) == count_parameters(config)
    (q,) = [n for n in _ops(traced, SDPA) if layer_of(n) == ("model.layers", 1)]
    assert tuple(q.meta["val"].shape) == (1, 32, 128, 128)


@pytest.mark.integration
def test_export_happens_in_the_mode_the_model_is_in():
    config = load_config("tiny-gpt2", resid_pdrop=0.1)
    model = build_model(config)
    args, kwargs = example_batch(config, 2, 8)

    def active_dropouts(traced):
        # aten.dropout(input, p, train): eval-mode dropout stays in the graph with train=False.
        return [n for n in _ops(traced, torch.ops.aten.dropout.default) if n.args[1] > 0 and n.args[2]]

    assert len(active_dropouts(trace_model(model, args, kwargs))) == 2 * config.n_layer
    model.eval()
    assert active_dropouts(trace_model(model, args, kwargs)) == []


@pytest.mark.parametrize(
    "path, expected",
    [
        ("model.layers.3", "model.layers.3"),
        ("L['self'].model.layers.3", "model.layers.3"),
        ("L['self']._modules['model']._modules['layers']._modules['3']", "model.layers.3"),
        ("getattr(L['self'].transformer.h, '0')", "transformer.h.0"),
        ("L['self'].bert.encoder.layer[11]", "bert.encoder.layer.11"),
        ("L['self']", ""),
        ("", ""),
    ],
)
def test_normalize_module_path(path, expected):
    assert normalize_module_path(path) == expected


def _node_with_stack(*paths: str) -> fx.Node:
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {f"key{i}": (p, "torch.nn.Module") for i, p in enumerate(paths)}
    return node


@pytest.mark.parametrize(
    "paths, layer, module",
    [
        (
            ("", "model", "L['self'].model.layers.3", "L['self'].model.layers.3.mlp"),
            ("model.layers", 3),
            "model.layers.3.mlp",
        ),
        (("transformer", "transformer.h.0"), ("transformer.h", 0), "transformer.h.0"),
        (("bert.encoder.layer.11", "bert.encoder.layer.11.output.dense"), ("bert.encoder.layer", 11), None),
        # An indexed module inside a layer (a Sequential MLP) belongs to the layer.
        (("model.layers.2", "model.layers.2.mlp.net.0"), ("model.layers", 2), "model.layers.2.mlp.net.0"),
        (("", "lm_head"), (None, None), "lm_head"),
        ((), (None, None), ""),
    ],
)
def test_layer_of_and_module_path_of(paths, layer, module):
    node = _node_with_stack(*paths)
    assert layer_of(node) == layer
    if module is not None:
        assert module_path_of(node) == module


class _Branchy(torch.nn.Module):
    def __init__(self, branch: bool):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.branch = branch

    def forward(self, x):
        if self.branch and x.sum() > 0:
            return self.proj(x)
        return x


class _Block(torch.nn.Module):
    def __init__(self, branch: bool):
        super().__init__()
        self.mlp = _Branchy(branch)

    def forward(self, x):
        return self.mlp(x) + x


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(False), _Block(True)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.mean()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_data_dependent_control_flow_names_the_submodule(device):
    with pytest.raises(TraceError) as info:
        trace_model(_Stack().to(device), (torch.randn(2, 4, device=device),))
    message = str(info.value)
    assert "data-dependent" in message
    assert "`layers.1.mlp`" in message and "torch.where/torch.cond" in message
    assert "x.sum() > 0" in message  # the offending source line
    assert info.value.__cause__ is not None


class _Holder:
    def __init__(self, t):
        self.t = t


class _ReturnsObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Holder(self.proj(x))


class _UsesNumpy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Sequential(torch.nn.Linear(4, 4), _ToNumpy())

    def forward(self, x):
        return self.head(x)


class _ToNumpy(torch.nn.Module):
    def forward(self, x):
        return torch.as_tensor(x.detach().numpy())


def test_a_non_pytree_output_is_a_trace_error():
    with pytest.raises(TraceError, match="not a tensor or a pytree"):
        trace_model(_ReturnsObject(), (torch.randn(2, 4),))


def test_an_unsupported_op_names_the_submodule():
    with pytest.raises(TraceError, match=r"unsupported operation in `head\.1` \(_ToNumpy\)"):
        trace_model(_UsesNumpy(), (torch.randn(2, 4),))


def test_example_inputs_must_be_a_tuple_and_kwargs_a_dict():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="tuple"):
        trace_model(model, {"x": torch.randn(2, 4)})
    with pytest.raises(ConfigError, match="dict"):
        trace_model(model, (torch.randn(2, 4),), [1])
    traced = trace_model(model, torch.randn(2, 4))
    assert traced.placeholder_kinds == ("param", "param", "input") and traced.num_layers == 0

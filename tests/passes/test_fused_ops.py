"""fuse_kernels_pass on tiny exported models: the ops it emits, the sites it skips, and unchanged numerics.

The kernels run in the Triton interpreter here (slow), so the models are tiny and each is traced once.
"""

from __future__ import annotations

import operator
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.export.graph_signature import InputKind

import autopar.triton_kernels  # noqa: F401  (registers the autopar:: ops)
from autopar.cost_model.compute import UNKNOWN_OPS, estimate_node_cost
from autopar.errors import ConfigError
from autopar.passes.fused_ops import FUSED_META_KEY, default_fusion, fuse_kernels_pass
from autopar.trace import trace_model
from tests.models import make_batch, make_model

aten = torch.ops.aten
autopar_ops = torch.ops.autopar
# fp32 throughout; the fused kernels sum in another order (online softmax over key blocks, blocked row
# reductions, chunked GEMMs), which moves results by a few ulp: measured up to ~1e-6 of the largest gradient.
# A wrong scale, mask, eps or ignore_index moves them by more than 1e-2.
REL_TOL = 1e-4


@dataclass
class Case:
    gm: fx.GraphModule  # rewritten by the pass
    params: list[torch.Tensor]
    others: list  # buffers, constants and user inputs after the parameters, in placeholder order
    ref_loss: torch.Tensor
    ref_grads: list[torch.Tensor]
    names: list[str]


def _placeholder_values(exported, user_inputs: list) -> tuple[list, list, list[str]]:
    params, others, names, user = [], [], [], iter(user_inputs)
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            params.append(exported.state_dict[spec.target].detach())
            names.append(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            others.append(next(user))
        elif spec.target in exported.state_dict:
            others.append(exported.state_dict[spec.target])
        else:
            others.append(exported.constants[spec.target])
    return params, others, names


def _loss_and_grads(run, params: list, others: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [p.clone().requires_grad_(True) for p in params]
    loss = run(*leaves, *others)[0]
    loss.backward()
    return loss.detach(), [p.grad for p in leaves]


def _case(module, args: tuple, kwargs: dict | None = None, **knobs) -> Case:
    traced = trace_model(module, args, kwargs)
    params, others, names = _placeholder_values(traced.exported, [*args, *(kwargs or {}).values()])
    gm = traced.graph_module
    ref_loss, ref_grads = _loss_and_grads(gm, params, others)  # the unrewritten graph
    fuse_kernels_pass(gm, args, **knobs)
    return Case(gm, params, others, ref_loss, ref_grads, names)


def _hf_case(name: str, attn: str = "sdpa", num_layers: int = 2) -> Case:
    model = make_model(name, num_layers=num_layers)
    model.config._attn_implementation = attn
    args, kwargs = make_batch(name, batch=2, seq=8)
    return _case(model.train(), args, kwargs)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _assert_same_numerics(case: Case, run=None) -> None:
    loss, grads = _loss_and_grads(run or case.gm, case.params, case.others)
    assert _rel_err(loss, case.ref_loss) < REL_TOL  # REL_TOL: summation order only (see its comment)
    for name, got, ref in zip(case.names, grads, case.ref_grads, strict=True):
        assert got is not None, f"{name} got no gradient through the fused graph"
        assert _rel_err(got, ref) < REL_TOL, name


def _calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.fixture(scope="module")
def llama() -> Case:
    return _hf_case("llama")


@pytest.fixture(scope="module")
def gpt2() -> Case:
    return _hf_case("gpt2")


@pytest.mark.integration
def test_llama_gqa_is_fused_and_numerics_hold(llama):
    report = llama.gm.meta[FUSED_META_KEY]
    assert report.counts == {"flash_attention": 2, "rms_norm": 5, "layer_norm": 0, "linear_cross_entropy": 1}
    assert report.skipped == ()
    for gone in (aten.scaled_dot_product_attention.default, aten.cross_entropy_loss.default, aten.rsqrt.default):
        assert not _calls(llama.gm, gone), gone
    flash = _calls(llama.gm, autopar_ops.flash_attention.default)
    assert all(n.args[3] is True for n in flash)  # HF's causal mask, built in the graph, was proven causal
    assert all(n.meta["nn_module_stack"] for n in flash)  # provenance kept for layer detection
    _assert_same_numerics(llama)


@pytest.mark.integration
def test_gpt2_is_fused_and_numerics_hold(gpt2):
    report = gpt2.gm.meta[FUSED_META_KEY]
    assert report.counts == {"flash_attention": 2, "rms_norm": 0, "layer_norm": 5, "linear_cross_entropy": 1}
    assert not _calls(gpt2.gm, aten.layer_norm.default)
    _assert_same_numerics(gpt2)


@pytest.mark.integration
def test_eager_attention_pattern_is_fused():
    case = _hf_case("llama", attn="eager", num_layers=1)  # one layer: the interpreted kernels are slow
    assert case.gm.meta[FUSED_META_KEY].counts["flash_attention"] == 1
    assert all(n.args[3] is True for n in _calls(case.gm, autopar_ops.flash_attention.default))
    assert not _calls(case.gm, aten.softmax.int)  # the s x s scores are gone
    assert not _calls(case.gm, aten.matmul.default)
    _assert_same_numerics(case)


@pytest.mark.integration
def test_fused_graph_runs_under_the_sharded_interpreter_on_one_rank(llama):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from autopar.passes.parallelize import ShardedInterpreter

    with tempfile.NamedTemporaryFile() as f:
        own_group = not dist.is_initialized()  # a one-rank group left by an earlier test serves as well
        if own_group:
            dist.init_process_group("gloo", store=dist.FileStore(f.name, 1), rank=0, world_size=1)
        assert dist.get_world_size() == 1, "this test needs a one-rank process group"
        try:
            mesh = DeviceMesh("cpu", torch.zeros(1, 1, dtype=torch.int), mesh_dim_names=("dp", "tp"))
            interp = ShardedInterpreter(llama.gm, mesh, {}, {})

            def run(*values):
                n = len(llama.params)
                params = [DTensor.from_local(p, mesh, (Replicate(), Replicate())) for p in values[:n]]
                return [o.to_local() for o in interp.run(*params, *values[n:])]

            _assert_same_numerics(llama, run)
            assert not [op for op in interp.fallback_ops if op.startswith("autopar")]  # ran per rank, not gathered
        finally:
            if own_group:
                dist.destroy_process_group()


def test_fused_ops_are_priced_by_the_cost_model(llama):
    UNKNOWN_OPS.clear()
    flash = _calls(llama.gm, autopar_ops.flash_attention.default)[0]
    for node in llama.gm.graph.nodes:
        estimate_node_cost(node)
    assert not [op for op in UNKNOWN_OPS if op.startswith("autopar")]
    q = flash.args[0].meta["val"]
    b, h, s, d = q.shape
    assert estimate_node_cost(flash).flops == 4 * b * h * s * s * d / 2  # causal


class _Attention(torch.nn.Module):
    """One SDPA call on projections of x, with the mask of `kind`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s)
        if self.kind == "band":  # each query sees its neighbours: not causal
            mask = (i[:, None] - i[None, :]).abs() <= 1
        elif self.kind == "causal_float":  # an additive causal mask built by hand
            mask = torch.zeros(s, s).masked_fill(i[None, :] > i[:, None], float("-inf"))
        dropout = 0.1 if self.kind == "dropout" else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return (out.square().mean(),)


def _x() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kind, reason",
    [("band", "arbitrary (non-causal) mask"), ("input", "depends on the graph input 'mask'"), ("dropout", "dropout")],
)
def test_inexpressible_attention_is_left_alone_with_a_reason(kind, reason):
    torch.manual_seed(0)
    module = _Attention(kind)
    args = (_x(), torch.rand(2, 1, 6, 6) > 0.5) if kind == "input" else (_x(),)
    traced = trace_model(module, args)
    gm = fuse_kernels_pass(traced.graph_module, args)
    report = gm.meta[FUSED_META_KEY]
    assert report.counts["flash_attention"] == 0
    assert len(_calls(gm, aten.scaled_dot_product_attention.default)) == 1
    (skipped,) = report.skipped
    assert skipped.kind == "attention" and reason in skipped.reason, skipped


@pytest.mark.integration
def test_additive_causal_mask_is_fused():
    torch.manual_seed(0)
    case = _case(_Attention("causal_float"), (_x(),))
    (flash,) = _calls(case.gm, autopar_ops.flash_attention.default)
    assert flash.args[3] is True
    assert not _calls(case.gm, aten.masked_fill.Scalar)  # the mask's computation is dead and removed
    _assert_same_numerics(case)


def test_knobs_turn_families_off():
    torch.manual_seed(0)
    traced = trace_model(_Attention("none"), (_x(),))
    gm = fuse_kernels_pass(traced.graph_module, None, attention=False)
    assert gm.meta[FUSED_META_KEY].counts["flash_attention"] == 0
    assert _calls(gm, aten.scaled_dot_product_attention.default)


def test_default_fusion():
    assert default_fusion("cpu") is False
    assert default_fusion("gpu") is True
    assert default_fusion("cuda:1") is True
    with pytest.raises(ConfigError, match="unknown device kind"):
        default_fusion("tpu")


def test_getitem_of_native_layer_norm_is_replaced():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.rand(16)), torch.nn.Parameter(torch.rand(16))

        def forward(self, x):
            return (torch.native_layer_norm(x, (16,), self.weight, self.bias, 1e-5)[0].square().mean(),)

    case = _case(Norm(), (_x(),))
    assert case.gm.meta[FUSED_META_KEY].counts["layer_norm"] == 1
    assert not _calls(case.gm, aten.native_layer_norm.default)
    assert all(n.args[0].target != aten.native_layer_norm.default for n in _calls(case.gm, operator.getitem))
    _assert_same_numerics(case)


def test_shifted_logits_with_log_softmax_and_nll_loss_are_fused():
    class ShiftedLoss(torch.nn.Module):  # the older Hugging Face loss: shift the logits, not the labels
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32, bias=False)

        def forward(self, x, labels):
            logits = self.head(torch.tanh(self.body(x)))[:, :-1].float()
            log_probs = F.log_softmax(logits, dim=-1).reshape(-1, 32)
            return (F.nll_loss(log_probs, labels[:, 1:].reshape(-1), ignore_index=-1),)

    torch.manual_seed(0)
    labels = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    labels[0, 3:] = -1
    case = _case(ShiftedLoss(), (_x(), labels))
    (fused,) = _calls(case.gm, autopar_ops.linear_cross_entropy.default)
    assert fused.args[3] == -1  # the loss's ignore_index
    assert fused.args[0].meta["val"].shape == (10, 16)  # hidden rows shifted like the logits: 2 x 5 tokens
    assert not _calls(case.gm, aten.log_softmax.int)
    _assert_same_numerics(case)


@pytest.mark.integration
@pytest.mark.parametrize("preset, norm", [("tiny-llama", "rms_norm"), ("tiny-gpt2", "layer_norm")])
def test_meta_device_presets_are_fused_with_masks_proven_in_blocks(preset, norm, monkeypatch):
    from autopar import presets
    from autopar.passes import fusion_masks
    from autopar.passes.fused_ops import fuse_traced, fusion_report

    # A mask this small goes in blocks only when the limit is lower: the path planning takes at 4k tokens
    monkeypatch.setattr(fusion_masks, "MAX_MASK_ELEMENTS", 100)
    config = presets.load_config(preset, num_hidden_layers=2)
    model = presets.build_model(config, device="meta", dtype=torch.bfloat16)
    args, kwargs = presets.example_batch(config, 3, 16, device="meta")
    traced = fuse_traced(trace_model(model.train(), args, kwargs))
    report = fusion_report(traced)
    assert report.skipped == ()
    assert {op: n for op, n in report.counts.items() if n} == {"flash_attention": 2, norm: 5, "linear_cross_entropy": 1}
    flash = _calls(traced.graph_module, autopar_ops.flash_attention.default)
    assert all(n.args[3] is True and n.meta["val"][0].device.type == "meta" for n in flash)  # proven causal
    # the exported program names the new output nodes (the loss is now a fused op's value)
    outputs = next(n for n in traced.graph_module.graph.nodes if n.op == "output").args[0]
    assert [s.arg.name for s in traced.exported.graph_signature.output_specs] == [n.name for n in outputs]
    assert fuse_traced(traced).graph_module is traced.graph_module  # fused once


def test_non_causal_mask_is_rejected_in_blocks(monkeypatch):
    from autopar.passes import fusion_masks

    monkeypatch.setattr(fusion_masks, "MAX_MASK_ELEMENTS", 8)  # the 6 x 6 band mask (and its broadcasts) go in blocks
    traced = trace_model(_Attention("band"), (_x(),))
    report = fuse_kernels_pass(traced.graph_module, None).meta[FUSED_META_KEY]
    assert report.counts["flash_attention"] == 0
    assert "arbitrary (non-causal) mask" in report.skipped[0].reason, report.skipped


class _TiledMask(torch.nn.Module):
    """SDPA under a boolean mask built by comparisons: causal, or causal but for one key far below the diagonal."""

    def __init__(self, hole: bool):
        super().__init__()
        self.hole = hole
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s)
        keep = i[None, :] <= i[:, None]
        if self.hole:  # query 50 does not see key 3
            keep = keep & ((i[:, None] != 50) | (i[None, :] != 3))
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=keep).square().mean(),)


@pytest.mark.parametrize("hole", [False, True])
def test_large_boolean_masks_are_proven_tile_by_tile(hole, monkeypatch):
    # A 64 x 64 mask with the whole-evaluation limit at 100 elements goes through the tile path: interval bounds
    # decide the tiles away from the diagonal, and only tiles across it (or, with the hole, the one holding it)
    # are evaluated. A causal mask must then evaluate O(seq · leaf side) elements, not seq²; a single blocked
    # score far below the diagonal must still be found.
    from autopar.passes import fusion_masks

    monkeypatch.setattr(fusion_masks, "MAX_MASK_ELEMENTS", 100)
    monkeypatch.setattr(fusion_masks, "_LEAF_ELEMENTS", 64)  # 8 x 8 leaves
    evaluated = []
    block = fusion_masks.MaskValue.block

    def counting_block(self, region):
        value = block(self, region)
        evaluated.append((region[-2].stop - region[-2].start) * (region[-1].stop - region[-1].start))
        return value

    monkeypatch.setattr(fusion_masks.MaskValue, "block", counting_block)
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0))
    traced = trace_model(_TiledMask(hole), (x,))
    report = fuse_kernels_pass(traced.graph_module, None).meta[FUSED_META_KEY]
    assert 0 < sum(evaluated) < 64 * 64 / 4, evaluated  # the tile path, not the row blocks
    if hole:
        assert report.counts["flash_attention"] == 0
        assert "arbitrary (non-causal) mask" in report.skipped[0].reason, report.skipped
    else:
        assert report.counts["flash_attention"] == 1 and report.skipped == ()
        # the 8 diagonal 8 x 8 leaves, whose interval bounds cannot decide them
        assert sum(evaluated) == 8 * 64, evaluated

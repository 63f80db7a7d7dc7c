"""Per-op FLOPs and bytes from exported graphs and hand-built nodes, and the roofline time."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autopar.cost_model import compute
from autopar.cost_model.compute import (
    AnalyticEstimator,
    OpCost,
    estimate_compute_time,
    estimate_node_cost,
    register_op_cost,
)
from autopar.cost_model.devices import DType, get_device
from tests.fx_nodes import call_node

aten = torch.ops.aten
BATCH, SEQ = 2, 16
# big enough that the matmuls dominate the elementwise work (O(h²) against O(h) per token)
LLAMA = dict(
    vocab_size=100,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    use_cache=False,
    attn_implementation="sdpa",
)


def _export(model: torch.nn.Module) -> fx.Graph:
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return torch.export.export(model.eval(), (ids,), {"labels": ids}, strict=False).graph


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    return model, _export(model)


def _calls(graph: fx.Graph, target) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target == target]


def _meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.integration
def test_linear_node_flops(llama):
    _, graph = llama
    q_proj = _calls(graph, aten.linear.default)[0]  # the first linear is layer 0's q_proj: [2,16,256] x [256,256]
    cost = estimate_node_cost(q_proj)
    m, k, n = BATCH * SEQ, 256, 256
    assert cost.flops == 2 * m * n * k
    assert cost.backward_flops == 2 * cost.flops
    assert cost.bytes_accessed == 4 * (m * k + n * k + m * n)
    assert cost.is_matmul and not cost.is_view


def test_sdpa_node_flops(llama):
    _, graph = llama
    (sdpa, *_) = _calls(graph, aten.scaled_dot_product_attention.default)
    heads, head_dim = 4, 64
    cost = estimate_node_cost(sdpa)
    # the export passes an explicit mask (not is_causal), so every score is computed
    assert cost.flops == 4 * BATCH * heads * SEQ * SEQ * head_dim
    assert cost.backward_flops == 2.5 * cost.flops


def test_causal_sdpa_halves():
    q = _meta(2, 4, 128, 64)
    full = estimate_node_cost(call_node(aten.scaled_dot_product_attention.default, (q, q, q), q))
    causal = estimate_node_cost(call_node(aten.scaled_dot_product_attention.default, (q, q, q), q, {"is_causal": True}))
    assert full.flops == 4 * 2 * 4 * 128 * 128 * 64
    assert causal.flops == full.flops / 2 and causal.backward_flops == full.backward_flops / 2


def test_embeddingcall_node(llama):
    _, graph = llama
    (emb,) = _calls(graph, aten.embedding.default)
    cost = estimate_node_cost(emb)
    out_bytes = BATCH * SEQ * 256 * 4
    assert cost.flops == 0
    assert cost.bytes_accessed == BATCH * SEQ * 8 + 2 * out_bytes  # int64 ids, then rows read and written
    assert cost.backward_flops == BATCH * SEQ * 256  # one add per gathered element into the gradient table


def test_llama_forward_flops_match_the_closed_form(llama):
    model, graph = llama
    layers, hidden = LLAMA["num_hidden_layers"], LLAMA["hidden_size"]
    tokens = BATCH * SEQ
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = layers * 4 * BATCH * SEQ * SEQ * hidden
    closed_form = 2 * linear_params * tokens + attention
    costs = [estimate_node_cost(n) for n in graph.nodes]
    matrix = sum(c.flops for c in costs if c.is_matmul)
    assert matrix == closed_form  # matmuls and attention alone are the closed form, exactly
    # The closed form counts no elementwise work: norms, rotary embeddings, SiLU, residual adds and
    # the loss add a few FLOPs per element of h- or vocabulary-sized rows, O(h) per token against the
    # O(h²) of the matmuls; at h = 256 that is 0.5%, so 3% leaves room without hiding a missing op.
    total = sum(c.flops for c in costs)
    assert closed_form <= total <= 1.03 * closed_form
    # "6 per parameter per token": forward + backward of the matmuls is three times the forward
    assert sum(c.flops + c.backward_flops for c in costs if c.is_matmul) == pytest.approx(
        6 * linear_params * tokens + 3.5 * attention
    )


def test_views_are_free_and_copies_are_not(llama):
    _, graph = llama
    for target in (aten.view.default, aten.transpose.int, aten.unsqueeze.default, aten.expand.default):
        for node in _calls(graph, target):
            assert estimate_node_cost(node).is_view
    reshapes = [estimate_node_cost(n) for n in _calls(graph, aten.reshape.default)]
    # GQA's expand-then-reshape and the reshape after the heads' transpose copy; the rest are views
    assert any(c.is_view for c in reshapes) and any(not c.is_view and c.bytes_accessed > 0 for c in reshapes)
    asserts = _calls(graph, aten._assert_tensor_metadata.default)
    assert asserts and all(estimate_node_cost(n).is_view for n in asserts)


def test_dtype_conversion_is_free_only_when_the_dtype_stays():
    x = _meta(8, 16)
    same = call_node(aten.to.dtype, (x, torch.float32), x)
    cast = call_node(aten.to.dtype, (x, torch.bfloat16), _meta(8, 16, dtype=torch.bfloat16))
    assert estimate_node_cost(same).is_view
    assert estimate_node_cost(cast).bytes_accessed == 8 * 16 * (4 + 2)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_other_architectures_have_no_unknown_ops(name):
    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=100,
                n_embd=32,
                n_layer=1,
                n_head=4,
                n_positions=32,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    else:
        model = BertForMaskedLM(
            BertConfig(
                vocab_size=100,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=32,
            )
        )
    graph = _export(model)
    compute.UNKNOWN_OPS.clear()
    costs = {n: estimate_node_cost(n) for n in graph.nodes}
    assert compute.UNKNOWN_OPS == set()
    if name == "gpt2":  # GPT-2's Conv1D is addmm(bias, x [32, 32], W [32, 3·32]) for the fused qkv
        addmm = _calls(graph, aten.addmm.default)[0]
        assert costs[addmm].flops == 2 * (BATCH * SEQ) * 96 * 32
    norm = _calls(graph, aten.layer_norm.default)[0]
    assert costs[norm].flops == 5 * BATCH * SEQ * 32


def test_unknown_op_falls_back_to_elementwise_and_is_recorded():
    x = _meta(4, 8)
    node = call_node(aten.erfinv.default, (x,), x)
    compute.UNKNOWN_OPS.discard(str(aten.erfinv.default))
    cost = estimate_node_cost(node)
    assert cost.flops == 32 and cost.bytes_accessed == 2 * 32 * 4 and not cost.is_view
    assert str(aten.erfinv.default) in compute.UNKNOWN_OPS


def test_register_op_cost(monkeypatch):
    monkeypatch.setattr(compute, "_REGISTRY", dict(compute._REGISTRY))

    @register_op_cost(aten.erfinv.default)
    def _erfinv(node):
        return OpCost(flops=7.0, bytes_accessed=1.0, backward_flops=0.0, backward_bytes=0.0)

    x = _meta(4, 8)
    assert estimate_node_cost(call_node(aten.erfinv.default, (x,), x)).flops == 7.0


def test_bmm_and_mm_flops():
    a, b = _meta(3, 5, 7), _meta(3, 7, 11)
    assert estimate_node_cost(call_node(aten.bmm.default, (a, b), _meta(3, 5, 11))).flops == 2 * 3 * 5 * 7 * 11
    assert (
        estimate_node_cost(call_node(aten.mm.default, (_meta(5, 7), _meta(7, 11)), _meta(5, 11))).flops
        == 2 * 5 * 7 * 11
    )


def test_roofline_hand_computed():
    h100 = get_device("H100-80GB")
    n = 4096
    gemm = OpCost(
        flops=2.0 * n**3,
        bytes_accessed=3 * n * n * 2,
        backward_flops=4.0 * n**3,
        backward_bytes=6 * n * n * 2,
        is_matmul=True,
    )
    compute_bound = 2.0 * n**3 / (989.4e12 * h100.matmul_efficiency)
    assert estimate_compute_time(gemm, h100, DType.BF16) == pytest.approx(compute_bound + 5e-6)
    assert estimate_compute_time(gemm, h100, DType.BF16, backward=True) == pytest.approx(2 * compute_bound + 5e-6)
    assert estimate_compute_time(gemm, h100, DType.BF16, divisor=4) == pytest.approx(compute_bound / 4 + 5e-6)
    add = OpCost(flops=1e8, bytes_accessed=1.2e9, backward_flops=0.0, backward_bytes=0.0)
    memory_bound = 1.2e9 / (3.35e12 * h100.memory_efficiency)
    assert estimate_compute_time(add, h100, DType.BF16) == pytest.approx(memory_bound + 5e-6)
    assert estimate_compute_time(add, h100, DType.BF16, backward=True) == 0.0  # nothing to do, no launch
    assert estimate_compute_time(compute.FREE, h100, DType.BF16) == 0.0


def test_analytic_estimator_prices_matmuls_in_the_graph_dtype():
    a100 = get_device("A100-80GB")
    n = 2048

    def mm(dtype):
        return call_node(
            aten.mm.default, (_meta(n, n, dtype=dtype), _meta(n, n, dtype=dtype)), _meta(n, n, dtype=dtype)
        )

    bf16 = AnalyticEstimator(a100, DType.BF16).forward_time_s(mm(torch.bfloat16), 1.0)
    fp32 = AnalyticEstimator(a100, DType.BF16).forward_time_s(mm(torch.float32), 1.0)
    tf32 = AnalyticEstimator(a100, DType.TF32).forward_time_s(mm(torch.float32), 1.0)
    # each at its own dtype's efficiency for this shape (bf16 has measured points; fp32 and tf32 the plateau)
    shape = (1, n, n, n)
    assert bf16 == pytest.approx(2 * n**3 / (312e12 * a100.matmul_efficiency_at("bf16", shape)) + 5e-6)
    # nothing autocasts an fp32 graph
    assert fp32 == pytest.approx(2 * n**3 / (19.5e12 * a100.matmul_efficiency_at("fp32", shape)) + 5e-6)
    assert tf32 == pytest.approx(2 * n**3 / (156e12 * a100.matmul_efficiency_at("tf32", shape)) + 5e-6)
    est = AnalyticEstimator(a100, "bf16")
    assert est.forward_time_s(mm(torch.bfloat16), 2.0) < bf16


def test_optimizer_step_time_counts_tensors_and_bytes():
    from autopar.cost_model.compute import estimate_optimizer_step_time

    kw = {"tensor_s": 40e-6, "s_per_param_byte": 2e-9}
    assert estimate_optimizer_step_time(0, 0, **kw) == 0
    assert estimate_optimizer_step_time(21, 4e5, **kw) == pytest.approx(21 * 40e-6 + 4e5 * 2e-9)
    with pytest.raises(ValueError):
        estimate_optimizer_step_time(-1, 0, **kw)


def test_analytic_adamw_step_is_memory_bound_with_launches_per_tensor():
    from autopar.cost_model.compute import AnalyticEstimator, estimate_adamw_step_time, optimizer_step_time_s

    cpu, a100 = get_device("cpu"), get_device("A100-80GB")
    # eager AdamW: 80 bytes read and written per 4-byte fp32 parameter, nine kernels per tensor
    nbytes = 4e6
    assert estimate_adamw_step_time(21, nbytes, cpu) == pytest.approx(
        21 * 9 * cpu.kernel_overhead_s + 20 * nbytes / (cpu.memory_bandwidth_bytes_per_s * cpu.memory_efficiency)
    )
    # on a GPU the foreach path launches each kernel for up to 36 tensors at once
    bw = a100.memory_bandwidth_bytes_per_s * a100.memory_efficiency
    assert estimate_adamw_step_time(36, nbytes, a100) == pytest.approx(9 * 5e-6 + 20 * nbytes / bw)
    est = AnalyticEstimator(cpu, "fp32")
    assert est.optimizer_step_time_s(21, nbytes) == estimate_adamw_step_time(21, nbytes, cpu)

    class OwnFigure:
        def optimizer_step_time_s(self, num_tensors, num_param_bytes):
            return num_tensors * 1.0 + num_param_bytes * 2.0

    assert optimizer_step_time_s(OwnFigure(), cpu, 3, 5.0) == 13.0  # the estimator's own figure wins
    assert optimizer_step_time_s(object(), cpu, 3, 5.0) == estimate_adamw_step_time(3, 5.0, cpu)


MOE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    use_cache=False,
    attn_implementation="sdpa",
)


def _moe_graph(experts: str, dtype: torch.dtype) -> fx.Graph:
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(**MOE, experts_implementation=experts)).to(dtype)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return torch.export.export(model, (ids,), {"labels": ids}, strict=False).graph


# bf16 on meta traces Hugging Face's default experts to aten._grouped_mm, fp32 to its fallback custom op
@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_matmuls_of_experts_cost_the_routed_top_k(dtype):
    graph = _moe_graph("grouped_mm", dtype)
    grouped = [n for n in graph.nodes if n.op == "call_function" and "grouped_mm" in str(n.target)]
    assert len(grouped) == 2  # gate_up then down
    routed = BATCH * SEQ * MOE["num_experts_per_tok"]  # (token, expert) pairs: 2 of 8 experts per token
    h, i = MOE["hidden_size"], MOE["intermediate_size"]
    compute.UNKNOWN_OPS.clear()
    costs = [estimate_node_cost(n) for n in grouped]
    assert not any("grouped_mm" in op for op in compute.UNKNOWN_OPS)
    assert [c.flops for c in costs] == [2 * routed * h * 2 * i, 2 * routed * i * h]
    assert all(c.is_matmul and c.backward_flops == 2 * c.flops for c in costs)


@pytest.mark.integration
def test_model_flops_of_experts_count_the_routed_experts_only():
    from autopar.flops import step_flops
    from autopar.ir import OpGraph
    from autopar.trace import trace_model

    tokens = BATCH * SEQ
    h, i, k, e = MOE["hidden_size"], MOE["intermediate_size"], MOE["num_experts_per_tok"], MOE["num_local_experts"]
    found = []
    for experts in ("grouped_mm", "batched_mm"):  # the two traceable implementations agree
        from transformers import MixtralConfig, MixtralForCausalLM

        with torch.device("meta"):
            model = MixtralForCausalLM(MixtralConfig(**MOE, experts_implementation=experts))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
        graph = OpGraph.from_traced(trace_model(model, (ids,), {"labels": ids}))
        found.append(step_flops(graph, tokens)[0])
        everything = sum(p.numel() for p in model.parameters())
    experts_params = 3 * h * i * e
    # all parameters at 6 FLOPs per token but the experts (k of e per token) and the untied input embedding
    dense = everything - experts_params - MOE["vocab_size"] * h
    attention = found[0] - 6 * dense * tokens - 6 * tokens * k * 3 * h * i
    assert found[0] == pytest.approx(found[1], rel=1e-12)
    # what is left is attention's score and value products alone: 4·b·h·s²·d (the model passes its causal mask,
    # which halves nothing), 3.5x with the backward; with all 8 experts charged it would be off by 6·tokens·6·3·h·i
    assert attention == pytest.approx(3.5 * 4 * BATCH * MOE["num_attention_heads"] * SEQ * SEQ * (h // 4), rel=1e-9)

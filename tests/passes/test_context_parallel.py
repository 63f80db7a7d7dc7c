"""Planning a pinned cp axis (`passes.context_parallel`): the mesh, the attention price, and refused pins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import ConfigError
from tests.models import VOCAB, MLPBlock, make_batch, make_model


def _plan(cluster: str, constraints: dict, batch: int = 4, seq: int = 16, **kw):
    args, kwargs = make_batch("llama", batch=batch, seq=seq)
    return autopar.plan(make_model("llama"), cluster, args, kwargs | kw, constraints=constraints)


@pytest.mark.integration
def test_pinned_cp_gives_a_dp_cp_tp_mesh_and_records_the_algorithm():
    plan = _plan("cpu:4", {"cp": 2, "dp": 2})
    assert plan.mesh == {"dp": 2, "cp": 2, "tp": 1}
    assert plan.program == "sharded"
    assert plan.global_batch_size == 4
    cp = plan.context_parallel
    assert cp["degree"] == 2 and cp["layout"] == "zigzag"
    priced = {line.split(":")[0]: line for line in cp["priced"]}
    assert set(priced) == {"allgather", "ring", "alltoall"}
    # unpinned, the algorithm is the cheapest priced
    ms = {a: float(line.split(": ")[1].split(" ms")[0]) for a, line in priced.items()}
    assert cp["algorithm"] == min(ms, key=ms.get)
    again = autopar.Plan.from_json(plan.to_json())
    assert again.context_parallel == cp and again.mesh == plan.mesh


@pytest.mark.integration
def test_pinned_algorithm_is_used_and_inapplicable_ones_say_why():
    plan = _plan("cpu:3", {"cp": 3, "cp_attention": "ring"}, seq=18)
    assert plan.context_parallel["algorithm"] == "ring"
    assert "alltoall: 4 heads not divisible by cp=3" in plan.context_parallel["priced"]


@pytest.mark.integration
def test_cp_halves_per_device_activations():
    # Every activation of the traced graph is per token (attention's are of the chunk's queries), so cp=2
    # holds half the tokens per device and, states aside, half the activation bytes. The masks the model
    # builds shrink more ((S/2)² per chunk), and what the cp algorithms keep besides q, k, v is not counted
    # yet: expect 0.5 within 0.4..0.6.
    one = _plan("cpu:1", {}, seq=64)
    two = _plan("cpu:2", {"cp": 2, "tp": 1}, seq=64)
    ratio = two.predicted.memory_breakdown["activations"] / one.predicted.memory_breakdown["activations"]
    assert 0.4 <= ratio <= 0.6, ratio


@pytest.mark.integration
@pytest.mark.parametrize("cp", [2, 4])
def test_model_flops_of_a_cp_plan_are_those_of_the_plan_without_cp(cp):
    # Model FLOPs do not depend on the layout. By hand (tiny LLaMA, `cost_model.compute`'s conventions): 6 per
    # matmul parameter per token (the untied input embedding is a lookup) plus, per layer, causal attention
    # over the whole sequence: forward 4·b·h·S²·d/2, backward 2.5x. The cp graph's attention runs on chunks
    # under a mask the model built from the chunk's shape (zig-zag chunks are not provably causal, so it stays
    # unfused), which must not count as a non-causal attention. On a GPU cluster, where the plan without cp
    # fuses its provably causal mask into a causal flash attention.
    batch, seq, layers, heads, head_dim, hidden = 4, 32, 2, 4, 16, 64
    args, kwargs = make_batch("llama", batch=batch, seq=seq)
    model = make_model("llama").to("meta")
    args, kwargs = (args[0].to("meta"),), {"labels": kwargs["labels"].to("meta")}
    cluster = f"{cp}xH100-80GB"
    none = autopar.plan(model, cluster, args, kwargs, constraints={"tp": 1}, alternatives=False)
    split = autopar.plan(model, cluster, args, kwargs, constraints={"cp": cp, "tp": 1}, alternatives=False)
    attention = layers * 3.5 * 4 * batch * heads * seq**2 * head_dim / 2
    by_hand = 6 * (none.num_parameters - VOCAB * hidden) * batch * seq + attention
    assert split.mesh["cp"] == cp and "cp" not in none.mesh
    assert split.tokens_per_step == none.tokens_per_step == batch * seq
    # the same integers summed in another order: equal to float rounding
    assert none.model_flops_per_step == pytest.approx(by_hand, rel=1e-12)
    assert split.model_flops_per_step == pytest.approx(by_hand, rel=1e-12)
    # what the cp program executes: the same matmuls and attention; only the elementwise ops the model builds
    # its mask with from the chunk's shape differ (0.03% here; counting the attention as unmasked is 5%)
    assert split.hardware_flops_per_step == pytest.approx(none.hardware_flops_per_step, rel=1e-3)
    assert 0 < split.predicted.mfu < 1


def test_cp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        _plan("cpu:4", {"cp": 3})


def test_sequence_not_divisible_by_two_cp_is_refused_with_the_layout_message():
    with pytest.raises(ConfigError, match="is not a multiple of 4. Pad the sequence to 16 tokens"):
        _plan("cpu:2", {"cp": 2}, seq=14)


@pytest.mark.integration
def test_alltoall_with_heads_not_divisible_is_refused():
    with pytest.raises(ConfigError, match="splits the 4 query heads over cp=3"):
        _plan("cpu:3", {"cp": 3, "cp_attention": "alltoall"}, seq=18)


def test_padding_mask_is_refused():
    with pytest.raises(ConfigError, match="padding attention_mask"):
        _plan("cpu:2", {"cp": 2}, attention_mask=torch.ones(4, 16, dtype=torch.long))


def test_algorithm_without_cp_is_refused():
    with pytest.raises(ConfigError, match="pin 'cp' too"):
        _plan("cpu:2", {"cp_attention": "ring"})


class _TokenModel(nn.Module):
    """Embedding, an optional token-mixing convolution, MLP blocks, a loss: no attention."""

    def __init__(self, conv: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.conv = nn.Conv1d(32, 32, 3, padding=1) if conv else None
        self.block = MLPBlock(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels, position_ids=None):
        x = self.embed(input_ids)
        if self.conv is not None:
            x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        logits = self.head(self.block(x))
        return (nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),)


@pytest.mark.parametrize(("conv", "match"), [(False, "none was found"), (True, "mix neighbouring tokens")])
def test_model_without_attention_or_with_a_convolution_is_refused(conv, match):
    ids = torch.randint(0, VOCAB, (4, 16))
    with pytest.raises(ConfigError, match=match):
        autopar.plan(_TokenModel(conv), "cpu:2", (ids,), {"labels": ids}, constraints={"cp": 2})


# ----------------------------------------------------------------------------- searching the cp degree


def _wide_llama(seq: int, heads: int = 8, kv_heads: int = 4, hidden: int = 1024):
    """A two-layer LLaMA wide enough that its activations, not its masks, set the memory (meta device)."""
    from autopar import presets

    config = presets.load_config(
        "tiny-llama",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=seq,
    )
    model = presets.build_model(config, device="meta", dtype=torch.bfloat16)
    return model, *presets.example_batch(config, 4, seq, device="meta")


def _search(model, args, kwargs, constraints=None, **kw):
    return autopar.plan(model, "4xH100-80GB", args, kwargs, constraints=constraints, alternatives=False, **kw)


# A per-device budget under which the wide model's 16K-token sequences fit on 4 GPUs only split by cp (checked
# below with cp pinned to 1, not assumed)
_TIGHT = "300MiB"


@pytest.mark.integration
def test_search_picks_cp_where_a_sequence_does_not_fit_without_it():
    from autopar.errors import InfeasiblePlanError

    model, args, kwargs = _wide_llama(16384)
    with pytest.raises(InfeasiblePlanError):
        _search(model, args, kwargs, {"cp": 1}, memory_budget=_TIGHT)
    plan = _search(model, args, kwargs, memory_budget=_TIGHT)
    assert plan.mesh.get("cp", 1) > 1
    assert plan.predicted.peak_memory_bytes <= autopar.parse_bytes(_TIGHT)
    search = {r["degree"]: r for r in plan.context_parallel["search"]}
    assert set(search) == {1, 2, 4}  # powers of two dividing 4 whose chunks are >= MIN_CP_CHUNK_TOKENS
    assert not search[1]["feasible"] and search[1]["reason"]
    chosen = search[plan.mesh["cp"]]
    assert chosen["feasible"] and chosen["step_time_s"] == plan.predicted.step_time_s
    assert all(r["step_time_s"] >= plan.predicted.step_time_s for r in search.values() if r["feasible"])


@pytest.mark.integration
def test_search_picks_no_cp_where_it_does_not_help():
    from autopar.cp_search import MIN_CP_CHUNK_TOKENS

    # 16K tokens and no memory pressure: every degree is priced, and splitting only adds attention's traffic
    model, args, kwargs = _wide_llama(16384)
    plan = _search(model, args, kwargs)
    assert "cp" not in plan.mesh
    search = {r["degree"]: r for r in plan.context_parallel["search"]}
    assert search[1]["step_time_s"] == plan.predicted.step_time_s
    assert any(r["feasible"] for d, r in search.items() if d > 1)  # priced, and slower
    assert all(r["step_time_s"] >= plan.predicted.step_time_s for r in search.values() if r["feasible"])
    # a sequence shorter than two chunks of MIN_CP_CHUNK_TOKENS: no degree is searched at all
    short = 2 * MIN_CP_CHUNK_TOKENS - 2048
    model, args, kwargs = _wide_llama(short)
    plan = _search(model, args, kwargs, memory_budget=_TIGHT)
    assert "cp" not in plan.mesh and plan.context_parallel == {}


@pytest.mark.integration
def test_search_never_runs_ulysses_where_the_heads_do_not_divide():
    # 6 query heads: all-to-all applies at cp=2 but not at cp=4, which the tight budget needs
    model, args, kwargs = _wide_llama(16384, heads=6, kv_heads=3, hidden=768)
    plan = _search(model, args, kwargs, memory_budget="200MiB")
    assert plan.mesh.get("cp") == 4
    assert plan.context_parallel["algorithm"] != "alltoall"
    assert "alltoall: 6 heads not divisible by cp=4" in plan.context_parallel["priced"]
    for r in plan.context_parallel["search"]:
        if r["feasible"] and 6 % r["degree"]:
            assert r["algorithm"] != "alltoall", r


@pytest.mark.integration
def test_allgather_keeps_the_gathered_kv_of_every_layer():
    # The same layout with all-gather and with ring: all-gather keeps each layer's gathered K/V from forward to
    # backward, ring keeps nothing beyond its own q, k, v and output. By hand: 2 layers x K and V of the whole
    # sequence for the rank's sequences of one micro-batch, 2·b·h_kv·S·d bytes of bf16, with h_kv the 8 heads
    # SDPA gets (Hugging Face repeats the 4 K/V heads before it, and the cp attention gathers what SDPA gets).
    seq, layers, kv_heads, head_dim = 16384, 2, 8, 128
    model, args, kwargs = _wide_llama(seq)
    pins = {"cp": 4, "dp": 1, "tp": 1, "num_microbatches": 2, "recompute": "none", "zero": 0}
    gather = _search(model, args, kwargs, pins | {"cp_attention": "allgather"}, memory_budget=float("inf"))
    ring = _search(model, args, kwargs, pins | {"cp_attention": "ring"}, memory_budget=float("inf"))
    per_microbatch = 4 // 2  # sequences: batch 4 on dp=1, two micro-batches
    kv = 2 * per_microbatch * kv_heads * seq * head_dim * 2
    extra = gather.predicted.memory_breakdown["activations"] - ring.predicted.memory_breakdown["activations"]
    assert extra == pytest.approx(layers * kv, rel=1e-9)  # the same layout otherwise: exact but for float sums


@pytest.mark.integration
def test_search_plans_a_model_cp_cannot_split_without_cp():
    # A token-mixing convolution: the searched degree is refused with the reason, and the plan has no cp axis
    ids = torch.randint(0, VOCAB, (4, 8192))
    plan = autopar.plan(_TokenModel(conv=True), "2xH100-80GB", (ids,), {"labels": ids}, alternatives=False)
    assert "cp" not in plan.mesh
    search = {r["degree"]: r for r in plan.context_parallel["search"]}
    assert search[1]["feasible"] and search[1]["step_time_s"] == plan.predicted.step_time_s
    assert not search[2]["feasible"] and "mix neighbouring tokens" in search[2]["reason"]


@pytest.mark.integration
def test_cp_graph_builds_no_chunk_mask():
    from autopar import tracing
    from tests.models import make_batch, make_model

    # 96 tokens over cp=2: each traced row is one rank's 48 tokens, so the model's mask would be 48 x 48 (no
    # other size of the tiny model is 48)
    model = make_model("llama")
    args, kwargs = tracing.cp_traced_batch(model, *make_batch("llama", batch=2, seq=96), 2)

    def square(traced):
        return [
            n.name
            for n in traced.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape[-2:]) == (48, 48)
        ]

    assert square(tracing.trace_in_format(model, args, kwargs, "fp32"))  # traced as is, the model builds it
    traced = tracing.trace_in_format(model, args, kwargs, "fp32", cp=2)
    assert square(traced) == []
    attn = [
        n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default
    ]
    assert len(attn) == 2
    for n in attn:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = n.kwargs | dict(zip(names[: len(n.args)], n.args, strict=True))
        assert bound.get("attn_mask") is None and bound["is_causal"] is True


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
def test_cp_communication_is_a_term_of_its_own(algorithm):
    # The step's cp term is what cp attention's compute does not hide of its communication, per layer and
    # micro-batch by `estimate_cp_attention` (priced here again on the plan's own cp trace), times the layers and
    # micro-batches; what it hides is the cp axis's hidden communication. Both leave compute: the terms still sum
    # to the step.
    from autopar import tracing
    from autopar.ir import OpGraph
    from autopar.passes.context_parallel import CPSpec, check_cp_graph, price_cp_attention
    from autopar.rationale import TERMS

    batch, seq, layers, m = 4, 4096, 2, 2
    model, args, kwargs = _wide_llama(seq)
    pins = {"cp": 4, "dp": 1, "tp": 1, "num_microbatches": m, "recompute": "none", "zero": 0, "cp_attention": algorithm}
    plan = _search(model, args, kwargs, pins, memory_budget=float("inf"), fuse_kernels=False)
    traced = tracing.trace_in_format(model, *tracing.cp_traced_batch(model, args, kwargs, 4), "bf16", cp=4)
    spec = CPSpec.from_constraints(pins, 4)
    attention = check_cp_graph(OpGraph.from_traced(traced).graph, spec)
    pricing = price_cp_attention(attention, plan.cluster, spec, data=4, tp=1, num_microbatches=m, precision="bf16")
    cost = pricing.cost(attention[0], batch // m)  # a rank's sequences of one micro-batch (dp=1)
    assert len(attention) == layers
    terms = plan.time_breakdown
    assert set(terms) == set(TERMS)
    # the same float products summed in another order
    assert terms["comm_cp"] == pytest.approx(layers * m * cost.exposed_comm_s, rel=1e-9)
    hidden = layers * m * (cost.comm_s - cost.exposed_comm_s)
    assert plan.hidden_communication.get("comm_cp", 0.0) == pytest.approx(hidden, rel=1e-9, abs=1e-15)
    assert sum(terms.values()) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert terms["comm_cp"] > 0
    if algorithm == "ring":  # its hops run behind the blocks they feed: some of its traffic hides
        assert plan.hidden_communication["comm_cp"] > 0

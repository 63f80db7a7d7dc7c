"""Activation recompute at run time: checkpointed segments give the gradients of the plain program."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.passes.recompute import recompute_segments
from autopar.runtime import OffloadProgram, ShardedProgram, ensure_process_group
from autopar.trace import trace_model
from tests.models import make_batch, make_model

# fp32 on one CPU rank: recompute runs the same ops on the same values, so gradients agree to the
# last bits; a tolerance of 1e-6 leaves room for a kernel picking another summation order.
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5


def _grads(name: str, recompute: str, **pins):
    """(program, loss, gradients by parameter name) after one step of a `recompute` plan on one rank.

    Both modes run on DTensors through the sharded program (compile would give a plan without recompute
    the plain data-parallel program), so the two runs differ in recompute only.
    """
    model = make_model(name)
    args, kwargs = make_batch(name)
    traced = trace_model(model, args, kwargs)
    plan = autopar.plan(model, "cpu:1", args, kwargs, constraints={"recompute": recompute, **pins}, _traced=traced)
    if plan.num_microbatches > 1:  # compile traces the graph again at the micro-batch size
        assert recompute != "none"
        pm = autopar.compile(model, "cpu:1", args, kwargs, plan=plan, optimizer=_no_step)
    else:
        ensure_process_group(plan.cluster)
        pm = ShardedProgram(model, plan, traced, plan.cluster, optimizer=_no_step)
    loss = pm.train_step(*args, **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in zip(pm._param_names, pm.shards, strict=True) if p.grad is not None}
    return pm, loss, grads


def _no_step(params):
    return torch.optim.SGD(params, lr=0.0)


def _eager_grads(name: str) -> dict:
    model = make_model(name)
    args, kwargs = make_batch(name)
    model(*args, **kwargs).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "mode"), [("llama", "full"), ("llama", "selective"), ("gpt2", "full"), ("bert", "selective")]
)
def test_recompute_gives_the_same_gradients(name, mode):
    plain, plain_loss, plain_grads = _grads(name, "none")
    pm, loss, grads = _grads(name, mode)
    assert pm.plan.recompute == mode and plain.plan.recompute == "none"
    segments = pm._interp.segments
    assert len(segments) == 2  # one per layer of the two-layer models
    # every segment ran in forward and once more in backward; the plain program ran none
    assert pm._interp.segment_calls == 2 * len(segments)
    assert plain._interp.segment_calls == 0 and not plain._interp.segments
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert grads.keys() == plain_grads.keys() and len(grads) == len(list(pm.parameters()))
    for key, ref in plain_grads.items():
        torch.testing.assert_close(grads[key], ref, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, k=key: f"{k}: {m}")
    # and both are the eager model's gradients (DTensor may sum in another order: rounding-level differences)
    for key, ref in _eager_grads(name).items():
        torch.testing.assert_close(grads[key], ref, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.integration
def test_recompute_with_micro_batches_recomputes_each():
    pm, _, grads = _grads("llama", "full", num_microbatches=2)
    assert pm.plan.num_microbatches == 2 and pm.plan.recompute == "full"
    assert pm._interp.segment_calls == 2 * 2 * len(pm._interp.segments)
    # accumulated over the micro-batches, weighted by their kept labels: the whole batch's gradient
    for key, ref in _eager_grads("llama").items():
        torch.testing.assert_close(grads[key], ref, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.integration
def test_segments_hold_their_layers():
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    graph = trace_model(model, args, kwargs).exported.graph
    full, selective = recompute_segments(graph, "full"), recompute_segments(graph, "selective")
    assert len(full) == len(selective) == 2
    ops = {str(n.target) for n in graph.nodes if n.name in set(selective[0])}
    assert "aten.scaled_dot_product_attention.default" in ops
    assert "aten.linear.default" not in ops  # the projections are kept, not recomputed
    assert set(selective[0]) < set(full[0])
    assert recompute_segments(graph, "none") == ()


@pytest.mark.integration
def test_per_layer_treatments_give_the_same_gradients():
    """A plan that offloads one layer's activations and recomputes two others (one whole, one its attention)
    gives the gradients of the plan that keeps everything; the offloaded tensors went out and came back."""
    model = make_model("llama", num_layers=4)
    args, kwargs = make_batch("llama")
    traced = trace_model(model, args, kwargs)
    plain = autopar.plan(model, "cpu:1", args, kwargs, constraints={"recompute": "none"}, _traced=traced)
    assert not plain.layer_modes
    mixed = dataclasses.replace(plain, recompute="full", layer_modes={"offload": (0,), "full": (1,), "selective": (2,)})
    mixed = autopar.Plan.from_json(mixed.to_json())  # the treatments survive the plan file
    ensure_process_group(plain.cluster)
    results = []
    for plan in (plain, mixed):
        pm = ShardedProgram(make_model("llama", num_layers=4), plan, traced, plan.cluster, optimizer=_no_step)
        loss = pm.train_step(*args, **kwargs)
        grads = {n: p.grad.detach().clone() for n, p in zip(pm._param_names, pm.shards, strict=True)}
        results.append((pm, loss, grads))
    (_, plain_loss, plain_grads), (pm, loss, grads) = results
    interp = pm._interp
    assert len(interp.segments) == 2  # layer 1 whole, layer 2's attention
    assert interp.segment_calls == 2 * 2
    off = interp.activation_offload
    assert off.packed > 0 and off.unpacked == off.packed  # every saved tensor of layer 0 went to the host and back
    assert off.peak_host_bytes > 0 and off.host_bytes == 0  # released with the autograd graph
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for key, ref in plain_grads.items():
        torch.testing.assert_close(grads[key], ref, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.integration
def test_offload_program_applies_the_layer_treatments():
    """The host-offload program runs the model eagerly: its layers are checkpointed or offloaded as the plan
    says, with the chunk scheduler gathering parameters again for a recomputed forward, and trains as the
    untreated program does."""
    # small chunks, so that a layer's chunks are released after its forward and must be gathered again
    # for its recompute in backward
    CHUNK = 8192  # noqa: N806
    model = make_model("llama", num_layers=4)
    args, kwargs = make_batch("llama")
    plain = autopar.plan(model, "cpu:1", args, kwargs, constraints={"recompute": "none", "tp": 1}, offload=True)
    assert plain.offload and not plain.layer_modes
    mixed = dataclasses.replace(plain, recompute="full", layer_modes={"offload": (0,), "full": (1,), "selective": (3,)})
    ensure_process_group(plain.cluster)
    runs = []
    for plan in (plain, mixed):
        pm = OffloadProgram(make_model("llama", num_layers=4), plan, None, plan.cluster, chunk_numel=CHUNK)
        runs.append((pm, [pm.train_step(*args, **kwargs) for _ in range(3)]))
    (plain_pm, plain_losses), (pm, losses) = runs
    assert pm.checkpointed == ["model.layers.1", "model.layers.3.self_attn"] and not plain_pm.checkpointed
    assert pm.store.num_chunks > 8
    assert pm.activation_offload.packed > 0 and pm.activation_offload.unpacked == pm.activation_offload.packed
    # the same ops on the same values, AdamW on the same chunks: equal up to summation order
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for key, ref in plain_pm.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], ref, atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")

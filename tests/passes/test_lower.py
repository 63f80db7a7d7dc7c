"""The lowering pass: a tiny traced model lowered to local ops and explicit collectives, its ops and collectives
counted, its loss and gradients checked against the unrewritten graph (one rank, and two gloo ranks on a tensor
axis of 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.lower import Convert, TensorAxis, local_shape, lower_pass, op_grad_layout
from autopar.passes.program_graph import copy_graph_module
from autopar.passes.sharding_rules import placement_str, strategies_for
from autopar.trace import trace_model
from tests.distributed.harness import for_this_run, run_distributed

VOCAB, HIDDEN, FFN = 16, 8, 32
# fp32: the lowered graph runs the same ops on pieces of the same tensors; a tensor axis sums partial matmuls in
# another order than one process, ~1e-7 relative. A missing or doubled reduction is off by a factor.
RTOL, ATOL = 1e-5, 1e-6


class Tiny(nn.Module):
    """An embedding, a norm, an MLP (column- then row-parallel on a tensor axis) and a residual."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, ids):
        h = self.embed(ids)
        y = self.down(nn.functional.gelu(self.up(self.norm(h))))
        return (h + y).pow(2).mean()


def _traced():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    return model, ids, trace_model(model, (ids,))


class _Hooks:
    """Parameter hooks that record each call and hand the value on."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def enter(self, i, x):
        self.calls.append(("enter", i))
        return x

    def gather(self, i, x):
        self.calls.append(("gather", i))
        return x


def _param_index(traced) -> dict[str, int]:
    names = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    params = [n for n, kind in zip(names, traced.placeholder_kinds, strict=True) if kind == "param"]
    return {name: i for i, name in enumerate(params)}


def _reference(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _lower(traced, axis, hooks, node_inputs=None, node_output=None, param_placements=None, **knobs):
    index = _param_index(traced)
    return lower_pass(
        copy_graph_module(traced.graph_module),
        None,
        axis=axis,
        node_inputs=node_inputs or {},
        node_output=node_output or {},
        param_placements=param_placements or {},
        params=index,
        hooks=hooks,
        replicated_outputs=(0,),
        **knobs,
    )


def test_one_rank_runs_the_graph_with_a_hook_at_each_first_read_and_each_use():
    model, ids, traced = _traced()
    index = _param_index(traced)
    split = frozenset(n for n in index if "up" in n)  # as if ZeRO split the up projection over the data axis
    hooks = _Hooks()
    gm = _lower(traced, TensorAxis(None, 1, 0), hooks, split_params=split)
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    (loss,) = gm(*params, ids)
    loss.backward()
    ref_loss, ref_grads = _reference(model, ids)
    assert not any(isinstance(m, Convert) for m in gm.modules())  # one rank: no collective
    # every parameter enters once, where it is first read; a split one is gathered at each of its (one) uses
    assert sorted(i for kind, i in hooks.calls if kind == "enter") == list(range(len(index)))
    assert sorted(i for kind, i in hooks.calls if kind == "gather") == sorted(index[n] for n in split)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)  # the same ops on the same values
    for p, (name, ref) in zip(params, ref_grads.items(), strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=0, atol=0, msg=name)


def test_recompute_segments_become_checkpointed_regions():
    from autopar.runtime.base import placeholder_values  # noqa: F401 - the program's own way of binding values
    from tests.models import make_batch, make_model

    model = make_model("llama")
    args, kwargs = make_batch("llama")
    traced = trace_model(model, args, kwargs)
    gm = _lower(traced, TensorAxis(None, 1, 0), _Hooks(), recompute="full")
    record = gm.meta["autopar_lowering"]
    regions = [name for name, _ in gm.named_children() if name.startswith("checkpoint")]
    assert len(record.segments) == len(regions) == 2  # one per layer of the two-layer model
    assert record.params_in_segments and all("layers" in n for n in record.params_in_segments)


def test_gradient_layouts():
    s1 = Shard(1)
    assert op_grad_layout(s1, Partial()) == s1  # a split argument's gradient comes back split
    assert op_grad_layout(Partial(), Partial()) == Replicate()  # each summand's gradient is the sum's
    assert op_grad_layout(Replicate(), Replicate()) == Replicate()
    assert op_grad_layout(Replicate(), s1).is_partial()  # each rank differentiates its piece of the output
    assert local_shape((4, 6, 32), Shard(2), 2) == [4, 6, 16]


def _plan(traced) -> tuple[dict, dict, dict]:
    """A Megatron layout of `Tiny` on a tensor axis of 2: vocabulary-parallel embedding, column- then row-parallel
    MLP (its gelu split like its input), everything else replicated."""
    chosen = {"embedding": "vocab parallel", "linear": "column parallel", "linear_1": "row parallel"}
    node_inputs, node_output = {}, {}
    for n in traced.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        strategies = strategies_for(n, 2)
        if n.name in chosen:
            s = next(s for s in strategies if s.name == chosen[n.name])
        elif n.name == "gelu":
            s = next(s for s in strategies if s.inputs == (Shard(2),))
        else:
            s = strategies[0]
        node_inputs[n.name] = [placement_str(p) for p in s.inputs]
        node_output[n.name] = placement_str(s.output)
    params = {"p_embed_weight": "S(0)", "p_up_weight": "S(0)", "p_up_bias": "S(0)", "p_down_weight": "S(1)"}
    return node_inputs, node_output, params


def _two_ranks(rank: int, world: int):
    from autopar import compat

    model, ids, traced = _traced()
    node_inputs, node_output, placements = _plan(traced)
    group = torch.distributed.new_group([0, 1])
    counted = []
    for name in ("funcol_all_reduce", "funcol_all_gather", "funcol_reduce_scatter"):
        real = getattr(compat, name)
        for_this_run(compat, name, lambda *a, real=real, name=name, **k: counted.append(name) or real(*a, **k))
    gm = _lower(
        traced,
        TensorAxis(group, world, rank),
        _Hooks(),
        node_inputs=node_inputs,
        node_output=node_output,
        param_placements=placements,
        launch_early=False,
    )
    local = []
    for name, p in zip(_param_index(traced), model.parameters(), strict=True):
        pl = placements.get(name)
        piece = p.detach().chunk(world, int(pl[2]))[rank] if pl else p.detach()
        local.append(piece.clone().requires_grad_())
    (loss,) = gm(*local, ids)
    forward = list(counted)
    loss.backward()
    record = gm.meta["autopar_lowering"]
    return {
        "loss": loss.detach(),
        "grads": [p.grad for p in local],
        "forward": forward,
        "backward": counted[len(forward) :],
        "record": (record.forward_collectives, record.backward_collectives, record.replicated),
    }


@pytest.mark.distributed
def test_two_ranks_run_the_plan_with_one_collective_per_placement_change():
    got = run_distributed(_two_ranks, 2)
    model, ids, traced = _traced()
    _, _, placements = _plan(traced)
    ref_loss, ref_grads = _reference(model, ids)
    for rank, res in enumerate(got):
        # forward: the embedding's masked partial sum made whole for each of its two readers (the norm and the
        # residual), the row-parallel projection's partial sum for the residual; backward: the column-parallel
        # projection's input gradient (each rank's partial sum) summed
        assert res["forward"] == ["funcol_all_reduce"] * 3, res["forward"]
        assert res["backward"] == ["funcol_all_reduce"], res["backward"]
        assert res["record"] == (3, 1, ())
        torch.testing.assert_close(res["loss"], ref_loss, rtol=RTOL, atol=ATOL)
        for name, grad, ref in zip(_param_index(traced), res["grads"], ref_grads.values(), strict=True):
            pl = placements.get(name)
            want = ref.chunk(2, int(pl[2]))[rank] if pl else ref
            torch.testing.assert_close(grad, want, rtol=RTOL, atol=ATOL, msg=name)

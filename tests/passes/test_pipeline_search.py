"""Planner tests of the pipeline search on the meta device: stage views, cuts, pins, and the choice of pp."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from autopar import tracing
from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.input_validation import resolve_estimator
from autopar.ir import OpGraph
from autopar.passes.pipeline.layers import layer_structure, stage_view
from autopar.passes.pipeline.schedules import Schedule, activation_copies, bubble_fraction
from autopar.passes.pipeline.search import search_pipeline
from autopar.passes.pipeline.solution import PipelineSolution
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.program import ShardingProgram
from autopar.trace import trace_model
from tests.models import MLPBlock, make_batch, tiny_llama


class Stack(nn.Module):
    """Embedding, identical blocks, a head and a loss: the shape of a language model."""

    def __init__(self, hidden: int, num_layers: int, vocab: int = 1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(MLPBlock(hidden) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().logsumexp(-1).mean()


def _stack_graph(hidden: int, num_layers: int, batch: int, seq: int) -> OpGraph:
    with torch.device("meta"):
        model = Stack(hidden, num_layers).to(torch.bfloat16)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return OpGraph.from_traced(trace_model(model, (ids,), {}))


def _search(graph: OpGraph, cluster: str, batch: int, **kw) -> PipelineSolution:
    spec = ClusterSpec.parse(cluster)
    return search_pipeline(
        graph, spec, estimator=resolve_estimator(None, spec, "bf16"), precision="bf16", batch_size=batch, **kw
    )


# A 4.3B-parameter stack (69 GB of model states) on two nodes of 40 GB A100s joined by HDR InfiniBand:
# one node cannot hold it, and data parallelism across nodes pays the slow link for every gradient. Searched
# without overlap (reductions after backward): with it, the sharded program hides most of that link behind
# compute and one stage at dp=2 x tp=8 wins (seen: 148 ms against the best pipeline's 159 ms).
BIG = dict(hidden=8192, num_layers=8, batch=16, seq=1024)
BIG_CLUSTER = "2x8xA100-40GB"


@pytest.fixture(scope="module")
def big_graph() -> OpGraph:
    return _stack_graph(**BIG)


@pytest.fixture(scope="module")
def big_solution(big_graph) -> PipelineSolution:
    return _search(big_graph, BIG_CLUSTER, BIG["batch"], constraints={"overlap": False})


def _program_result(graph: OpGraph, cluster: ClusterSpec, dp: int, tp: int, batch: int, m: int = 1):
    est = resolve_estimator(None, cluster, "bf16")
    prog = ShardingProgram(
        graph,
        cluster,
        dp,
        tp,
        estimator=est,
        precision=Precision.get("bf16"),
        zero_stage=None,
        memory_budget_bytes=float("inf"),
        batch_dim_size=batch,
        num_microbatches=m,
    )
    prog.build()
    return prog.solve(stage=0, memory=False), len(prog.groups)


@pytest.mark.integration
@pytest.mark.parametrize("shortened", [False, True])
def test_stage_view_with_every_layer_prices_like_the_whole_graph(shortened):
    cluster = ClusterSpec.parse("2x8xA100-80GB")
    if shortened:  # 2 traced layers standing for 4
        module = tiny_llama(num_layers=4).to("meta")
        (ids,), kw = make_batch("llama", batch=16, seq=32)
        graph = tracing.trace_shortened(module, (ids.to("meta"),), {"labels": kw["labels"].to("meta")}, lambda m: None)
        assert graph is not None and graph.repeats
        batch = 16
    else:
        graph, batch = _stack_graph(256, 3, 16, 64), 16
    structure = layer_structure(graph, batch)
    assert structure is not None and structure.num_layers == graph.num_layers
    view = stage_view(graph, structure, structure.num_layers, first=True, last=True)
    for dp, tp, m in [(16, 1, 1), (4, 4, 2), (2, 8, 1)]:
        whole, groups = _program_result(graph, cluster, dp, tp, batch, m)
        staged, view_groups = _program_result(view, cluster, dp, tp, batch, m)
        assert groups == view_groups
        assert staged.step_time_s == pytest.approx(whole.step_time_s, rel=1e-12)
        assert staged.memory == pytest.approx(whole.memory, rel=1e-12)


def test_stage_views_split_the_model():
    """Two stages price the layers once in all, the embedding on the first only, the head on the last only."""
    graph, batch = _stack_graph(256, 4, 16, 64), 16
    s = layer_structure(graph, batch)
    views = [stage_view(graph, s, 3, first=True, last=False), stage_view(graph, s, 1, first=False, last=True)]
    counts = [v.layer_count for v in views]
    embed = next(n for n, p in graph.params.items() if p.name == "embed.weight")
    head = next(n for n, p in graph.params.items() if p.name == "head.weight")
    layer = next(n for n, p in graph.params.items() if p.name == "layers.0.up.weight")
    assert [c[embed] for c in counts] == [1, 0]
    assert [c[head] for c in counts] == [0, 1]
    assert [c[layer] for c in counts] == [3, 1]
    assert s.boundary_bytes_per_sample == 64 * 256 * 2  # one bf16 hidden state per token


@pytest.mark.integration
def test_pipeline_where_the_model_outgrows_a_node_and_the_network_is_slow(big_solution):
    sol = big_solution
    assert sol.pp > 1
    assert sol.single_stage_step_time_s is not None and sol.step_time_s < sol.single_stage_step_time_s
    assert sol.pp * sol.dp * sol.tp == ClusterSpec.parse(BIG_CLUSTER).world_size
    assert all(st.peak_memory_bytes <= ClusterSpec.parse(BIG_CLUSTER).device.memory_bytes for st in sol.stages)
    assert sum(st.num_layers for st in sol.stages) == BIG["num_layers"]
    assert sol.stages[0].first and sol.stages[-1].last
    assert sol.bubble_fraction == pytest.approx(
        bubble_fraction(sol.schedule, sol.pp, sol.num_microbatches, sol.virtual_stages)
    )
    assert all(st.sharding is not None for st in sol.stages)


@pytest.mark.integration
def test_no_pipeline_when_the_model_fits_a_node_with_a_fast_network():
    graph = _stack_graph(1024, 4, 32, 512)
    sol = _search(graph, "8xH100-80GB", 32)
    assert sol.pp == 1 and sol.schedule is None
    assert sol.step_time_s == sol.single_stage_step_time_s
    assert sol.stages[0].layers == ((0, 4),)


@pytest.mark.integration
def test_uniform_layers_give_balanced_stages(big_graph):
    sol = _search(big_graph, BIG_CLUSTER, BIG["batch"], constraints={"pp": 4, "schedule": "1f1b"})
    assert [st.num_layers for st in sol.stages] == [2, 2, 2, 2]
    times = [st.time_per_microbatch_s for st in sol.stages]
    mean = sum(times) / len(times)
    # the embedding and the head make the end stages slower; with 8 layers on 4 stages there is no better cut
    assert max(times) <= 1.10 * mean


@pytest.mark.integration
def test_uneven_layer_count():
    graph = _stack_graph(1024, 5, 16, 256)
    sol = _search(graph, "2x8xA100-80GB", 16, constraints={"pp": 2, "schedule": "1f1b"})
    counts = [st.num_layers for st in sol.stages]
    assert sorted(counts) == [2, 3]
    assert sol.stages[0].layers[0][0] == 0 and sol.stages[0].layers[0][1] == sol.stages[1].layers[0][0]
    assert sol.stages[1].layers[0][1] == 5


def test_pinned_layout_is_honoured(big_graph):
    pins = {"pp": 2, "tp": 4, "num_microbatches": 8, "schedule": "interleaved_1f1b", "virtual_stages": 2, "zero": 1}
    sol = _search(big_graph, BIG_CLUSTER, BIG["batch"], constraints=pins)
    assert (sol.pp, sol.tp, sol.dp, sol.num_microbatches) == (2, 4, 2, 8)
    assert sol.schedule == Schedule.INTERLEAVED_1F1B and sol.virtual_stages == 2
    assert sol.micro_batch_size == BIG["batch"] // (2 * 8)
    assert all(st.zero_stage == 1 for st in sol.stages)
    assert all(len(st.layers) == 2 for st in sol.stages)  # two chunks per device
    covered = sorted(r for st in sol.stages for r in st.layers)
    assert covered == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert sol.stages[0].layers == ((0, 2), (4, 6))
    assert sol.stages[0].activation_copies == activation_copies(Schedule.INTERLEAVED_1F1B, 2, 0, 8, 2)


@pytest.mark.integration
def test_free_search_is_never_slower_than_a_pinned_grid_point(big_graph, big_solution):
    grid = [{"pp": 1, "tp": 8}]
    grid += [{"pp": pp, "tp": tp, "num_microbatches": m} for pp in (2, 4) for tp in (2, 4) for m in (2, 4)]
    for pins in grid:
        try:
            pinned = _search(big_graph, BIG_CLUSTER, BIG["batch"], constraints=pins | {"overlap": False})
        except InfeasiblePlanError:
            continue
        assert big_solution.step_time_s <= pinned.step_time_s * (1 + 1e-9), pins


def test_schedule_formulas():
    assert activation_copies(Schedule.GPIPE, 4, 0, 8) == 8
    assert [activation_copies(Schedule.ONE_F_ONE_B, 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert activation_copies(Schedule.ONE_F_ONE_B, 4, 0, 2) == 2
    # Megatron-LM / Korthikanti et al.: the first device of an interleaved pipeline holds p (1 + (p-1)/(p v))
    assert activation_copies(Schedule.INTERLEAVED_1F1B, 4, 0, 8, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert bubble_fraction(Schedule.ONE_F_ONE_B, 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(Schedule.INTERLEAVED_1F1B, 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(None, 1, 8) == 0.0


@pytest.mark.integration
@pytest.mark.parametrize(
    "pins, words",
    [
        ({"pp": 3}, "does not divide the world size"),
        ({"pp": 16}, "choose pp <="),
        ({"schedule": "zigzag"}, "expected one of"),
        ({"schedule": "gpipe", "virtual_stages": 2}, "needs schedule 'interleaved_1f1b'"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, "virtual_stages >= 2"),
        ({"pp": 4, "virtual_stages": 4}, "lower virtual_stages"),
        ({"pp": 2, "tp": 0}, "positive integer"),
        ({"pp": 2, "zero": 3}, "ZeRO-3 is not run with a pipeline"),
        ({"schedule": "1f1b", "zero": 2}, "ZeRO-2 is not run with a pipeline"),
    ],
)
def test_bad_constraints_say_what_to_do(pins, words):
    graph = _stack_graph(256, 8, 16, 64)
    with pytest.raises(ConfigError, match=words):
        _search(graph, "2x8xA100-80GB", 16, constraints=pins)


@pytest.mark.integration
def test_zero23_searches_no_pipeline():
    """ZeRO-2/3 pinned without pipeline pins: only the layouts without stages are priced (a pipeline runs ZeRO 0-1)."""
    graph = _stack_graph(256, 8, 16, 64)
    sol = _search(graph, "2x8xA100-80GB", 16, constraints={"zero": 3})
    assert sol.pp == 1 and sol.single_stage.zero_stage == 3 and not sol.candidates


@pytest.mark.integration
def test_no_layout_fits():
    graph = _stack_graph(1024, 4, 16, 256)
    with pytest.raises(InfeasiblePlanError, match="budget"):
        _search(graph, "2x8xA100-80GB", 16, memory_budget_bytes=2**20)


@pytest.mark.integration
def test_a_pinned_pipeline_short_of_memory_says_memory_is_the_cause():
    """Pins whose configurations fit the memory floors, but no cut of which fits once its stages are solved: the
    error names memory (the budget, the stage short of it and its figures), not the pins."""
    graph = _stack_graph(1024, 4, 16, 256)
    pins = {"pp": 2, "dp": 8, "tp": 1, "num_microbatches": 2}
    # the stage's parts at their leanest, each on its own, take 104.95 MiB and fit; no layout of the stage reaches
    # them all at once (seen: the pinned layout fits from about 135 MiB), so 120 MiB sits inside that gap
    budget = 120 * 2**20
    with pytest.raises(ConfigError) as info:
        _search(graph, "2x8xA100-80GB", 16, constraints=pins, memory_budget_bytes=budget)
    msg = str(info.value)
    assert "loosen the pins" not in msg
    assert msg.startswith("no pipeline layout fits the memory budget of 120.00 MiB per device")
    assert "pp=2 dp=8 tp=1 micro-batches=2" in msg and "whose stage 0, with 2 of the 4 layers" in msg
    fastest = float(re.search(r"its fastest layout needs ([\d.]+) MiB", msg).group(1))
    leanest = float(re.search(r"at once \(model states .*: ([\d.]+) MiB\)", msg).group(1))
    assert leanest * 2**20 <= budget < fastest * 2**20


@pytest.mark.integration
def test_stages_pay_their_optimizer_step():
    # each stage steps its own parameters once per step, after its last backward: the same term the
    # one-stage program prices, so a pipeline is not made to look cheaper by leaving it out
    graph = _stack_graph(1024, 4, 32, 512)
    sol = _search(graph, "2x8xA100-80GB", 32, constraints={"pp": 2, "schedule": "1f1b"})
    assert sol.pp == 2
    for st in sol.stages:
        assert st.optimizer_s > 0 and st.optimizer_s == pytest.approx(st.sharding.optimizer_s)


def _t5():
    from tests.families import family_batch, make_family

    args, kwargs = family_batch("t5")
    return make_family("t5"), args, kwargs


@pytest.mark.integration
def test_an_encoder_decoder_pipeline_cuts_its_two_stacks_as_one_sequence():
    import autopar

    model, args, kwargs = _t5()
    plan = autopar.plan(model, "cpu:2", args, kwargs, constraints={"pp": 2})
    assert plan.mesh["pp"] == 2 and str(plan.program) == "pipeline"
    ranges = [st["layers"] for st in plan.pipeline["stages"]]
    (a, cut), (cut2, end) = ranges[0][0], ranges[1][0]
    assert a == 0 and cut == cut2 and end == 4  # encoder.block 0..1, then decoder.block 2..3


@pytest.mark.integration
def test_pp_counts_the_layers_of_both_stacks():
    import autopar
    from autopar.errors import ConfigError

    model, args, kwargs = _t5()
    with pytest.raises(ConfigError, match=r"the model has 4 layer\(s\) to cut"):
        autopar.plan(model, "cpu:8", args, kwargs, constraints={"pp": 8})


@pytest.mark.integration
def test_interleaving_over_two_stacks_says_what_to_pin():
    import autopar
    from autopar.errors import ConfigError

    model, args, kwargs = _t5()
    with pytest.raises(ConfigError, match=r"several stacks of layers \(encoder\.block and decoder\.block\); pin"):
        autopar.plan(model, "cpu:2", args, kwargs, constraints={"pp": 2, "schedule": "interleaved_1f1b"})


@pytest.mark.integration
def test_two_stacks_past_the_budget_say_how_much_memory_they_need():
    import autopar

    model, args, kwargs = _t5()
    with pytest.raises(InfeasiblePlanError, match=r"needs at least .* per device on its fullest stage"):
        autopar.plan(model, "cpu:2", args, kwargs, constraints={"pp": 2}, memory_budget=4096)


@pytest.mark.integration
def test_a_boundary_is_priced_from_the_values_that_cross_it():
    from autopar.ir import OpGraph
    from autopar.passes.pipeline.layers import crossing_bytes, stack_structure
    from autopar.passes.pipeline_split import stack_layers
    from autopar.trace import trace_model

    model, args, kwargs = _t5()
    graph = OpGraph.from_traced(trace_model(model, args, kwargs))
    assert stack_structure(graph, 4).stacks == (("encoder.block", 2), ("decoder.block", 2))
    flat = stack_layers(graph.node_layer)[0]
    hidden = 16 * 64 * 4  # one sample's hidden state: seq 16 x d_model 64, fp32
    bias = 4 * 16 * 16 * 4 / 4  # a position bias: heads 4 x seq x seq, fp32, one for the batch of 4
    # inside the encoder: its hidden state and its position bias
    assert crossing_bytes(graph, flat, 4, 1, 4) == hidden + bias
    # between the stacks: the encoder's output (the decoder embeds its own inputs)
    assert crossing_bytes(graph, flat, 4, 2, 4) == hidden
    # inside the decoder: its hidden state, the encoder's output and the self- and cross-attention biases
    assert crossing_bytes(graph, flat, 4, 3, 4) == 2 * hidden + 2 * bias


def test_layers_that_cannot_be_cut_name_their_container():
    import torch
    from torch import nn

    import autopar
    from autopar.errors import ConfigError

    class Unlike(nn.Module):  # one stack whose two layers differ in shape: a cut cannot count them
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 8)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return (x.square().mean(),)

    with pytest.raises(ConfigError, match=r"the layers of layers are not all alike"):
        autopar.plan(Unlike(), "cpu:2", (torch.randn(4, 8),), constraints={"pp": 2})


@pytest.mark.integration
def test_a_search_without_overlap_after_one_with_it_prices_its_stages_without_overlap():
    # planning searches with overlap, then (for the synchronous plan) without it, on the same graph, keeping the
    # stage programs of the first search in `pricers`: the second must price its own, as a search of its own does
    graph = _stack_graph(hidden=2048, num_layers=4, batch=16, seq=512)
    pins = {"pp": 2, "zero": 1}
    kept: dict = {}
    _search(graph, BIG_CLUSTER, 16, constraints={**pins, "overlap": True}, pricers=kept)
    after = _search(graph, BIG_CLUSTER, 16, constraints={**pins, "overlap": False}, pricers=kept)
    alone = _search(graph, BIG_CLUSTER, 16, constraints={**pins, "overlap": False})
    assert after.step_time_s == alone.step_time_s

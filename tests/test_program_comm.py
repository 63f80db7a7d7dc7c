"""The declaration of how each program communicates (`autopar.program_comm`): its checks, its answers per program,
the prefetch rule, and the order gradient buckets follow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.errors import ConfigError
from autopar.plan import ProgramKind
from autopar.program_comm import ProgramComm, gradient_order, resolved_prefetch_depth
from autopar.units import BUCKET_BYTES, GIB, PRICED_BUCKET_BYTES

GOLDEN = Path(__file__).parent / "golden" / "plans"
DP, SHARDED, PIPELINE, OFFLOAD = (
    ProgramKind.DATA_PARALLEL,
    ProgramKind.SHARDED,
    ProgramKind.PIPELINE,
    ProgramKind.OFFLOAD,
)


def test_units_and_the_two_bucket_sizes():
    """One GiB is 2^30 bytes; the runtime's and the priced bucket are DDP's default, 25 MiB, under two names."""
    assert GIB == 1024**3
    assert BUCKET_BYTES == PRICED_BUCKET_BYTES == 25 * 2**20


@pytest.mark.parametrize(
    ("requested", "overlap", "depth"), [(None, True, 1), (2, True, 2), (0, True, 0), (None, False, 0), (3, False, 0)]
)
def test_the_prefetch_rule(requested, overlap, depth):
    """Without overlap nothing is gathered ahead, whatever was asked for; with it the request, 1 by default."""
    assert resolved_prefetch_depth(requested, overlap) == depth


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"program": SHARDED, "zero_stage": 4}, "ZeRO stage 4: expected 0, 1, 2 or 3"),
        ({"program": SHARDED, "zero_stage": 1, "data_ranks": 0}, "data_ranks=0: expected a positive integer"),
        ({"program": SHARDED, "zero_stage": 1, "num_microbatches": True}, "num_microbatches=True"),
        ({"program": SHARDED, "zero_stage": 1, "prefetch_depth": -1}, "prefetch_depth=-1: expected a count"),
        ({"program": SHARDED, "zero_stage": 1, "overlap": False, "prefetch_depth": 2}, "without overlap"),
        ({"program": DP, "zero_stage": 1}, "the data-parallel program at ZeRO-1"),
        ({"program": PIPELINE, "zero_stage": 2}, "a pipeline runs ZeRO 0 or 1"),
    ],
)
def test_a_declaration_that_no_program_runs_is_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        ProgramComm(**kwargs)


def test_the_data_parallel_program_buckets_its_all_reduce_from_backward():
    comm = ProgramComm(DP, 0, data_ranks=8, overlap=True, num_microbatches=4)
    assert comm.runs_plain and comm.buckets_all_reduce and comm.overlaps_all_reduce
    assert not (comm.overlaps_data_axis or comm.runs_chunks or comm.gathers_once_a_step or comm.gathers_at_each_use)
    assert comm.reductions_per_step == 1
    assert not dataclasses.replace(comm, overlap=False).overlaps_all_reduce


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_sharded_program_with_overlap(stage):
    """Buckets from backward (every micro-batch's from ZeRO-2), weights gathered ahead: kept for the step at
    ZeRO-1/2, released after the forward at ZeRO-3; ZeRO-1 accumulates whole gradients until its one reduction."""
    comm = ProgramComm(SHARDED, stage, data_ranks=4, overlap=True, prefetch_depth=1, num_microbatches=3)
    assert comm.overlaps_data_axis and not comm.runs_plain and not comm.buckets_all_reduce
    assert comm.reductions_per_step == (3 if stage >= 2 else 1)
    assert comm.holds_gathered_weights == (stage in (1, 2))
    assert comm.releases_gathered_weights == (stage == 3)
    assert comm.accumulates_whole_grads == (stage == 1)
    assert not comm.gathers_at_each_use and not comm.runs_chunks and comm.launches_early
    assert comm.gathers_by_layer == (stage >= 1)  # a layer's split weights in one all-gather


def test_the_sharded_program_without_overlap_or_on_one_rank():
    """Without overlap ZeRO-1/2 gather a weight at every use (a recompute gathers it again); one rank on the data
    axis has nothing to overlap."""
    sync = ProgramComm(SHARDED, 1, data_ranks=2, overlap=False, num_microbatches=2)
    assert not sync.overlaps_data_axis and sync.gathers_at_each_use and not sync.holds_gathered_weights
    assert not sync.accumulates_whole_grads and not sync.launches_early and sync.gathers_by_layer
    alone = ProgramComm(SHARDED, 2, data_ranks=1, overlap=True, prefetch_depth=1)
    assert not alone.overlaps_data_axis and not alone.gathers_at_each_use and not alone.releases_gathered_weights
    assert not alone.gathers_by_layer


def test_a_pipeline_all_reduces_at_zero0_and_gathers_once_a_step_at_zero1():
    zero0 = ProgramComm(PIPELINE, 0, data_ranks=2, overlap=True, num_microbatches=8)
    assert zero0.buckets_all_reduce and not zero0.overlaps_all_reduce and not zero0.overlaps_data_axis
    zero1 = zero0.at_stage(1)
    assert zero1.gathers_once_a_step and zero1.accumulates_whole_grads and not zero1.buckets_all_reduce
    assert not zero1.gathers_at_each_use
    sync = dataclasses.replace(zero1, overlap=False)
    assert not sync.gathers_once_a_step and sync.gathers_at_each_use
    assert not (zero1.gathers_by_layer or sync.gathers_by_layer)  # a pipeline gathers each weight on its own
    assert not ProgramComm(PIPELINE, 1, data_ranks=1).gathers_once_a_step


def test_the_offload_program_moves_chunks():
    """ZeRO-3 over chunks on a data axis; one chunk ahead whatever the depth, one reduce-scatter in flight."""
    comm = ProgramComm(OFFLOAD, 3, data_ranks=2, overlap=True, prefetch_depth=4)
    assert comm.runs_chunks and comm.overlaps_data_axis and comm.prefetches_chunk
    assert comm.chunk_reductions_in_flight == 1
    sync = ProgramComm(OFFLOAD, 3, data_ranks=2, overlap=False)
    assert sync.runs_chunks and not sync.prefetches_chunk and sync.chunk_reductions_in_flight == 0
    assert not ProgramComm(OFFLOAD, 0, data_ranks=1).runs_chunks


def test_a_plans_declaration():
    """Read from plan files: the program, its stage, the data axis; a plan without overlap gathers nothing ahead
    whatever depth its file names."""
    zero3 = autopar.Plan.from_json((GOLDEN / "tiny-llama-cpu2-offload.json").read_text())
    comm = ProgramComm.of_plan(zero3)
    assert (comm.program, comm.zero_stage, comm.data_ranks, comm.prefetch_depth) == (OFFLOAD, 3, 2, 1)
    assert ProgramComm.of_plan(dataclasses.replace(zero3, overlap=False)).prefetch_depth == 0
    pipeline = ProgramComm.of_plan(autopar.Plan.from_json((GOLDEN / "tiny-gpt2-cpu2-pp2.json").read_text()))
    assert (pipeline.program, pipeline.num_microbatches, pipeline.data_ranks) == (PIPELINE, 2, 1)


def test_gradients_complete_in_reverse_order_of_first_use():
    """Backward completes a parameter's gradient when its first use is differentiated: the parameter first read
    last comes first; one read by no op comes last."""
    graph = fx.Graph()
    x, a, b, unused = (graph.placeholder(n) for n in ("x", "a", "b", "unused"))
    h = graph.call_function(torch.mul, (x, a))
    h = graph.call_function(torch.mul, (h, b))
    graph.call_function(torch.add, (h, a))
    assert gradient_order(graph, ["a", "b", "unused"]) == ["b", "a", "unused"]

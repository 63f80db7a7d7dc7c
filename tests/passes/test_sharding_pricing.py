"""The sharding solver's pricing objects on their own: built from explicit facts (a link, a precision, a program's
`ProgramComm`, a parameter's elements), no graph and no integer program, each figure computed by hand.

The link: 2 ranks on a ring of 10 us a step and 1 GB/s, so an all-reduce of S bytes takes 2 steps and moves S
(2e-5 + S / 1e9 s), and an all-gather or a reduce-scatter 1 step and S / 2 (1e-5 + S / 2e9 s). A parameter of
1e6 elements in fp32 is 4e6 bytes of weights and of gradient; a bucket holds 8e6 bytes, two such gradients.
Tolerances: rel=1e-12, the rounding of sums of a few float terms (the figures themselves are exact to that).
"""

from __future__ import annotations

import pytest

from autopar.cost_model.comm import Collective
from autopar.cost_model.devices import LinkSpec
from autopar.memory.layout import ParamSpec
from autopar.passes.sharding.memory import StateMemory
from autopar.passes.sharding.offload import ChunkPricing, offload_prices, offload_result
from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.sync import SyncPricing
from autopar.plan import ProgramKind
from autopar.program_comm import ProgramComm

REL = 1e-12  # float rounding of a few terms
LINK = LinkSpec("ring", bandwidth_bytes_per_s=1e9, latency_s=1e-5)
FP32, BF16 = Precision.get("fp32"), Precision.get("bf16")
NUMEL = 1e6  # elements of the parameter priced
BUCKET = 8e6  # bytes of a gradient bucket
AR_LAT, HALF_LAT = 2e-5 + 1e-9, 1e-5 + 0.5e-9  # the fixed cost of a collective: one byte of it


def all_reduce(nbytes: float) -> float:
    return 2e-5 + nbytes / 1e9


def half(nbytes: float) -> float:  # an all-gather or a reduce-scatter on 2 ranks
    return 1e-5 + nbytes / 2e9


def comm(program, stage, *, overlap=True, depth=None, m=1, ranks=2) -> ProgramComm:
    depth = (1 if overlap else 0) if depth is None else depth
    return ProgramComm(program, stage, ranks, overlap, depth, m)


SYNC = SyncPricing(2, LINK, FP32, BUCKET)
DP, SHARDED, PIPELINE, OFFLOAD = (
    ProgramKind.DATA_PARALLEL,
    ProgramKind.SHARDED,
    ProgramKind.PIPELINE,
    ProgramKind.OFFLOAD,
)


def test_the_data_parallel_program_pays_its_bytes_and_a_share_of_a_bucket_latency():
    """4e6 bytes of gradient fill half a bucket: 4 ms of bandwidth and half of one all-reduce's 20 us latency; the
    step pays one whole latency besides (`floor`)."""
    plain = comm(DP, 0)
    expected = (all_reduce(4e6) - AR_LAT) + AR_LAT * 0.5
    assert SYNC.sync_time(plain, NUMEL) == pytest.approx(expected, rel=REL)
    assert SYNC.sync_time(plain, NUMEL) == pytest.approx(4e-3 + 1e-5 - 0.5e-9, rel=REL)
    assert SYNC.bucket_latency_s(plain, NUMEL) == pytest.approx(AR_LAT / 2, rel=REL)
    assert SYNC.floor(plain) == pytest.approx(AR_LAT, rel=REL)
    # one rank reduces nothing
    alone = SyncPricing(1, LINK, FP32, BUCKET)
    assert alone.sync_time(comm(DP, 0, ranks=1), NUMEL) == 0.0 and alone.floor(comm(DP, 0, ranks=1)) == 0.0


def test_the_sharded_program_without_overlap_pays_whole_collectives_per_parameter():
    """Each micro-batch gathers the weight and reduce-scatters its gradient, ZeRO-3 gathers again for the backward;
    ZeRO-0 all-reduces each gradient on its own: every collective of a weight alone in its layer pays its whole
    latency."""
    rs = ag = half(4e6)  # 2.01 ms each
    assert SYNC.sync_time(comm(SHARDED, 3, overlap=False, m=2), NUMEL) == pytest.approx(2 * rs + 4 * ag, rel=REL)
    assert SYNC.sync_time(comm(SHARDED, 3, overlap=False, m=2), NUMEL) == pytest.approx(6 * 2.01e-3, rel=REL)
    assert SYNC.sync_time(comm(SHARDED, 1, overlap=False, m=2), NUMEL) == pytest.approx(2 * rs + 2 * ag, rel=REL)
    assert SYNC.sync_time(comm(SHARDED, 0, overlap=False), NUMEL) == pytest.approx(4.02e-3, rel=REL)
    assert SYNC.floor(comm(SHARDED, 1, overlap=False)) == 0.0  # no bucket: the latencies are per parameter


def test_the_overlapping_sharded_program_splits_bandwidth_from_latency():
    """ZeRO-1 (m = 4): one bucketed reduce-scatter a step (2 ms of bandwidth, a half-bucket's share of 10 us) and
    one gather ahead of use (2 ms, 10 us). ZeRO-3 (m = 2): a reduce-scatter per micro-batch, and the backward's
    gathers with the gradients; without prefetch every gather waits whole."""
    bw, lat = 2e-3 - 0.5e-9, HALF_LAT  # a 4e6-byte reduce-scatter or gather: bandwidth part, latency
    zero1 = comm(SHARDED, 1, m=4)
    assert SYNC.sharded_parts(zero1, NUMEL) == pytest.approx((bw, lat / 2, bw, lat), rel=REL)
    assert SYNC.sync_time(zero1, NUMEL) == pytest.approx(2 * bw + 1.5 * lat, rel=REL)
    zero3 = comm(SHARDED, 3, m=2)
    assert SYNC.sharded_parts(zero3, NUMEL) == pytest.approx((4 * bw, 3 * lat, 2 * bw, 2 * lat), rel=REL)
    flat = comm(SHARDED, 3, m=2, depth=0)
    whole = half(4e6)
    assert SYNC.sharded_parts(flat, NUMEL) == pytest.approx((2 * bw, lat + 2 * whole, 0.0, 2 * whole), rel=REL)
    # one bucket's latency per reducing backward: once a step at ZeRO-0/1, per micro-batch from ZeRO-2
    assert SYNC.reduction_latency(comm(SHARDED, 0, m=4)) == pytest.approx(AR_LAT, rel=REL)
    assert SYNC.reduction_latency(comm(SHARDED, 2, m=4)) == pytest.approx(4 * HALF_LAT, rel=REL)


def test_the_sharded_program_pays_one_gather_latency_per_layer():
    """A weight one of 9 in its layer pays 1/9 of each gather's latency (the sharded program gathers the layer in
    one all-gather), its bandwidth whole; 9 such weights pay exactly the latencies of one weight alone. The
    reduce-scatters of the synchronous path stay per weight; a pipeline gathers each weight on its own."""
    bw, lat = 2e-3 - 0.5e-9, HALF_LAT  # a 4e6-byte gather: bandwidth part, latency
    zero3 = comm(SHARDED, 3, m=2)
    assert zero3.gathers_by_layer and not comm(PIPELINE, 1, m=2).gathers_by_layer
    assert SYNC.sharded_parts(zero3, NUMEL, members=9) == pytest.approx(
        (4 * bw, lat + 2 * lat / 9, 2 * bw, 2 * lat / 9), rel=REL
    )
    alone, layer = SYNC.sharded_parts(zero3, NUMEL), SYNC.sharded_parts(zero3, NUMEL / 9, members=9)
    assert 9 * (layer[1] - lat / 9) == pytest.approx(alone[1] - lat, rel=1e-9)  # gathers' latency: one per layer
    assert 9 * layer[3] == pytest.approx(alone[3], rel=1e-9)
    flat = comm(SHARDED, 3, m=2, depth=0)
    one = bw + lat / 9
    assert SYNC.sharded_parts(flat, NUMEL, members=9) == pytest.approx((2 * bw, lat + 2 * one, 0.0, 2 * one), rel=REL)
    sync3 = comm(SHARDED, 3, overlap=False, m=2)
    assert SYNC.sync_time(sync3, NUMEL, members=9) == pytest.approx(2 * half(4e6) + 4 * one, rel=REL)
    again = comm(SHARDED, 1, overlap=False, m=2)
    assert SYNC.regather_s(again, NUMEL, count=3, members=9) == pytest.approx(3 * one * 2, rel=REL)
    step = comm(PIPELINE, 1, m=8)
    assert SYNC.sync_time(step, NUMEL, members=9) == SYNC.sync_time(step, NUMEL)


def test_a_pipelines_zero1_reduces_in_buckets_and_gathers_once_a_step():
    step = comm(PIPELINE, 1, m=8)
    assert step.gathers_once_a_step
    bucketed_rs = (half(4e6) - HALF_LAT) + HALF_LAT / 2
    assert SYNC.step_gather_time(step, NUMEL) == pytest.approx(half(4e6), rel=REL)
    assert SYNC.sync_time(step, NUMEL) == pytest.approx(bucketed_rs + half(4e6), rel=REL)
    assert SYNC.bucket_latency_s(step, NUMEL) == pytest.approx(HALF_LAT / 2, rel=REL)
    assert SYNC.floor(step) == pytest.approx(HALF_LAT, rel=REL)


def test_what_nothing_hides_and_what_recompute_gathers_again():
    """The last bucket (at most one bucket, however many gradient bytes), each micro-batch's first gather, and a
    weight gathered again per layer and micro-batch where the program gathers at each use (ZeRO-1 without
    overlap), not where it holds gathered weights (with overlap)."""
    assert SYNC.last_bucket_s(0, 2e6) == pytest.approx(all_reduce(2e6) - AR_LAT, rel=REL)
    assert SYNC.last_bucket_s(1, 1e12) == pytest.approx(half(BUCKET) - HALF_LAT, rel=REL)
    assert SYNC.first_gather_bw_s(comm(SHARDED, 1, m=3), NUMEL) == pytest.approx(3 * (2e-3 - 0.5e-9), rel=REL)
    assert SYNC.first_gather_bw_s(comm(SHARDED, 1, m=3), 0) == 0.0
    again = comm(SHARDED, 1, overlap=False, m=2)
    assert SYNC.regather_s(again, NUMEL, count=3) == pytest.approx(3 * half(4e6) * 2, rel=REL)
    assert SYNC.regather_s(comm(SHARDED, 1, m=2), NUMEL, count=3) == 0.0
    # an all-reduce on its own costs a whole latency more than its bucketed share
    assert SYNC.unbucketed_extra_s(4e6) == pytest.approx(AR_LAT / 2, rel=REL)


def test_state_bytes_shard_one_state_more_at_each_stage():
    """bf16 on 4 data ranks, 1e6 elements: 2 bytes of weights, 4 of fp32 gradient at ZeRO-0 (2 once reduce-
    scattered in bf16), 12 of optimizer states; sharded from stage 1 (states), 2 (gradients), 3 (weights)."""
    mem = StateMemory(BF16, 4, BUCKET)
    assert mem.state_bytes(NUMEL, 0) == (2e6, 4e6, 12e6)
    assert mem.state_bytes(NUMEL, 1) == (2e6, 2e6, 3e6)
    assert mem.state_bytes(NUMEL, 2) == (2e6, 0.5e6, 3e6)
    assert mem.state_bytes(NUMEL, 3) == (0.5e6, 0.5e6, 3e6)
    assert mem.state_bytes(NUMEL, 3, requires_grad=False) == (0.5e6, 0.0, 0.0)
    # ZeRO-1 reducing once a step holds the whole fp32 gradient (4e6) where its state counts the bf16 shard (2e6)
    assert mem.overlap_grad_bytes(comm(SHARDED, 1, ranks=4), NUMEL) == 2e6
    assert mem.overlap_grad_bytes(comm(SHARDED, 1, overlap=False, ranks=4), NUMEL) == 0.0
    assert mem.overlap_grad_bytes(comm(SHARDED, 2, ranks=4), NUMEL) == 0.0


def test_zero23_holds_the_bucket_filling_and_two_launched():
    """Buckets of 20 bytes (bf16 gradients at ZeRO-2, 2 bytes an element): parameters of 10 elements fill one each.
    On 2 ranks a launched bucket holds its send buffer and this rank's half: 1.5 x. The third bucket fills while
    the first two are in flight: 20 + 1.5 (20 + 20) = 80 bytes."""
    mem = StateMemory(BF16, 2, 20)
    assert mem.bucket_sizes([10, 10, 10], 2) == [20.0, 20.0, 20.0]
    assert mem.bucket_sizes([3, 3, 3, 3], 2) == [24.0]  # closed once it holds 20 bytes: by its last member
    assert mem.in_flight_grad_bytes(comm(SHARDED, 2, ranks=2), [20.0, 20.0, 20.0]) == pytest.approx(80.0, rel=REL)
    assert mem.in_flight_grad_bytes(comm(SHARDED, 1, ranks=2), [20.0, 20.0, 20.0]) == 0.0  # ZeRO-1: no buckets held
    assert mem.prefetch_bytes(2, [10, 30, 20]) == 2 * 30 * 2  # two layers ahead, the largest, in bf16


def test_host_offload_prices_by_hand():
    """bf16 (gradient 2 and weight 2 bytes an element across the host link, 12 of optimizer states), a 10 GB/s host
    link, a CPU AdamW of 1e9 elements a second, 4 micro-batches."""
    host = LinkSpec("pcie", bandwidth_bytes_per_s=1e10, latency_s=1e-6)
    c_o, c_g, c_p = offload_prices(BF16, host, 1e9, 4)
    assert c_o == pytest.approx((4 / 1e10 + 1 / 1e9) / 12, rel=REL)
    assert c_g == pytest.approx(3 / 1e10, rel=REL)  # every micro-batch's gradient but the last goes down too
    assert c_p == pytest.approx(7 / 1e10, rel=REL)  # weights up for each micro-batch's gathers, less the one a step
    assert offload_result((0.4, 1.0, 1.0), {}, 0.1, host_capacity=1e9, devices_per_node=8, budget=1e9) == {}
    rec = offload_result((3e9, 1e9, 5e8), {"optimizer": 1e9}, 0.1, host_capacity=8e9, devices_per_node=8, budget=4e9)
    assert rec["optimizer_fraction"] == pytest.approx(0.75, rel=REL)
    assert rec["grad_fraction"] == 1.0 and rec["host_bytes_per_node"] == pytest.approx(8 * 4e9, rel=REL)


def test_chunk_collectives_are_shared_by_elements():
    """The offload program's chunks: a parameter's share of every chunk's collectives is its share of the
    trainable elements, so the shares add up to the chunks' totals; a frozen chunk is gathered, never
    reduce-scattered."""
    specs = (
        ParamSpec("a", (4096, 1024)),
        ParamSpec("b", (4096, 1024)),
        ParamSpec("frozen", (4096, 1024), requires_grad=False),
    )
    chunks = ChunkPricing(specs, 2, LINK, BF16, budget_bytes=16 * 2**20)
    assert len(chunks.chunks) >= 2 and any(not c.requires_grad for c in chunks.chunks)
    totals, trainable = chunks.totals
    assert trainable == 2 * 4096 * 1024
    shares = [chunks.collectives(sp.numel) for sp in specs if sp.requires_grad]
    assert [sum(s[i] for s in shares) for i in range(4)] == pytest.approx(list(totals), rel=REL)
    rs_chunks = [c for c in chunks.chunks if c.requires_grad]
    assert totals[1] == pytest.approx(len(rs_chunks) * chunks.latency(Collective.REDUCE_SCATTER), rel=REL)
    assert totals[3] == pytest.approx(len(chunks.chunks) * chunks.latency(Collective.ALL_GATHER), rel=REL)
    # the first trainable chunk's reduce-scatter (fp32 staging: 4 bytes an element) is what backward cannot hide
    first = rs_chunks[0].capacity
    expected = half(4 * first) - 1e-5  # a chunk collective's latency is one of no bytes: 1e-5 s
    assert chunks.last_bucket_bw_s(prefetch=False) == pytest.approx(expected, rel=REL)
    assert chunks.prefetch_bytes() == max(c.capacity for c in chunks.chunks) * 2


def test_unpacking_a_gathered_weight_is_a_copy_nothing_hides():
    """The program copies each weight out of its layer's gathered buffer: 4e6 bytes read and 4e6 written at an HBM
    of 1e12 bytes/s, 8 us, on the compute stream (in the fixed parts of the overlapping program's prices)."""
    sync = SyncPricing(2, LINK, FP32, BUCKET, hbm_bytes_per_s=1e12)
    unpack = 8e-6
    layer = comm(SHARDED, 3)  # gathers a layer's weights in one all-gather
    assert sync.unpack_time(layer, NUMEL, members=4) == pytest.approx(unpack, rel=REL)
    # one of 4 weights of its layer: its bytes at full bandwidth, a quarter of the latency, its copy
    expected = half(4e6) - HALF_LAT + HALF_LAT / 4 + unpack
    assert sync.gather_time(layer, NUMEL, members=4) == pytest.approx(expected, rel=REL)
    # alone in its layer's gather, the weight is a view of the gathered buffer
    assert sync.unpack_time(layer, NUMEL, members=1) == 0.0
    # overlapping ZeRO-3: forward's gather and backward's each copy once, and nothing hides the copies
    g_bw, g_fix, a_bw, a_fix = sync.sharded_parts(layer, NUMEL, members=4)
    b_bw, b_fix, c_bw, c_fix = SYNC.sharded_parts(layer, NUMEL, members=4)  # unbounded HBM: no copy
    assert (g_bw, a_bw) == (pytest.approx(b_bw, rel=REL), pytest.approx(c_bw, rel=REL))
    assert g_fix == pytest.approx(b_fix + unpack, rel=REL) and a_fix == pytest.approx(c_fix + unpack, rel=REL)
    # the synchronous program gathers twice per micro-batch at ZeRO-3
    plain = comm(SHARDED, 3, overlap=False)
    assert sync.sync_time(plain, NUMEL, members=4) == pytest.approx(
        SYNC.sync_time(plain, NUMEL, members=4) + 2 * unpack, rel=REL
    )

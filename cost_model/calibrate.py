"""Measure the local CPU and print the figures of the "cpu" device preset as a cluster file.

    python -m autopar.cost_model.calibrate [--ranks 2] [--repeats 7] [--runs 1] > cpu-cluster.json

What is measured, and how:

- matmul FLOP/s per dtype: a square matmul (1024 for fp32, 512 for 16-bit) on one thread,
  median of `repeats`; one thread because the gloo tests run one rank per core.
- vector FLOP/s: a fused multiply-add (`torch.addcmul`) over a cache-resident fp32 vector,
  counting 2 FLOPs per element.
- memory bandwidth: copying a 256 MiB fp32 tensor, counting the bytes read and written.
- kernel overhead: the time of an add of one-element tensors, one requiring grad (dispatch
  and autograd recording, no work).
- the loopback link: a gloo all-reduce among `ranks` processes over localhost at sizes from
  4 B to 64 MiB, each timed by what it adds to a short step of host work. alpha is the median
  time of the messages below 1 MiB (less their bandwidth part) divided by the ring's 2(n-1)
  steps; the bandwidth is the slope of time over ring-moved bytes 2(n-1)/n·S, least-squares
  fitted on the sizes from 1 MiB. All-gather and reduce-scatter are measured and fitted the
  same way, each on its own ring model, into the link's `per_collective` figures (gloo runs
  them well off the all-reduce's price per byte). The reduce-scatter measured is the one
  autopar's programs run: on gloo an all-reduce of the whole tensor
  (`runtime.collectives.issue_reduce_scatter`).
- overlap efficiency (`measure_overlap_efficiency`): on `ranks` processes, an all-reduce of one gradient
  bucket's size launched asynchronously while matmuls of about its length run, against the two one after
  the other; eta is the share of the shorter of the two that running them at once saved, the median over
  many repetitions (one repetition's eta moves between 0 and 0.4 on a shared 2-core machine).
- host memory: physical RAM from `sysconf`.
- host costs of an eager training step (`measure_host_overheads`: dispatch of an op and of a
  view, one backward node, one `autograd.grad` call), of the optimizer
  (`measure_optimizer_step`: AdamW per parameter tensor and per parameter byte), and what an op
  costs in a lowered program's graph beyond eager (`measure_lowered_overhead`). These are not
  cluster-file fields: `ProfiledEstimator` measures them with these functions into its profile
  cache (they belong to the machine the profile was taken on); the command prints them on
  stderr for reference.

The output is a JSON cluster file (`autopar.ClusterSpec.from_file` reads it) overriding the
preset with the measured figures; what was measured, on what, and when goes to stderr. The
cost model itself never calls this module: measuring belongs to set-up, not to planning.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import compat
from autopar.units import BUCKET_BYTES

_COLLECTIVE_SIZES_BYTES = tuple(4 * 4**k for k in range(0, 13))  # 4 B .. 64 MiB
_FIT_MIN_BYTES = 1 << 20
_MIN_COLLECTIVE_S = 1e-6  # a difference of two noisy loop times can come out below zero: never price it so


def median_time_s(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul_flops(dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on the current thread count."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2.0 * n**3 / median_time_s(lambda: torch.mm(a, b, out=out), repeats)


def measure_vector_flops(repeats: int, numel: int = 1 << 14) -> float:
    """FLOP/s of an fp32 multiply-add on a vector that fits in L1/L2 (so memory does not bound it)."""
    x, y, z = torch.randn(numel), torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel)
    inner = 200  # many calls per sample so that dispatch overhead is amortised

    def run():
        for _ in range(inner):
            torch.addcmul(x, y, z, out=out)

    return 2.0 * numel * inner / median_time_s(run, repeats)


def measure_memory_bandwidth(repeats: int, num_bytes: int = 256 << 20) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * num_bytes / median_time_s(lambda: dst.copy_(src), repeats)


def measure_kernel_overhead(repeats: int) -> float:
    """Seconds per op of a one-element add that autograd records: the fixed cost every training op pays."""
    a, b = torch.ones(1, requires_grad=True), torch.ones(1)
    inner = 1000

    def run():
        for _ in range(inner):
            torch.add(a, b)

    return median_time_s(run, repeats) / inner


def _chain_backward_s(
    make_link, repeats: int, length: int = 500, *, leaf: torch.Tensor | None = None, finish=None
) -> float:
    """Seconds per node of one backward through a chain of `length` nodes that `make_link(x)` records.

    The chain starts at `leaf` (a one-element tensor requiring grad by default); `finish` turns its end
    into the scalar the backward starts from (default: the end itself)."""
    leaf = torch.ones(1, requires_grad=True) if leaf is None else leaf

    def run():
        x = leaf
        for _ in range(length):
            x = make_link(x)
        x = finish(x) if finish is not None else x
        t0 = time.perf_counter()
        x.backward()
        return time.perf_counter() - t0

    for _ in range(2):
        run()
    return statistics.median(run() for _ in range(repeats)) / length


def small_op_mix() -> list:
    """Twenty different ATen ops and views on 4 x 4 tensors, each `x -> y` of the same shape."""
    aten = torch.ops.aten
    b = torch.ones(4, 4)
    unary = (
        aten.neg.default,
        aten.exp.default,
        aten.sin.default,
        aten.cos.default,
        aten.tanh.default,
        aten.sigmoid.default,
        aten.relu.default,
        aten.sqrt.default,
        aten.abs.default,
        aten.silu.default,
        aten.rsqrt.default,
    )
    binary = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.mm.default)
    ops = [lambda x, f=f: f(x) for f in unary] + [lambda x, f=f: f(x, b) for f in binary]
    return ops + [
        lambda x: aten.pow.Tensor_Scalar(x, 2),
        lambda x: aten.transpose.int(x, 0, 1),
        lambda x: aten.view.default(x, [4, 4]),
        lambda x: aten.slice.Tensor(x, 0, 0, 4),
    ]


def evict_dispatch_paths() -> None:
    """Run each op of `small_op_mix` once: what a forward runs between two calls of one op, in miniature.

    An op timed in a loop of itself keeps its dispatch path and kernel code in the caches and the branch
    predictors; calling this between its timed calls takes them away, as a forward does.
    """
    for op in _MIX_OPS:
        op(_MIX_INPUT)


_MIX_OPS = small_op_mix()
_MIX_INPUT = torch.ones(4, 4, requires_grad=True)


def _cold_dispatch_extra_s(repeats: int, length: int = 2000) -> float:
    """Seconds per op that a chain of different ops pays over the same ops each timed in a loop of itself."""
    ops = small_op_mix()
    a = torch.ones(4, 4, requires_grad=True)

    def chain():
        x = a
        for i in range(length):
            x = ops[i % len(ops)](x)

    def loops():
        for op in ops:
            for _ in range(length // len(ops)):
                op(a)

    mixed = median_time_s(chain, repeats) / length
    looped = median_time_s(loops, repeats) / (length // len(ops) * len(ops))
    return max(mixed - looped, 0.0)


def measure_host_overheads(repeats: int) -> dict[str, float]:
    """The fixed host costs of an eager training step on one-element tensors (no work, only bookkeeping).

    - `op_forward_s`: an ATen op called through its OpOverload (as an exported graph calls it) on an
      input that requires grad: dispatch plus autograd recording.
    - `op_backward_s`: one node of a long backward (the autograd engine's per-node cost), from a
      chain of adds.
    - `view_forward_s`, `view_backward_s`: the same for a view (no kernel, but dispatch, a view's
      metadata and, in backward, a node that reshapes the gradient).
    - `grad_call_s`: one `torch.autograd.grad` call through a single add: what a profile of one op's
      backward pays on top of the op's own backward node (the engine's start and finish).
    - `op_cold_extra_s`: what one op of a forward pays on top of its time in a loop of itself: a
      chain cycling through twenty different small ops and views, per op, less the mean time of
      the same ops each called in a loop. A loop keeps one op's dispatch path in the caches and
      the branch predictors; a real forward, op after different op, does not.
    """
    add, view = torch.ops.aten.add.Tensor, torch.ops.aten.view.default
    a, b = torch.ones(1, requires_grad=True), torch.ones(1)
    inner = 1000

    def forward(fn):
        def run():
            for _ in range(inner):
                fn()

        return median_time_s(run, repeats) / inner

    out = add(a, b)
    grad = torch.ones(1)
    single = median_time_s(lambda: torch.autograd.grad(out, [a], grad, retain_graph=True), repeats * 20)
    op_backward = _chain_backward_s(lambda x: add(x, b), repeats)
    return {
        "op_cold_extra_s": _cold_dispatch_extra_s(repeats),
        "op_forward_s": forward(lambda: add(a, b)),
        "op_backward_s": op_backward,
        "view_forward_s": forward(lambda: view(a, [1])),
        "view_backward_s": _chain_backward_s(lambda x: view(x, [1]), repeats),
        "grad_call_s": single,
    }


def measure_lowered_overhead(repeats: int, length: int = 400, num_params: int = 50) -> dict[str, float]:
    """What an op costs in a lowered program's graph beyond the same op run eagerly (one-element tensors, so no
    work): `lowered_op_s`, seconds per op of a forward and backward through a chain of `length` products with
    `num_params` parameters read in turn.

    The sharded and pipeline programs run their graph lowered to plain local tensors (`passes.lower`): ATen ops
    called from the graph module's generated code, each parameter made through the program's hook where first
    read (identity here, as under fp32). What the chain adds over eager is that call path and the hooks, per op;
    the op's own dispatch is in its profile already. The two are timed in turns (median of `repeats` each);
    a difference under the noise comes out as 0.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.lower import TensorAxis, lower_pass

    mul = torch.ops.aten.mul.Tensor

    def chain(x, weights):
        for k in range(length):
            x = mul(x, weights[k % num_params])
        return (x.sum(),)

    class Identity:  # the program's parameter hooks under fp32 with no data axis
        def enter(self, index, t):
            return t

        def gather(self, index, t):
            return t

    x, weights = torch.ones(1), [torch.ones(1, requires_grad=True) for _ in range(num_params)]
    gm = make_fx(chain)(x, weights)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"][1:]
    lowered = lower_pass(
        gm,
        None,
        axis=TensorAxis(None, 1, 0),
        node_inputs={},
        node_output={},
        param_placements={},
        params={name: k for k, name in enumerate(names)},
        hooks=Identity(),
    )

    def eager():
        chain(x, weights)[0].backward()

    def graph():
        lowered(x, *weights)[0].backward()

    eager_s, graph_s = [], []
    for _ in range(3):  # in turns: load on the machine slows both alike
        eager_s.append(median_time_s(eager, repeats))
        graph_s.append(median_time_s(graph, repeats))
    extra = statistics.median(g - e for g, e in zip(graph_s, eager_s, strict=True)) / length
    return {"lowered_op_s": max(extra, 0.0)}


def measure_optimizer_step(repeats: int, make_optimizer=None) -> dict[str, float]:
    """Seconds of one optimizer step (default AdamW), split into a cost per parameter tensor and per parameter byte.

    Two steps are timed: 64 one-element fp32 tensors (the per-tensor cost, work negligible) and one
    tensor of 4 Mi fp32 elements (the per-byte cost, after taking out one tensor's fixed cost).
    """
    make = make_optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))

    def step_s(shapes) -> float:
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        return median_time_s(opt.step, repeats)

    per_tensor = step_s([(1,)] * 64) / 64
    numel = 4 << 20
    per_byte = max(step_s([(numel,)]) - per_tensor, 0.0) / (numel * 4)
    return {"optimizer_tensor_s": per_tensor, "optimizer_s_per_param_byte": per_byte}


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _collective_call(kind: str, num_bytes: int, world: int):
    """(a call running collective `kind` once on a full tensor of about `num_bytes`, the full tensor's bytes); for
    the kinds in `_IN_FLIGHT` the call issues the collective and returns its work handle (`wait()` completes it)."""
    # all-gather and reduce-scatter split it evenly over the ranks, an all-to-all each rank's shard again
    unit = world * world if kind == "all_to_all" else world
    numel = max(num_bytes // 4 // unit, 1) * unit
    full = torch.ones(numel)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full)), numel * 4
    shard = torch.ones(numel // world)
    if kind == "all_gather":
        return (lambda: compat.all_gather_single(full, shard, async_op=True)), numel * 4
    if kind == "reduce_scatter":  # as autopar's programs run it on this backend
        from autopar.runtime.collectives import issue_reduce_scatter

        return (lambda: issue_reduce_scatter(full, out=shard)), numel * 4
    if kind == "all_to_all":  # the full tensor is every rank's shard together; each rank re-splits its own
        out = torch.empty_like(shard)
        return (lambda: dist.all_to_all_single(out, shard)), numel * 4
    if kind == "send_recv":  # one ring step: every rank sends the whole tensor on and receives its neighbour's
        rank = dist.get_rank()
        buffer = torch.empty_like(full)

        def ring_step():
            ops = [dist.P2POp(dist.isend, full, (rank + 1) % world), dist.P2POp(dist.irecv, buffer, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return ring_step, numel * 4
    raise ValueError(f"no gloo measurement for collective {kind!r}: expected one of {CONTEXT_COLLECTIVES}")


# the collectives `measure_gloo_collectives` times by default: what the programs issue over the data axis
MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# ... and with those, what context-parallel attention issues over the cp axis (the ring's steps, Ulysses' re-splits)
CONTEXT_COLLECTIVES = (*MEASURED_COLLECTIVES, "all_to_all", "send_recv")
# how many of each follow one another after a step's host work: the data-parallel program's all-reduces come a
# bucket or two at the end of backward, the sharded program's gathers and reduce-scatters one after another
# through the step (as cp attention's all-to-alls and ring steps, layer after layer), and a collective right
# after another does not pay again for the ranks meeting
_CALLS_PER_STEP = {"all_gather": 8, "reduce_scatter": 8, "all_to_all": 8, "send_recv": 8}
# How many of each the sharded program keeps in flight: it issues a layer's next gathers before it waits for the
# current one's (`runtime.sharded`, prefetch depth 1, the plans' default) and launches a gradient bucket while
# `overlap.WINDOW` - 1 others are out. gloo runs a collective issued behind another sooner than one issued after the
# other's wait (2 ranks of a 2-core machine, 2026-12-07, per call, two in flight against one, two runs: all-gather
# 0.75 and 0.79 of the time at 4 MiB, 0.87 and 0.90 at 16 MiB; reduce-scatter 0.88 and 0.85 at 4 MiB, 0.83 and
# 0.87 at 16 MiB; at 256 KiB 1.01-1.24, no faster), so they are timed as issued.
# Context-parallel attention's all-gather of K/V and reduce-scatter of dK/dV go one at a time and are priced on the
# same figures: on gloo, below what they take by about as much.
_IN_FLIGHT = {"all_gather": 2, "reduce_scatter": 2}
# The largest size of each the fit measures: all-reduces past the largest the programs issue (the 25 MiB
# gradient buckets), so that the bandwidth the fit's slope gives is the one those buckets see; all-gathers and
# reduce-scatters to 16 MiB, as the sharded programs gather each weight on its own (the bench's wide-llama's
# largest is 9 MiB) and gloo runs both much slower per byte past 16 MiB, which a fit through 64 MiB would
# price every gather at
FIT_MAX_BYTES = {
    "all_reduce": 64 << 20,
    "all_gather": 16 << 20,
    "reduce_scatter": 16 << 20,
    "all_to_all": 16 << 20,
    "send_recv": 16 << 20,
}


def run_in_a_row(collectives: list, calls: int, in_flight: int | None):
    """A function running `calls` collectives in a row, taking turns over `collectives` (each on buffers of its
    own): each waited for before the next is issued, or (with `in_flight`, each call issuing its collective and
    returning the work handle) the oldest waited for once `in_flight` are out."""
    if in_flight is None:

        def run():
            for i in range(calls):
                collectives[i % len(collectives)]()

        return run

    def run_issued():
        out = []
        for i in range(calls):
            if len(out) == in_flight:
                out.pop(0).wait()
            out.append(collectives[i % len(collectives)]())
        for work in out:
            work.wait()

    return run_issued


def _collective_worker(
    rank: int, world: int, init_file: str, repeats: int, result_file: str, sizes: dict[str, tuple[int, ...]]
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        work = small_op_step()
        work()

        def per_iteration_s(fn, iterations: int = 8) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iterations):
                fn()
            return (time.perf_counter() - t0) / iterations

        results: dict[str, dict[int, float]] = {kind: {} for kind in sizes}
        for kind, kind_sizes in sizes.items():
            for size in kind_sizes:
                # as many sets of buffers as collectives in flight: the program's own never share theirs
                made = [_collective_call(kind, size, world) for _ in range(_IN_FLIGHT.get(kind, 1))]
                num_bytes = made[0][1]
                calls = _CALLS_PER_STEP.get(kind, 1)
                run = run_in_a_row([call for call, _ in made], calls, _IN_FLIGHT.get(kind))
                for _ in range(2):  # the first calls set up the algorithm's buffers
                    run()

                def step(run=run):
                    work()
                    run()

                alone, with_collective = [], []
                for _ in range(repeats):
                    alone.append(per_iteration_s(work))
                    with_collective.append(per_iteration_s(step))
                added = (statistics.median(with_collective) - statistics.median(alone)) / calls
                added = torch.tensor([added], dtype=torch.float64)
                dist.all_reduce(added, op=dist.ReduceOp.MAX)  # the slowest rank's, as a step's time is
                results[kind][num_bytes] = max(added.item(), _MIN_COLLECTIVE_S)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_gloo_collectives(
    num_ranks: int,
    repeats: int,
    max_bytes: int | Mapping[str, int] | None = FIT_MAX_BYTES,
    kinds: tuple[str, ...] = MEASURED_COLLECTIVES,
) -> dict[str, dict[int, float]]:
    """{collective: {bytes of the full tensor: seconds}} that each of `kinds` among `num_ranks` local gloo
    processes adds to a step (sizes up to `max_bytes`, one for all or one per collective; by default
    `FIT_MAX_BYTES`).

    Measured as a training step meets it: each rank runs a short step of host work (`small_op_step`)
    and then the collective (an all-reduce once, the others `_CALLS_PER_STEP` times in a row, as the sharded
    program and cp attention issue them; all-gathers and reduce-scatters `_IN_FLIGHT` at a time, as the sharded
    program keeps them), back to back without a barrier, and the time per iteration less that of
    the work alone, per call, is the collective's (the median over `repeats` loops, the slowest rank's). So it
    includes what a collective timed alone after a barrier leaves out: the ranks arriving at
    different times, and a rank that waited idle being slow to run again. On a 2-core virtual machine
    the 0.5 MB all-reduce took about 0.5 ms after a barrier and added 2.7 ms to a step, as it did in a
    data-parallel training step of the same size. gloo's all-gather and reduce-scatter do not run at the
    all-reduce's price per moved byte: on 2 ranks of that machine, 2026-12-06, a 16 MiB all-reduce added
    15.8 ms, the all-gather of the same 16 MiB 10.7 ms and its reduce-scatter 19.3 ms, where the ring model
    gives both half the all-reduce's bytes; hence each is fitted on its own (`fit_ring`). Past 16 MiB they
    slow down faster than their size grows (64 MiB: all-gather 73 ms, reduce-scatter 89 ms, all-reduce
    54 ms), so a fit should stop at the sizes the priced programs issue. (autopar's programs now run a
    reduce-scatter over gloo as an all-reduce, and this measures that: see `_collective_call`.)
    """
    limits = max_bytes if isinstance(max_bytes, Mapping) else {kind: max_bytes for kind in kinds}
    sizes = {
        kind: tuple(s for s in _COLLECTIVE_SIZES_BYTES if limits.get(kind) is None or s <= limits[kind])
        for kind in kinds
    }
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result.json")
        mp.spawn(
            _collective_worker, args=(num_ranks, init_file, repeats, result_file, sizes), nprocs=num_ranks, join=True
        )
        with open(result_file) as f:
            return {kind: {int(k): v for k, v in times.items()} for kind, times in json.load(f).items()}


def small_op_step():
    """A small training step on the host: a forward chain through `small_op_mix` and its backward."""
    ops = small_op_mix()
    a = torch.ones(4, 4, requires_grad=True)

    def step():
        x = a
        for i in range(300):
            x = ops[i % len(ops)](x)
        x.sum().backward()

    return step


def _host_work_s(duration_s: float, make_work=small_op_step, min_samples: int = 5) -> float:
    """Median seconds of the step `make_work()` returns, repeated for `duration_s` of wall time and at least
    `min_samples` times (after one untimed call): ranks started together keep running together."""
    work = make_work()
    work()
    samples = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end or len(samples) < min_samples:
        t0 = time.perf_counter()
        work()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _shared_core_worker(
    rank: int, world: int, init_file: str, duration_s: float, result_dir: str, make_work=small_op_step
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        work = make_work()
        work()  # built and warm on every rank before any rank starts timing
        result = {"alone": []}
        # rank 0 alone (the others wait at the barrier), all together, rank 0 alone again: the machine's load
        # may drift over the measurement, and bracketing the shared phase cancels a steady drift
        for phase in ("alone", "together", "alone"):
            dist.barrier()
            if phase == "together":
                result["together"] = _host_work_s(duration_s, lambda: work)
            elif rank == 0:
                result["alone"].append(_host_work_s(duration_s, lambda: work))
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_shared_core_slowdown(num_ranks: int, duration_s: float = 1.0, make_work=small_op_step) -> float:
    """How much slower a rank's host work runs while `num_ranks` local ranks run theirs at once, than alone.

    Host work is the step `make_work()` returns (built once per process; `make_work` must pickle, as the
    ranks are spawned): by default a step of small ops (forward and backward through `small_op_mix`);
    `bench run` passes a training step of the model it runs, at one rank's share of the batch, because
    how much ranks slow each other depends on the work (small ops share cores; larger ones also share
    caches and memory bandwidth). Each rank is a process with one thread. More ranks than cores share
    cores (about ranks / cores each); even at one rank per core they share caches, memory bandwidth and
    whatever else the machine is running. The median over the ranks of their median step while all run
    together, over rank 0's median step alone (the mean of a phase before and a phase after, while the
    other ranks wait), each phase at least `duration_s`; never below 1.
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _shared_core_worker,
            args=(num_ranks, os.path.join(tmp, "rendezvous"), duration_s, tmp, make_work),
            nprocs=num_ranks,
            join=True,
        )
        results = []
        for rank in range(num_ranks):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    alone = statistics.fmean(results[0]["alone"])
    return max(1.0, statistics.median(r["together"] for r in results) / alone)


def matmul_chain(num_matmuls: int, n: int = 256):
    """Compute with no communication: `num_matmuls` n x n x n fp32 matmuls, as a callable (the bulk of a backward)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)

    def work():
        for _ in range(num_matmuls):
            torch.mm(a, b, out=out)

    return work


def _overlap_worker(rank: int, world: int, init_file: str, num_bytes: int, repeats: int, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        t = torch.ones(max(num_bytes // 4, 1))

        def timed(fn) -> float:  # the slowest rank's time of `fn`, started together
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            return spent.item()

        def allreduce():
            dist.all_reduce(t)

        allreduce()  # the first call sets up gloo's buffers
        unit = statistics.median(timed(matmul_chain(8)) for _ in range(3))
        comm = statistics.median(timed(allreduce) for _ in range(3))
        work = matmul_chain(max(1, round(8 * comm / unit)))  # about as long as the all-reduce

        def both():
            handle = dist.all_reduce(t, async_op=True)
            work()
            handle.wait()

        samples = {"compute": [], "comm": [], "both": []}
        for _ in range(repeats):
            for key, fn in (("compute", work), ("comm", allreduce), ("both", both)):
                samples[key].append(timed(fn))
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def overlap_efficiency(compute_s: float, comm_s: float, both_s: float) -> float:
    """eta = (compute + comm - both) / min(compute, comm), in [0, 1]: the share of the shorter of the two that
    running them at once saves (1: the communication fully behind the compute or the other way round; 0:
    they take as long together as one after the other)."""
    shorter = min(compute_s, comm_s)
    if not shorter > 0:
        raise ValueError(f"overlap efficiency needs positive times, got compute {compute_s} s, comm {comm_s} s")
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / shorter))


def paired_overlap_efficiency(samples: Mapping[str, list[float]]) -> float:
    """The median of `overlap_efficiency` over turns: samples["compute"][k], ["comm"][k] and ["both"][k] were
    timed one after the other in turn k."""
    turns = zip(samples["compute"], samples["comm"], samples["both"], strict=True)
    return statistics.median(overlap_efficiency(*turn) for turn in turns)


OVERLAP_PROBE_BYTES = BUCKET_BYTES  # one gradient bucket, what backward overlaps
# one repetition's eta is noisy (0 to 0.4 on 2 shared cores); over 21 the median moves by about 0.1 run to run
OVERLAP_PROBE_REPEATS = 21


def measure_overlap_efficiency(
    num_ranks: int, num_bytes: int = OVERLAP_PROBE_BYTES, repeats: int = OVERLAP_PROBE_REPEATS
) -> dict[str, float]:
    """How much of a gloo all-reduce hides behind compute on this machine: {"eta", "compute_s", "comm_s",
    "both_s"}.

    Each of `num_ranks` local ranks (one thread each) times, after a barrier (the slowest rank's time): a chain
    of fp32 matmuls sized to take about as long as the all-reduce (compute_s), an all-reduce of `num_bytes`
    (comm_s), and the all-reduce launched asynchronously, the same matmuls run, then waited on (both_s); the
    three take turns `repeats` times and each time is their median. eta is the median of the repetitions'
    `overlap_efficiency` (each from the three times of one turn, so that a disturbance of the machine moves
    one repetition's eta and not the figure). On CPU gloo's communication runs on threads that compete with
    the compute for the same cores, so eta < 1 there.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result.json")
        mp.spawn(
            _overlap_worker, args=(num_ranks, init_file, num_bytes, repeats, result_file), nprocs=num_ranks, join=True
        )
        with open(result_file) as f:
            samples = json.load(f)
    medians = {f"{k}_s": statistics.median(v) for k, v in samples.items()}
    return {"eta": paired_overlap_efficiency(samples)} | medians


def fit_ring(kind: str, times_s: dict[int, float], num_ranks: int) -> tuple[float, float]:
    """(latency_s per step, bandwidth bytes/s) of collective `kind`'s ring model
    t = steps·alpha + moved bytes / bandwidth (`cost_model.comm`), fitted to {full tensor bytes: seconds}.

    The bandwidth is the slope of a least-squares line through the sizes from 1 MiB up; the latency
    is the median, over the sizes below 1 MiB, of each one's time less its bandwidth part (a median
    over many sizes, because on a shared machine any one small collective can be several times
    slower than the next).
    """
    from autopar.cost_model.comm import Collective, collective_moved_bytes, collective_steps

    steps = collective_steps(Collective(kind), num_ranks)
    moved = {s: collective_moved_bytes(Collective(kind), s, num_ranks) for s in times_s}
    big = [s for s in times_s if s >= _FIT_MIN_BYTES]
    xs, ys = [moved[s] for s in big], [times_s[s] for s in big]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if not slope > 0:
        raise ValueError(f"{kind} times do not grow with size ({times_s}): the machine was too busy to measure")
    small = [times_s[s] - moved[s] * slope for s in times_s if s < _FIT_MIN_BYTES]
    alpha = max(statistics.median(small), 0.0) / steps
    return alpha, 1.0 / slope


def fit_link(times_s: dict[str, dict[int, float]], num_ranks: int) -> dict:
    """The link overrides (`LinkSpec` fields) fitted to `measure_gloo_collectives`' times: latency and bandwidth
    from the all-reduces (ValueError where they cannot be fitted), and each other collective measured fitted on
    its own into `per_collective`; one whose times cannot be fitted (a machine too busy while it was measured)
    keeps the all-reduce's figures, with a warning that names it."""
    alpha, bandwidth = fit_ring("all_reduce", times_s["all_reduce"], num_ranks)
    link: dict = {"latency_s": alpha, "bandwidth_bytes_per_s": bandwidth}
    others = {}
    for kind, times in sorted(times_s.items()):
        if kind == "all_reduce":
            continue
        try:
            latency, kind_bandwidth = fit_ring(kind, times, num_ranks)
        except ValueError as e:
            warnings.warn(f"link fit: {e}; {kind} is priced with the all-reduce's figures", stacklevel=2)
            continue
        others[kind] = {"latency_s": latency, "bandwidth_bytes_per_s": kind_bandwidth}
    if others:
        link["per_collective"] = others
    return link


def calibrate(num_ranks: int = 2, repeats: int = 7, runs: int = 1) -> dict:
    """Every measurement, as a cluster-file dict for `cpu:<num_ranks>`.

    With `runs` > 1 each figure is measured that many times and the best kept (highest rate,
    lowest time): other processes on the machine only ever slow a measurement down, so the best
    run is the least disturbed one.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul = {
            "fp32": max(measure_matmul_flops(torch.float32, 1024, repeats) for _ in range(runs)),
            "bf16": max(measure_matmul_flops(torch.bfloat16, 512, repeats) for _ in range(runs)),
            "fp16": max(measure_matmul_flops(torch.float16, 512, repeats) for _ in range(runs)),
        }
        matmul["tf32"] = matmul["fp32"]  # CPUs have no TF32 mode: fp32 matmuls stay fp32
        device = {
            "memory_bandwidth_bytes_per_s": max(measure_memory_bandwidth(repeats) for _ in range(runs)),
            "matmul_flops_per_s": matmul,
            "vector_flops_per_s": max(measure_vector_flops(repeats) for _ in range(runs)),
            "kernel_overhead_s": min(measure_kernel_overhead(repeats) for _ in range(runs)),
        }
    finally:
        torch.set_num_threads(previous)
    samples = [measure_gloo_collectives(num_ranks, repeats) for _ in range(runs)]
    best = {
        kind: {size: min(run[kind][size] for run in samples) for size in times} for kind, times in samples[0].items()
    }
    # the median, not the best: other load on the machine moves eta either way
    device["overlap_efficiency"] = statistics.median(measure_overlap_efficiency(num_ranks)["eta"] for _ in range(runs))
    link = fit_link(best, num_ranks)
    ram = host_memory_bytes()  # the cluster file divides it among the ranks
    return {
        "cluster": f"cpu:{num_ranks}",
        "device": device,
        "intra_node_link": link,
        "host_link": {"bandwidth_bytes_per_s": device["memory_bandwidth_bytes_per_s"] / 2},
        "host_memory_bytes": ram,
    }


def _round(value):
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, float):
        return float(f"{value:.3g}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes for the all-reduce fit (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="samples per measurement; the median is kept")
    parser.add_argument("--runs", type=int, default=1, help="measure everything this often and keep the best run")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be at least 2: an all-reduce among one process moves nothing")
    result = _round(calibrate(args.ranks, args.repeats, max(args.runs, 1)))
    print(
        f"# measured {datetime.date.today().isoformat()} on {platform.node()} ({platform.machine() or 'cpu'}, "
        f"{os.cpu_count()} cores), torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )
    torch.set_num_threads(1)
    host = measure_host_overheads(args.repeats) | measure_optimizer_step(args.repeats)
    print(
        f"# host costs per call, one thread (ProfiledEstimator measures these into its cache): "
        f"{json.dumps(_round(host))}",
        file=sys.stderr,
        flush=True,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

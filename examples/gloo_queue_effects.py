"""How gloo's collectives behave when several are in flight, and what a ZeRO-3 step's collectives cost on their own.

    OMP_NUM_THREADS=1 python examples/gloo_queue_effects.py [--ranks 2] [--repeats 7]

Two measurements among `--ranks` local gloo processes (one thread each), each time the slowest rank's median:

1. Collectives of one size issued one at a time (each waited before the next), two in flight (the oldest waited
   before the next goes out, as the sharded program keeps its gathers and gradient buckets) and all issued at once
   and then waited, per call: gloo runs queued collectives on its worker threads, so a queue can take less than the
   sum of its calls (the link fit, `calibrate.measure_gloo_collectives`, times all-gathers and reduce-scatters two
   in flight, all-reduces one at a time).
2. One step of the bench's wide-llama under autopar's ZeRO-3 plan (dp = ranks): its collectives recorded as the
   program issues them, then replayed without compute in the same three ways, next to the plan's price of
   them (exposed plus hidden data-axis communication, analytic cpu preset unless the gloo link is fitted first
   with `--fit-link`).

Nothing here is asserted: it prints what it measures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import compat

QUEUE_CASES = (
    ("all_gather", 8 << 10, 32),
    ("all_gather", 1 << 20, 32),
    ("all_gather", 4 << 20, 16),
    ("all_gather", 9 << 20, 8),
    ("all_reduce", 4 << 20, 8),
    ("all_reduce", 25 << 20, 4),
)


def _issue(kind: str, full: torch.Tensor, shard: torch.Tensor):
    if kind == "all_gather":
        return compat.all_gather_single(full, shard, async_op=True)
    return dist.all_reduce(full, async_op=True)


def _slowest_median(fn, repeats: int) -> float:
    """The median over `repeats` of the slowest rank's time of `fn`, the ranks started together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        times.append(spent.item())
    return statistics.median(times)


def _three_ways(calls: list[tuple[str, torch.Tensor, torch.Tensor]], repeats: int) -> tuple[float, float, float]:
    """(one at a time, two in flight, all queued) times of `calls`, issued as the link fit issues its own."""
    from autopar.cost_model.calibrate import run_in_a_row

    issue = [lambda call=call: _issue(*call) for call in calls]
    ways = tuple(run_in_a_row(issue, len(calls), limit) for limit in (1, 2, len(calls)))
    for run in ways:  # gloo sets up its buffers on first use
        run()
    return tuple(_slowest_median(run, repeats) for run in ways)


def _zero3_calls(rank: int, world: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The collectives one ZeRO-3 training step of wide-llama issues on this rank, as fresh buffers of their sizes."""
    from autopar.bench import run_methods
    from autopar.bench.run_models import WIDE_LLAMA, model_and_batch

    _, model, ids = model_and_batch(WIDE_LLAMA)
    method = run_methods._AutoparZero3(model, ids, rank, world, optimizer=WIDE_LLAMA.optimizer)
    method.step()
    real = {name: getattr(dist, name) for name in ("all_gather_single", "all_reduce")}
    seen: list[tuple[str, int, int]] = []

    def recorder(name):
        def call(*args, **kwargs):
            gather = name == "all_gather_single"
            out, inp = args[0], args[1] if gather else args[0]
            seen.append(("all_gather" if gather else "all_reduce", out.numel(), inp.numel()))
            return real[name](*args, **kwargs)

        return call

    try:
        for name in real:
            setattr(dist, name, recorder(name))
        method.step()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return [(kind, torch.ones(n_out), torch.ones(n_in)) for kind, n_out, n_in in seen]


def _worker(rank: int, world: int, init_file: str, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = []
        for kind, nbytes, count in QUEUE_CASES:
            numel = max(nbytes // 4 // world, 1) * world
            calls = [(kind, torch.ones(numel), torch.ones(numel // world)) for _ in range(count)]
            rows.append((kind, nbytes, count, *_three_ways(calls, repeats)))
        calls = _zero3_calls(rank, world)
        step = _three_ways(calls, repeats)
        if rank == 0:
            out["queue"], out["zero3"] = rows, (len(calls), sum(k == "all_gather" for k, _, _ in calls), *step)
    finally:
        dist.destroy_process_group()


def _priced(world: int, fit_link: bool) -> tuple[float, float]:
    """(exposed, hidden) data-axis communication of the ZeRO-3 plan the bench pins, on cpu:`world`."""
    from autopar.bench.run_calibration import plan_model
    from autopar.bench.run_models import WIDE_LLAMA
    from autopar.cluster import ClusterSpec

    overrides: dict = {"cluster": f"cpu:{world}"}
    if fit_link:
        from autopar.cost_model.calibrate import fit_link as fit
        from autopar.cost_model.calibrate import measure_gloo_collectives

        overrides["intra_node_link"] = fit(measure_gloo_collectives(world, 5), world)
    cluster = ClusterSpec.from_overrides(overrides, source="gloo_queue_effects")
    plan = plan_model(WIDE_LLAMA, cluster, None, {"dp": world, "zero": 3})
    return plan.time_breakdown.get("comm_dp", 0.0), sum(plan.hidden_communication.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fit-link", action="store_true", help="price the plan on the gloo link fitted here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(args.ranks, f"{tmp}/rendezvous", args.repeats, out), nprocs=args.ranks, join=True)
        queue, zero3 = out["queue"], out["zero3"]
    print(f"{args.ranks} gloo ranks, one thread each; per call, the slowest rank's median of {args.repeats}")
    for kind, nbytes, count, alone, two, queued in queue:
        print(
            f"  {count:3d} x {kind:10s} {nbytes / 2**20:7.3f} MiB: one at a time {alone / count * 1e3:6.2f} ms, "
            f"two in flight {two / count * 1e3:6.2f} ms ({two / alone:.2f}), "
            f"queued {queued / count * 1e3:6.2f} ms ({queued / alone:.2f})"
        )
    calls, gathers, alone, two, queued = zero3
    exposed, hidden = _priced(args.ranks, args.fit_link)
    print(
        f"wide-llama ZeRO-3, one step's {calls} collectives ({gathers} all-gathers) without compute: one at a time "
        f"{alone * 1e3:.1f} ms, two in flight {two * 1e3:.1f} ms, queued {queued * 1e3:.1f} ms; priced {(exposed + hidden) * 1e3:.1f} ms "
        f"({exposed * 1e3:.1f} exposed + {hidden * 1e3:.1f} hidden)"
    )


if __name__ == "__main__":
    main()

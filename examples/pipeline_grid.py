"""Price the layouts a user would pin by hand next to autopar's free search, under the same cost model.

    python examples/pipeline_grid.py --model llama2-70b --cluster 64x8xA100-40GB --global-batch-size 1536 --seq-len 2048

For every pipeline depth pp, tensor-parallel size tp (dp = world / (pp tp)) and micro-batch size
in the grid, the plan with those pinned (schedule, ZeRO stage, recompute and cut still chosen by
the planner) is priced; the free search must be no slower than any of them. Prints one row per
grid point and exits with status 1 if a pinned layout beats the free search.
"""

from __future__ import annotations

import argparse
import sys
import time

import autopar
from autopar.errors import AutoparError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--global-batch-size", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--micro-batch-size", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    case = dict(global_batch_size=args.global_batch_size, seq_len=args.seq_len)
    world = autopar.ClusterSpec.parse(args.cluster).world_size
    t0 = time.perf_counter()
    free = autopar.plan(args.model, args.cluster, **case)
    print(f"free search ({time.perf_counter() - t0:.1f} s): {free.summary()}", flush=True)
    best_pinned = None
    for pp in args.pp:
        for tp in args.tp:
            if world % (pp * tp):
                continue
            dp = world // (pp * tp)
            for b in args.micro_batch_size:
                pins = {"pp": pp, "tp": tp, "dp": dp, "micro_batch_size": b}
                t0 = time.perf_counter()
                try:
                    p = autopar.plan(args.model, args.cluster, constraints=pins, **case)
                except AutoparError as e:
                    print(
                        f"pp={pp:<3} tp={tp} dp={dp:<4} b={b}: -  ({type(e).__name__}: {str(e).splitlines()[0][:90]})"
                    )
                    continue
                step = p.predicted.step_time_s
                sched = p.pipeline.get("schedule", "-") if p.pipeline else "-"
                print(
                    f"pp={pp:<3} tp={tp} dp={dp:<4} b={b}: {step * 1e3:10.1f} ms  {sched:<16} ZeRO-{p.zero_stage} "
                    f"recompute {p.recompute:<9} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
                if best_pinned is None or step < best_pinned[0]:
                    best_pinned = (step, pins)
    if best_pinned is None:
        print("no pinned layout fits")
        return 0
    ratio = free.predicted.step_time_s / best_pinned[0]
    print(
        f"free search {free.predicted.step_time_s * 1e3:.1f} ms; best pinned {best_pinned[0] * 1e3:.1f} ms "
        f"{best_pinned[1]}; free / best pinned = {ratio:.4f}"
    )
    return 0 if ratio <= 1 + 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())

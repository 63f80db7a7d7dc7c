"""Context parallelism measured: real steps of each cp attention algorithm on CPU ranks, next to their prediction.

    OMP_NUM_THREADS=1 python examples/cp_measured.py [--world 2] [--seq-len 8192] [--steps 3] [--memory-budget 60MiB]
                                                     [--no-link-fit]

One sequence of a small LLaMA-shaped model on `world` ranks cannot be split over a data axis: the planner must
split it over a tensor axis or over a context-parallel axis (or, with a memory budget one rank cannot meet
alone, whichever fits). The free search's choice is printed with the cp degrees it priced. Each attention
algorithm is then planned with cp pinned to the world size and trained on `world` spawned gloo ranks: one
warm-up step and `steps` timed steps (the slowest rank's median). One row per algorithm gives the predicted and
the measured step time, each also relative to the all-gather algorithm, which is how the two compare: the CPU
device's compute figures are the preset's, not this machine's, and the ranks share its cores. The link is fitted
first (unless `--no-link-fit`): gloo's all-reduce, all-gather, reduce-scatter, all-to-all and ring step among the
ranks, each on its own figures (`calibrate.measure_gloo_collectives`), which the plans are priced with.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autopar
from autopar.bench.common import run_on_ranks
from autopar.errors import InfeasiblePlanError

ALGORITHMS = ("allgather", "ring", "alltoall")


def build_model(seq_len: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=seq_len,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batch(global_batch: int, seq_len: int):
    ids = torch.randint(0, 1024, (global_batch, seq_len), generator=torch.Generator().manual_seed(1))
    return (ids,), {"labels": ids}


def _train(rank: int, world: int, plan_json: str, seq_len: int, global_batch: int, steps: int) -> list[float]:
    plan = autopar.Plan.from_json(plan_json)
    args, kwargs = batch(global_batch, seq_len)
    pm = autopar.compile(
        build_model(seq_len), f"cpu:{world}", args, kwargs, plan=plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3)
    )
    pm.train_step(*args, **kwargs)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pm.train_step(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--memory-budget", default=None, help="per-rank budget for every plan, e.g. 60MiB")
    ap.add_argument("--no-link-fit", action="store_true", help="price the link with the cpu preset's figures")
    a = ap.parse_args()
    cluster = f"cpu:{a.world}"
    if not a.no_link_fit:
        from autopar.cost_model.calibrate import CONTEXT_COLLECTIVES, fit_link, measure_gloo_collectives

        print(f"fitting the gloo link among {a.world} ranks: {', '.join(CONTEXT_COLLECTIVES)}", flush=True)
        link = fit_link(measure_gloo_collectives(a.world, 5, kinds=CONTEXT_COLLECTIVES), a.world)
        cluster = autopar.ClusterSpec.from_overrides({"cluster": cluster, "intra_node_link": link}, source="link fit")
        for kind, f in [("all_reduce", link), *link.get("per_collective", {}).items()]:
            print(f"  {kind}: {f['latency_s'] * 1e6:,.0f} µs per step, {f['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    model = build_model(a.seq_len)
    args, kwargs = batch(1, a.seq_len)
    common = dict(alternatives=False, memory_budget=a.memory_budget)
    free = autopar.plan(model, cluster, args, kwargs, **common)
    cp_info = free.context_parallel or {}
    print(
        f"free search: mesh {free.mesh}, cp attention {cp_info.get('algorithm', '-')}, predicted "
        f"{free.predicted.step_time_s * 1e3:,.1f} ms, peak {free.predicted.peak_memory_bytes / 2**20:,.1f} MiB",
        flush=True,
    )
    for r in cp_info.get("search", []):
        print(f"  cp={r['degree']}: " + (f"{r['step_time_s'] * 1e3:,.1f} ms" if r.get("feasible") else r["reason"]))
    rows = []
    for algo in ALGORITHMS:
        try:
            p = autopar.plan(model, cluster, args, kwargs, constraints={"cp": a.world, "cp_attention": algo}, **common)
        except InfeasiblePlanError as e:
            rows.append((algo, None, None, str(e).splitlines()[0]))
            continue
        ranks = run_on_ranks(a.world, _train, p.to_json(), a.seq_len, 1, a.steps, label=f"cp {algo}")
        measured = max(statistics.median(t) for t in ranks)
        rows.append((algo, p.predicted.step_time_s, measured, ""))
        print(
            f"  {algo}: predicted {p.predicted.step_time_s * 1e3:,.1f} ms, measured {measured * 1e3:,.1f} ms",
            flush=True,
        )
    base = next((r for r in rows if r[0] == "allgather" and r[1] is not None), None)
    print("\n| algorithm | predicted ms | measured ms | predicted / all-gather | measured / all-gather | note |")
    print("|---|---|---|---|---|---|")
    for algo, pred, meas, note in rows:
        if pred is None:
            print(f"| {algo} | - | - | - | - | {note} |")
            continue
        rp = f"{pred / base[1]:.2f}" if base else "-"
        rm = f"{meas / base[2]:.2f}" if base else "-"
        print(f"| {algo} | {pred * 1e3:,.1f} | {meas * 1e3:,.1f} | {rp} | {rm} | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

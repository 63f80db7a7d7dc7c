"""Plan LLaMA-3-8B at long sequences and print what the planner chose: the context-parallel sweep.

Each row is what `autopar plan --model llama3-8b --cluster CLUSTER --global-batch-size 8 --seq-len L` plans
(the same `autopar.plan` call, cp unpinned: the planner searches the cp degree and its attention algorithm):

    python examples/long_context_sweep.py                 # 32K..256K on 8xH100-80GB, 1M on 8x8xH100-80GB
    python examples/long_context_sweep.py --quick         # 32K and 128K only
    python examples/long_context_sweep.py --json out.json # also write every row as JSON
    python examples/long_context_sweep.py --markdown examples/reports/llama3-8b-long-context.md

Columns: the mesh (dp x cp x tp), cp degree and attention algorithm, micro-batches and recompute, predicted
step time, tokens/s per GPU and MFU, peak memory per device, the degrees the search priced (step time, or why
not), and the planning time (the `plan` call: tracing, the cp search and the solves; imports excluded).
Predictions come from the analytic cost model: no GPU is used.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import autopar

MODEL, BATCH = "llama3-8b", 8
CASES = [
    ("8xH100-80GB", 32768),
    ("8xH100-80GB", 65536),
    ("8xH100-80GB", 131072),
    ("8xH100-80GB", 262144),
    ("8x8xH100-80GB", 1048576),
]
QUICK = [("8xH100-80GB", 32768), ("8xH100-80GB", 131072)]


def run_case(cluster: str, seq_len: int) -> dict:
    """Plan one (cluster, sequence length) and return its row."""
    t0 = time.perf_counter()
    plan = autopar.plan(MODEL, cluster, global_batch_size=BATCH, seq_len=seq_len)
    wall = time.perf_counter() - t0
    p, cp = plan.predicted, plan.context_parallel
    searched = [
        f"{r['degree']}: {r['step_time_s']:.2f} s" if r["feasible"] else f"{r['degree']}: {r['reason']}"
        for r in cp.get("search", [])
    ]
    return {
        "cluster": cluster,
        "seq_len": seq_len,
        "mesh": dict(plan.mesh),
        "cp": plan.mesh.get("cp", 1),
        "algorithm": cp.get("algorithm") if plan.mesh.get("cp", 1) > 1 else None,
        "num_microbatches": plan.num_microbatches,
        "recompute": plan.recompute,
        "zero_stage": plan.zero_stage,
        "step_time_s": p.step_time_s,
        "tokens_per_s_per_gpu": p.tokens_per_s / plan.cluster.world_size,
        "mfu": p.mfu,
        "peak_memory_gib": p.peak_memory_bytes / 2**30,
        "searched": searched,
        "planning_time_s": wall,
    }


def table(rows: list[dict]) -> str:
    head = (
        "| cluster | seq | mesh | cp | attention | micro-batches | recompute | step (s) | tokens/s/GPU | MFU "
        "| peak GiB | planning (s) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        lines.append(
            f"| {r['cluster']} | {r['seq_len'] // 1024}K | {mesh} | {r['cp']} | {r['algorithm'] or '-'} | "
            f"{r['num_microbatches']} | {r['recompute']} | {r['step_time_s']:.2f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} | "
            f"{r['planning_time_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32K and 128K only")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--markdown", help="write the table and each row's searched degrees to this Markdown file")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # per-op notes of the solver, not results
    rows = []
    for cluster, seq_len in QUICK if args.quick else CASES:
        rows.append(run_case(cluster, seq_len))
        r = rows[-1]
        print(
            f"{cluster} {seq_len}: mesh {r['mesh']}, {r['algorithm'] or 'no cp'}, {r['mfu']:.1%} MFU, "
            f"planned in {r['planning_time_s']:.1f} s; searched {'; '.join(r['searched']) or '-'}",
            flush=True,
        )
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """The sweep as a page: how it was made, the table, and the cp degrees each plan priced."""
    lines = [
        "# LLaMA-3-8B at long sequences: the cp layouts autopar plans",
        "",
        f"Made by `python examples/long_context_sweep.py` (autopar.plan of {MODEL}, global batch {BATCH}, cp "
        "unpinned; analytic cost model, bf16). Planning times are wall-clock seconds of the `plan` call on the "
        "machine that ran it, and vary with its load.",
        "",
        table(rows),
        "",
        "## The cp degrees each plan priced",
        "",
    ]
    for r in rows:
        lines.append(
            f"- {r['cluster']}, {r['seq_len'] // 1024}K tokens: " + "; ".join(f"cp={s}" for s in r["searched"])
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""`autopar bench overhead`: the host time each program kind adds per step and per op, measured.

Two parts, each one spawned gloo job on local CPU ranks (`execution.spawn_ranks`: the methods take turns, one
repetition of a few steps each, the order rotated every repetition; a repetition's time is the slowest rank's mean
step time):

1. A compute-free model (the small LLaMA shrunk to hidden 32, 4 x 16 tokens): what is left of a step is host time.
   Every program kind (`autopar-dp` the data-parallel program, `autopar-tp` the sharded program on a tensor axis
   over every rank, `autopar-zero1` / `autopar-zero3` the sharded program at ZeRO-1 / 3, `autopar-pp` two pipeline
   stages, `autopar-offload` the offload program) next to eager PyTorch on one rank's slice (`eager`), DDP and
   FSDP2. Each method's ops per step are counted once (`execution.count_ops`: every ATen op the step dispatches,
   forward, backward, collectives and optimizer), and its host time per op is its step time over them.
2. The small LLaMA (4 layers, hidden 256, vocabulary 2,048, batch 8 x 128, AdamW) with autopar's own plan (priced
   by the cost model calibrated on this machine, as `autopar bench run` plans) against DDP, and the data-parallel
   program and the sharded program at ZeRO-1 (the layout the issue measured) pinned: the paired ratio of their step
   times, repetition by repetition.

Targets (issue 45): the sharded program within 1.05x DDP's step on the small LLaMA and within 1.2x eager's host
time per op on the compute-free model. The machine's load before and after each part is recorded: other work on
the cores slows every method, and the paired ratios are what stays comparable.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from autopar.bench.common import env_md, environment, md_table, write_json
from autopar.bench.execution import (
    MODELS,
    QUICK_SETTINGS,
    RunModel,
    RunSettings,
    _load_average,
    _summarise,
    calibrate_cost_model,
    model_estimator,
    plan_model,
    spawn_ranks,
)
from autopar.bench.run_methods import METHODS

# the small LLaMA of `bench run`, shrunk until compute is nil
NIL_LLAMA = RunModel(
    "nil-llama",
    "tiny-llama",
    4,
    16,
    (
        ("hidden_size", 32),
        ("intermediate_size", 64),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("vocab_size", 2048),
    ),
)
SMALL_LLAMA = next(m for m in MODELS if m.name == "small-llama")
KINDS = (
    "eager",
    "ddp",
    "fsdp2",
    "autopar-dp",
    "autopar-tp",
    "autopar-zero1",
    "autopar-zero3",
    "autopar-pp",
    "autopar-offload",
)
AGAINST_DDP = ("autopar", "autopar-dp", "autopar-zero1", "ddp")
SETTINGS = RunSettings(warmup_steps=3, repetitions=7, steps_per_repetition=10, measure_exposed=False, count_ops=True)
QUICK = replace(QUICK_SETTINGS, measure_exposed=False, count_ops=True)


def _per_op(methods: dict) -> None:
    """Add host time per op (median step time over ops per step) and its ratio to eager's, paired per repetition."""
    eager = methods.get("eager")
    for m in methods.values():
        ops = m.get("ops_per_step")
        if not ops:
            continue
        m["host_time_per_op_s"] = m["median_step_time_s"] / ops
        if eager is not None and eager.get("ops_per_step"):
            ratios = [
                (t / ops) / (e / eager["ops_per_step"]) for t, e in zip(m["times_s"], eager["times_s"], strict=True)
            ]
            m["paired_per_op_ratio_to_eager"] = statistics.median(ratios)
            m["paired_step_ratio_to_eager"] = statistics.median(
                t / e for t, e in zip(m["times_s"], eager["times_s"], strict=True)
            )


def _paired_to(methods: dict, base: str) -> None:
    """Add each method's step-time ratio to `base`'s, repetition by repetition (median and range)."""
    if base not in methods:
        return
    for m in methods.values():
        ratios = [t / b for t, b in zip(m["times_s"], methods[base]["times_s"], strict=True)]
        m[f"paired_ratio_to_{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def run(
    out_dir: str | Path,
    *,
    cluster: str = "cpu:2",
    quick: bool = False,
    show_progress: bool = True,
    kinds: tuple[str, ...] = KINDS,
    settings: RunSettings | None = None,
) -> dict:
    """Run both parts on the local CPU ranks of `cluster` and write `overhead.json` and `overhead.md` to `out_dir`.

    `kinds`: the methods of the compute-free part (`KINDS`, a subset for a shorter run); `settings`: how long to
    measure (default `SETTINGS`, `QUICK` with `quick`, which also leaves out the small LLaMA).
    """
    from autopar.bench.execution import _cpu_world

    world = _cpu_world(cluster)
    settings = settings or (QUICK if quick else SETTINGS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    kinds = tuple(k for k in kinds if not METHODS[k].skip_reason(NIL_LLAMA.optimizer))
    load = {"before": _load_average()}
    (nil,) = _summarise(spawn_ranks(world, [NIL_LLAMA], settings, show_progress=show_progress, methods=kinds))
    _per_op(nil["methods"])
    _paired_to(nil["methods"], "ddp")
    load["between"] = _load_average()
    small = None
    if not quick:
        cluster_spec, _ = calibrate_cost_model(world, out, repeats=settings.calibration_repeats, show_progress=False)
        estimator, _ = model_estimator(
            SMALL_LLAMA, world, out, repeats=settings.calibration_repeats, show_progress=show_progress
        )
        plans = {
            n: plan_model(SMALL_LLAMA, cluster_spec, estimator, METHODS[n].constraints(world)).to_json()
            for n in AGAINST_DDP
            if n.startswith("autopar")
        }
        timed = replace(settings, count_ops=False, steps_per_repetition=3)
        (small,) = _summarise(
            spawn_ranks(
                world,
                [SMALL_LLAMA],
                timed,
                show_progress=show_progress,
                plans={SMALL_LLAMA.name: plans},
                methods=AGAINST_DDP,
            )
        )
        _paired_to(small["methods"], "ddp")
    load["after"] = _load_average()
    doc = {
        "environment": environment(),
        "cluster": cluster,
        "world_size": world,
        "settings": asdict(settings),
        "load_average": load,
        "time_measure": "median over repetitions of the mean step time of a repetition, slowest rank; host time per "
        "op: that over the ATen ops one step dispatches (counted once, rank 0)",
        "wall_time_s": time.perf_counter() - t0,
        "compute_free": nil,
        "small_llama": small,
    }
    write_json(out / "overhead.json", doc)
    (out / "overhead.md").write_text(markdown(doc))
    return doc


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if seconds is not None else "-"


def _x(value) -> str:
    if isinstance(value, dict):
        return f"{value['median']:.2f}x ({value['min']:.2f}-{value['max']:.2f})"
    return f"{value:.2f}x" if value is not None else "-"


def _layout(m: dict) -> str:
    if "mesh" not in m:
        return "-"
    mesh = " ".join(f"{k}={v}" for k, v in m["mesh"].items() if v > 1) or "1 rank"
    return f"{m['program']} ({mesh}, ZeRO-{m['zero_stage']})"


def markdown(doc: dict) -> str:
    """The two parts as tables, with the machine's load."""
    nil = doc["compute_free"]
    lines = [
        "# autopar bench overhead",
        "",
        env_md(doc["environment"]),
        "",
        f"Cluster {doc['cluster']}; load average before, between and after: "
        + ", ".join(f"{v:.1f}" if v is not None else "-" for v in doc["load_average"].values()),
        "",
        f"## Compute-free model ({NIL_LLAMA.name}: hidden 32, {NIL_LLAMA.batch_size} x {NIL_LLAMA.seq_len} tokens)",
        "",
    ]
    rows = []
    for name, m in nil["methods"].items():
        rows.append(
            [
                name,
                _layout(m),
                f"{_ms(m['median_step_time_s'])} ({_ms(m['min_step_time_s'])}-{_ms(m['max_step_time_s'])})",
                str(m.get("ops_per_step", "-")),
                f"{m['host_time_per_op_s'] * 1e6:.1f}" if "host_time_per_op_s" in m else "-",
                _x(m.get("paired_per_op_ratio_to_eager")),
                _x(m.get("paired_step_ratio_to_eager")),
                _x(m.get("paired_ratio_to_ddp")),
            ]
        )
    lines.append(
        md_table(
            [
                "method",
                "program",
                "step ms (range)",
                "ops/step",
                "us/op",
                "per op / eager",
                "step / eager",
                "step / DDP",
            ],
            rows,
        )
    )
    small = doc.get("small_llama")
    if small:
        lines += ["", "## Small LLaMA (4 layers, hidden 256, vocabulary 2,048, 8 x 128 tokens, AdamW)", ""]
        rows = [
            [
                name,
                _layout(m),
                _ms(m.get("predicted_step_time_s")),
                f"{_ms(m['median_step_time_s'])} ({_ms(m['min_step_time_s'])}-{_ms(m['max_step_time_s'])})",
                _x(m.get("paired_ratio_to_ddp")),
            ]
            for name, m in small["methods"].items()
        ]
        lines.append(md_table(["method", "program", "predicted ms", "step ms (range)", "step / DDP (paired)"], rows))
    return "\n".join(lines) + "\n"


__all__ = ["KINDS", "NIL_LLAMA", "run"]

"""`autopar bench compile`: how planning time grows with the depth of the model and the size of the cluster.

Two sweeps, each split into tracing (`torch.export` plus building the OpGraph), solving (the
integer programs of the winning layout, `plan.stats["solve_time_s"]`), other planning work (on
clusters of more than one node mostly the pipeline search, which prices stage cuts, sub-meshes
and schedules before the single-stage layout wins or loses; then FLOP counting and assembling
the plan) and rewriting. Rewriting is reported as 0: this suite only plans, and the rewrite
(`autopar.compile` building the parallel program) needs a process group of the cluster's size
and real parameters; `autopar bench run` reports autopar's full compile time on real ranks.

- layers: one model family at depths 2 ... 128 on one cluster, each depth traced afresh;
- devices: one model on 8 ... 4096 simulated devices, traced once (the trace does not depend on
  the cluster) and planned for each cluster; its tracing column repeats that one measurement.

The memory budget is lifted (`memory_budget`) so that every point gets a plan: the suite measures
how long planning takes, not whether a 128-layer model fits on 8 devices.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import autopar
from autopar.bench.common import env_md, environment, md_table, progress, pyplot, write_json
from autopar.cluster import ClusterSpec

NO_BUDGET = "1000TB"


@dataclass(frozen=True, slots=True)
class CompileSweep:
    """A depth sweep and a device sweep of one model family."""

    model: str
    layers: tuple[int, ...]
    layers_cluster: str
    devices_layers: int
    devices: tuple[str, ...]
    global_batch_size: int
    seq_len: int


SWEEP = CompileSweep(
    "llama2-7b",
    (2, 4, 8, 16, 32, 64, 128),
    "4x8xH100-80GB",
    32,
    ("8xH100-80GB", "2x8xH100-80GB", "8x8xH100-80GB", "32x8xH100-80GB", "128x8xH100-80GB", "512x8xH100-80GB"),
    4096,
    1024,
)
QUICK_SWEEP = CompileSweep(
    "llama2-7b", (2, 8, 32), "4x8xH100-80GB", 4, ("8xH100-80GB", "8x8xH100-80GB", "64x8xH100-80GB"), 4096, 1024
)


def _trace(model: str, num_layers: int, batch: int, seq: int):
    from autopar import presets
    from autopar.trace import trace_model

    config = presets.load_config(model, num_hidden_layers=num_layers)
    module = presets.build_model(config, device="meta", dtype=torch.bfloat16)
    args, kwargs = presets.example_batch(config, batch, seq, device="meta")
    t0 = time.perf_counter()
    traced = trace_model(module, args, kwargs)
    return module, args, kwargs, traced, time.perf_counter() - t0


def _point(module, args, kwargs, traced, export_s: float, cluster: str) -> dict:
    spec = ClusterSpec.parse(cluster)
    t0 = time.perf_counter()
    plan = autopar.plan(module, spec, args, kwargs, precision="bf16", memory_budget=NO_BUDGET, _traced=traced)
    total = time.perf_counter() - t0
    # With `_traced`, the plan's trace_time_s is the OpGraph build: tracing is export + that.
    graph_s = plan.stats["trace_time_s"]
    solve_s = plan.stats["solve_time_s"]
    return {
        "cluster": cluster,
        "world_size": spec.world_size,
        "trace_time_s": export_s + graph_s,
        "export_time_s": export_s,
        "graph_build_time_s": graph_s,
        "solve_time_s": solve_s,
        "other_time_s": max(total - graph_s - solve_s, 0.0),
        "rewrite_time_s": 0.0,
        "total_time_s": export_s + total,
        "graph_nodes": plan.stats.get("graph_nodes"),
        "decision_groups": plan.stats.get("decision_groups"),
        "candidates_solved": len(plan.alternatives),
        "mesh": dict(plan.mesh),
    }


def run(
    out_dir: str | Path, *, quick: bool = False, sweep: CompileSweep | None = None, show_progress: bool = True
) -> dict:
    """Run both sweeps and write `compile.json`, `compile.md` and `compile.png` into `out_dir`.

    Args:
        out_dir: folder for the results (created).
        quick: fewer depths and clusters, a shallower model for the device sweep.
        sweep: a CompileSweep to run instead of the built-in one (tests pass a tiny one).
        show_progress: draw a progress bar on stderr.
    """
    sweep = sweep or (QUICK_SWEEP if quick else SWEEP)
    b, s = sweep.global_batch_size, sweep.seq_len
    layers = []
    for n in progress(sweep.layers, desc="compile: layers", enabled=show_progress):
        traced = _trace(sweep.model, n, b, s)
        layers.append({"num_layers": n} | _point(*traced, sweep.layers_cluster))
    module, args, kwargs, traced, export_s = _trace(sweep.model, sweep.devices_layers, b, s)
    devices = [
        {"num_layers": sweep.devices_layers} | _point(module, args, kwargs, traced, export_s, c)
        for c in progress(sweep.devices, desc="compile: devices", enabled=show_progress)
    ]
    doc = {
        "environment": environment(),
        "sweep": asdict(sweep),
        "memory_budget": NO_BUDGET,
        "rewrite_note": "rewrite_time_s is 0: planning only; autopar bench run reports the full compile time",
        "devices_note": "the device sweep traces once; its trace_time_s repeats that measurement",
        "layers": layers,
        "devices": devices,
    }
    out = Path(out_dir)
    write_json(out / "compile.json", doc)
    (out / "compile.md").write_text(markdown(doc))
    plot(doc, out / "compile.png")
    return doc


def _rows(points: list[dict], key: str) -> list[list]:
    return [
        [
            p[key],
            p["cluster"],
            p["graph_nodes"],
            p["decision_groups"],
            p["candidates_solved"],
            f"{p['trace_time_s']:.2f}",
            f"{p['solve_time_s']:.2f}",
            f"{p['other_time_s']:.2f}",
            f"{p['rewrite_time_s']:.2f}",
            f"{p['total_time_s']:.2f}",
        ]
        for p in points
    ]


def markdown(doc: dict) -> str:
    cols = [
        "graph nodes",
        "decision groups",
        "candidates solved",
        "tracing s",
        "solving s",
        "other s (pipeline search, ...)",
        "rewriting s",
        "total s",
    ]
    sw = doc["sweep"]
    return (
        "\n\n".join(
            [
                "# autopar bench compile",
                f"Planning time of {sw['model']} (batch {sw['global_batch_size']}x{sw['seq_len']}, memory budget lifted). "
                f"{doc['rewrite_note']}; {doc['devices_note']}. " + env_md(doc["environment"]),
                "## Layers",
                md_table(["layers", "cluster"] + cols, _rows(doc["layers"], "num_layers")),
                "## Devices",
                md_table(["devices", "cluster"] + cols, _rows(doc["devices"], "world_size")),
            ]
        )
        + "\n"
    )


def plot(doc: dict, path: Path) -> None:
    """Two panels: planning time against layers and against devices, stacked by phase."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, points, key, label in (
        (axes[0], doc["layers"], "num_layers", "layers"),
        (axes[1], doc["devices"], "world_size", "devices"),
    ):
        xs = [p[key] for p in points]
        for phase in ("trace_time_s", "solve_time_s", "other_time_s", "total_time_s"):
            ax.plot(xs, [p[phase] for p in points], marker="o", label=phase.removesuffix("_time_s"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("seconds")
        ax.legend()
    fig.suptitle("autopar bench compile: planning time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

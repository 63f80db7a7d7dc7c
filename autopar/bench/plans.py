"""`autopar bench plans`: autopar's plan next to the layouts a user would configure by hand.

Each case (a model preset, a simulated cluster, a global batch and a sequence length) is traced
once; autopar's free plan and every baseline are then priced by the same cost model through
`autopar.plan(..., constraints=...)`, so the comparison is between layouts, never between models.

Baselines (what a user of DDP, DeepSpeed or Megatron-LM would set), from the one list the report's
"Why this plan" reads too (`autopar.rationale.standard_layouts`), none of them pipelined (`pp: 1`):
- `dp`: pure data parallel, every state replicated (`{"tp": 1, "zero": 0}`);
- `zero1`, `zero2`, `zero3`: data parallel with ZeRO stage k (`{"tp": 1, "zero": k}`);
- `tp_intra_node`: tensor parallel across the devices of a node, data parallel across nodes;
- `megatron_grid`: the best point of a Megatron-style grid (`MEGATRON_GRID`), tensor-parallel
  size x micro-batches; an axis `autopar.plan` does not accept yet is left out of the grid.

What a baseline does not pin (the ZeRO stage of the tensor-parallel layouts, the number of
micro-batches of the named baselines) is left to the solver, as a careful user would tune it:
the baselines are the best of their family, so the speed-ups are conservative.

A baseline that does not fit raises `InfeasiblePlanError`; it is recorded with `fits: false`
and the error's message. The speed-up is the best fitting baseline's predicted step time over
autopar's.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

import autopar
from autopar.bench.common import (
    env_md,
    environment,
    fmt_gib,
    fmt_ms,
    fmt_pct,
    md_table,
    progress,
    pyplot,
    write_json,
)
from autopar.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.rationale import standard_layouts


@dataclass(frozen=True, slots=True)
class PlanCase:
    """One model on one simulated cluster with one batch."""

    model: str
    cluster: str
    global_batch_size: int
    seq_len: int
    # Config overrides (e.g. num_hidden_layers) for test-sized cases; empty for the published shapes.
    overrides: tuple[tuple[str, object], ...] = ()
    # A per-device memory cap for every plan of the case ("20GB"); None: the device's memory.
    memory_budget: str | None = None

    @property
    def name(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.overrides)
        budget = f", budget {self.memory_budget}" if self.memory_budget else ""
        return f"{self.model}{extra} on {self.cluster}, batch {self.global_batch_size}x{self.seq_len}{budget}"


# From 8 to 1024 simulated devices. Batches are a multiple of the device count where the cluster is
# large, so that the data-parallel baselines are priced (and found not to fit) rather than refused
# for a batch that does not divide.
CASES: tuple[PlanCase, ...] = (
    PlanCase("gpt3-1.3b", "8xA100-80GB", 32, 2048),
    PlanCase("gpt3-2.7b", "2x8xA100-80GB", 64, 2048),
    PlanCase("gpt3-6.7b", "4x8xA100-80GB", 64, 2048),
    PlanCase("gpt3-13b", "8x8xH100-80GB", 128, 2048),
    PlanCase("gpt3-175b", "128x8xH100-80GB", 1024, 2048),
    PlanCase("llama2-7b", "8xH100-80GB", 16, 4096),
    PlanCase("llama2-13b", "4x8xH100-80GB", 64, 4096),
    PlanCase("llama2-70b", "32x8xA100-80GB", 256, 4096),
)
QUICK_CASES: tuple[PlanCase, ...] = (
    PlanCase("gpt3-1.3b", "8xA100-80GB", 32, 2048),
    PlanCase("llama2-7b", "2x8xH100-80GB", 32, 2048),
)

# The Megatron-style grid: axis -> the values to try on a cluster (pipeline stages across nodes).
MEGATRON_GRID = {
    "pp": lambda c: [p for p in _divisors(c.num_nodes) if p <= 8],
    "tp": lambda c: [t for t in _divisors(c.devices_per_node) if t <= 8],
    "num_microbatches": lambda c: [1, 2, 4, 8],
}
QUICK_GRID = {
    "pp": lambda c: [1],
    "tp": lambda c: [t for t in _divisors(c.devices_per_node) if t in (1, 8)],
    "num_microbatches": lambda c: [1, 4],
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def accepted_constraint(key: str) -> bool:
    """Whether `autopar.plan` accepts the constraint `key` (it rejects unknown keys with a ConfigError)."""
    model = torch.nn.Linear(4, 4)
    try:
        autopar.plan(model, "cpu:1", (torch.randn(2, 4),), constraints={key: 1})
    except ConfigError as e:
        return not ("unknown" in str(e) and key in str(e))
    except Exception:  # noqa: BLE001 - any other failure is not about the key
        return True
    return True


@dataclass(frozen=True, slots=True)
class TracedCase:
    """A case's meta-device model, batch and trace, built once and shared by all its plans."""

    case: PlanCase
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    traced: object
    trace_time_s: float

    @classmethod
    def build(cls, case: PlanCase) -> TracedCase:
        from autopar import presets
        from autopar.trace import trace_model

        t0 = time.perf_counter()
        config = presets.load_config(case.model, **dict(case.overrides))
        module = presets.build_model(config, device="meta", dtype=torch.bfloat16)
        args, kwargs = presets.example_batch(config, case.global_batch_size, case.seq_len, device="meta")
        traced = trace_model(module, args, kwargs)
        return cls(case, module, args, kwargs, traced, time.perf_counter() - t0)

    def plan(self, constraints: dict | None = None) -> autopar.Plan:
        # The trace is shared: `_traced` is autopar.plan's hook for callers that traced already.
        cluster = ClusterSpec.parse(self.case.cluster)
        return autopar.plan(
            self.module,
            cluster,
            self.args,
            self.kwargs,
            constraints=constraints,
            precision="bf16",
            memory_budget=self.case.memory_budget,
            _traced=self.traced,
        )


def _priced(plan: autopar.Plan) -> dict:
    p = plan.predicted
    return {
        "step_time_s": p.step_time_s,
        "tflops_per_device": p.tflops_per_device,
        "mfu": p.mfu,
        "peak_memory_bytes": p.peak_memory_bytes,
        "fits": True,
        "mesh": dict(plan.mesh),
        "zero_stage": plan.zero_stage,
        "num_microbatches": getattr(plan, "num_microbatches", 1),
    }


def _not_fitting(error: Exception) -> dict:
    return {
        "step_time_s": None,
        "tflops_per_device": None,
        "mfu": None,
        "peak_memory_bytes": None,
        "fits": False,
        "error": f"{type(error).__name__}: {error}",
    }


def price(tc: TracedCase, constraints: dict) -> dict:
    """One baseline: its predicted figures, or `fits: false` and why."""
    try:
        out = _priced(tc.plan(constraints))
    except InfeasiblePlanError as e:
        out = _not_fitting(e)
    except ConfigError as e:  # a layout the case cannot express (an axis that does not divide the batch)
        out = _not_fitting(e) | {"invalid": True}
    return out | {"constraints": dict(constraints)}


def grid_points(cluster: ClusterSpec, grid: dict) -> list[dict]:
    """Every combination of the grid's axes that `autopar.plan` accepts, as constraint dicts."""
    axes = {k: values(cluster) for k, values in grid.items() if k == "tp" or accepted_constraint(k)}
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*axes.values())]


def baselines(cluster: ClusterSpec) -> dict[str, dict]:
    """The hand-configured layouts (`autopar.rationale.standard_layouts`, which the report prices too), as
    constraints for `autopar.plan`."""
    return {name: dict(pins) for name, (_, pins) in standard_layouts(cluster).items()}


def run_case(case: PlanCase, grid: dict) -> dict:
    """Trace once, plan freely, price every baseline and the grid; one `plans.json` entry."""
    tc = TracedCase.build(case)
    cluster = ClusterSpec.parse(case.cluster)
    t0 = time.perf_counter()
    try:
        free = tc.plan()
        auto = _priced(free) | {"plan_stats": dict(free.stats)}
    except InfeasiblePlanError as e:
        auto = _not_fitting(e) | {"mesh": None}
    auto["compile_time_s"] = tc.trace_time_s + (time.perf_counter() - t0)
    auto["trace_time_s"] = tc.trace_time_s
    base = {name: price(tc, c) for name, c in baselines(cluster).items()}
    points = [price(tc, c) for c in grid_points(cluster, grid)]
    fitting = [p for p in points if p["fits"]]
    best_grid = min(fitting, key=lambda p: p["step_time_s"]) if fitting else (points[0] if points else None)
    if best_grid is not None:
        base["megatron_grid"] = best_grid
    return _summarise(case, auto, base, points)


def _summarise(case: PlanCase, auto: dict, base: dict, points: list[dict]) -> dict:
    fitting = {n: b for n, b in base.items() if b["fits"]}
    best = min(fitting, key=lambda n: fitting[n]["step_time_s"]) if fitting else None
    speedup = None
    if best is not None and auto["fits"]:
        speedup = fitting[best]["step_time_s"] / auto["step_time_s"]
    for b in base.values():
        b["autopar_speedup"] = b["step_time_s"] / auto["step_time_s"] if b["fits"] and auto["fits"] else None
    return {
        "case": case.name,
        "model": case.model,
        "cluster": case.cluster,
        "global_batch_size": case.global_batch_size,
        "seq_len": case.seq_len,
        "overrides": dict(case.overrides),
        "autopar": auto,
        "baselines": base,
        "best_baseline": best,
        "speedup": speedup,
        "megatron_grid_points": points,
    }


def run(out_dir: str | Path, *, quick: bool = False, cases=None, grid=None, show_progress: bool = True) -> list[dict]:
    """Run the plans suite and write `plans.json`, `plans.md` and `plans.png` into `out_dir`.

    Args:
        out_dir: folder for the results (created).
        quick: a two-case subset with a smaller grid.
        cases: PlanCase objects to run instead of the built-in list (tests pass tiny ones).
        grid: the Megatron-style grid to use instead of the built-in one.
        show_progress: draw a progress bar on stderr.
    """
    out = Path(out_dir)
    cases = tuple(cases) if cases is not None else (QUICK_CASES if quick else CASES)
    grid = grid if grid is not None else (QUICK_GRID if quick else MEGATRON_GRID)
    results = [run_case(c, grid) for c in progress(cases, desc="plans", enabled=show_progress)]
    env = environment()
    write_json(out / "plans.json", results)
    write_json(
        out / "plans_meta.json", {"environment": env, "cases": [asdict(c) for c in cases], "grid_axes": list(grid)}
    )
    (out / "plans.md").write_text(markdown(results, env))
    plot(results, out / "plans.png")
    return results


def markdown(results: list[dict], env: dict) -> str:
    rows = []
    for r in results:
        entries = [("autopar", r["autopar"])] + list(r["baselines"].items())
        for name, e in entries:
            layout = _layout(e)
            rows.append(
                [
                    r["case"],
                    name,
                    layout,
                    fmt_ms(e["step_time_s"]),
                    None if e["tflops_per_device"] is None else f"{e['tflops_per_device']:.1f}",
                    fmt_pct(e["mfu"]),
                    fmt_gib(e["peak_memory_bytes"]),
                    "yes" if e["fits"] else "no",
                    None if e.get("autopar_speedup") is None else f"{e['autopar_speedup']:.2f}x",
                ]
            )
    summary = [
        [
            r["case"],
            r["best_baseline"],
            None if r["speedup"] is None else f"{r['speedup']:.2f}x",
            f"{r['autopar']['compile_time_s']:.1f} s",
        ]
        for r in results
    ]
    return (
        "\n\n".join(
            [
                "# autopar bench plans",
                "Predicted by autopar's cost model; every layout priced by the same model. " + env_md(env),
                md_table(["case", "best baseline that fits", "autopar speed-up", "autopar compile time"], summary),
                md_table(
                    [
                        "case",
                        "method",
                        "layout",
                        "step time",
                        "TFLOP/s/device",
                        "MFU",
                        "peak memory",
                        "fits",
                        "autopar speed-up",
                    ],
                    rows,
                ),
            ]
        )
        + "\n"
    )


def _layout(e: dict) -> str | None:
    if not e.get("fits"):
        return ", ".join(f"{k}={v}" for k, v in e.get("constraints", {}).items()) or None
    mesh = " x ".join(f"{k}={v}" for k, v in e["mesh"].items())
    extra = f", m={e['num_microbatches']}" if e.get("num_microbatches", 1) != 1 else ""
    return f"{mesh}, ZeRO-{e['zero_stage']}{extra}"


def plot(results: list[dict], path: Path) -> None:
    """Horizontal bars: autopar's speed-up over the best fitting baseline, per case."""
    plt = pyplot()
    if plt is None:
        return
    names = [r["case"] for r in results]
    values = [r["speedup"] or 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    bars = ax.barh(range(len(names)), values, color="#3b7dd8")
    for bar, r in zip(bars, results, strict=True):
        label = f"{r['speedup']:.2f}x" if r["speedup"] else "no baseline fits"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted speed-up of autopar over the best baseline that fits")
    ax.set_title("autopar bench plans")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

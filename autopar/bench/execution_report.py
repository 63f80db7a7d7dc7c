"""The report of `autopar bench run`: `run.md` (the table of methods, the calibration, the communication each
step waits for) and `run.png`, both from the document `autopar.bench.execution.run` writes to `run.json`."""

from __future__ import annotations

import os
from pathlib import Path

from autopar.bench.common import env_md, fmt_gib, fmt_ms, md_table, pyplot


def markdown(doc: dict) -> str:
    rows = []
    per_core = (doc.get("calibration") or {}).get("ranks_per_core_nominal", 1)
    for r in doc["results"]:
        for name, m in r["methods"].items():
            rows.append(
                [
                    r["model"],
                    name,
                    fmt_ms(m["median_step_time_s"]),
                    f"{fmt_ms(m['min_step_time_s'])} – {fmt_ms(m['max_step_time_s'])} ({m['spread']:.0%})",
                    fmt_ms(m["median_cpu_time_s"]),
                    fmt_gib(m["state_bytes_per_rank"]),
                    fmt_gib(m["peak_rss_delta_bytes"]),
                    _ratios(m),
                    fmt_ms(m.get("predicted_step_time_s")),
                    _prediction_error(m),
                    _cpu_prediction_error(m, per_core),
                ]
            )
        for name, reason in r["skipped"].items():
            rows.append([r["model"], name, f"not run: {reason}", None, None, None, None, None, None, None, None])
    s = doc["settings"]
    return (
        "\n\n".join(
            [
                f"# autopar bench run ({doc['cluster']})",
                f"Measured on {doc['world_size']} gloo ranks, one thread each: {s['warmup_steps']} warm-up steps, then "
                f"at least {s['repetitions']} repetitions of {s['steps_per_repetition']} steps per method (more, up to "
                f"{s.get('max_repetitions', s['repetitions'])}, until each method is timed for about "
                f"{s.get('min_measured_s', 0):g} s; the count is in each row's times), methods in rotating "
                f"order. Step time: {doc['time_measure']}. Memory: {doc['memory_measure']}. "
                + env_md(doc["environment"]),
                _calibration_md(doc.get("calibration") or {}) + _load_md(doc.get("load_average") or {}),
                md_table(
                    [
                        "model",
                        "method",
                        "median step",
                        "min – max ((max − min) / median)",
                        "CPU time per step",
                        "states per rank",
                        "peak RSS growth",
                        "time / best baseline (median of per-repetition ratios)",
                        "autopar predicted step",
                        "(predicted − measured) / measured",
                        "against CPU time",
                    ],
                    rows,
                ),
                "Against CPU time: (predicted − CPU time per step) / CPU time per step. Other work on the machine "
                "stretches the wall time of a step much more than its CPU time, so this checks the cost model's work "
                "estimate on a loaded machine; given only when each rank has a core of its own (ranks that share a "
                "core are priced with their time-slicing, which CPU time leaves out).",
                *_optimizer_md(doc["results"]),
                *_communication_md(doc["results"]),
            ]
        )
        + "\n"
    )


def _optimizer_md(results: list[dict]) -> list[str]:
    sgd = [r["model"] for r in results if r.get("optimizer", "adamw") == "sgd"]
    if not sgd:
        return []
    return [
        f"{', '.join(sgd)}: every method trains with SGD (momentum 0.9), not AdamW: AdamW's update on CPU "
        f"would take much of the step and hide the communication the run compares. autopar's prediction "
        f"prices SGD's step, measured on this machine before the run as its profile measures AdamW's."
    ]


def _communication_md(results: list[dict]) -> list[str]:
    """The communication each step waits for, measured next to predicted, and the autopar/baseline ratios."""
    rows, pairs = [], []
    for r in results:
        for name, m in r["methods"].items():
            if "measured_exposed_comm_s" not in m:
                continue
            ex = m["measured_exposed_comm_s"]
            pred = m.get("predicted_exposed_comm_s")
            err = f"{(pred - ex['median']) / ex['median']:+.0%}" if pred is not None and ex["median"] > 0 else None
            rows.append(
                [
                    r["model"],
                    name,
                    fmt_ms(m["median_step_time_s"]),
                    fmt_ms(m["noop_median_step_time_s"]),
                    f"{fmt_ms(ex['median'])} ({fmt_ms(ex['min'])} – {fmt_ms(ex['max'])})",
                    fmt_ms(pred),
                    fmt_ms(m.get("predicted_hidden_comm_s")),
                    err,
                    str(m["noop_collectives_per_step"]) + ("" if m["noop_losses_finite"] else ", loss not finite"),
                ]
            )
        for pair, p in r.get("pairs", {}).items():
            pairs.append([r["model"], pair, f"{p['median']:.2f}", f"{p['min']:.2f} – {p['max']:.2f}"])
    if not rows:
        return []
    out = [
        "## Communication the step waits for",
        "Measured exposed: per repetition, the step time minus the same method's step with every collective a "
        "no-op (`autopar.bench.noop_collectives`: c10d's collective kernels replaced by ones that complete at "
        "once; all-gathers fill in this rank's shard), taken in turn with the real steps; median (min – max) over "
        "repetitions. Predicted: the plan's communication terms the step waits for (exposed) and what it "
        "counts as hidden behind compute.",
        md_table(
            [
                "model",
                "method",
                "median step",
                "no-op step",
                "measured exposed (min – max)",
                "predicted exposed",
                "predicted hidden",
                "(predicted − measured) / measured",
                "collectives replaced per step",
            ],
            rows,
        ),
    ]
    if pairs:
        out += [
            "Step time of an autopar method over what it is compared with on the same layout (the PyTorch "
            "baseline, or the same program without overlap), per repetition (the two take turns within one):",
            md_table(["model", "autopar / compared", "median", "min – max"], pairs),
        ]
    return out


def _ratios(m: dict) -> str | None:
    if m["ratio_to_best_baseline"] is None:
        return None
    return f"{m['ratio_to_best_baseline']:.2f} ({m['paired_ratio_to_best_baseline']:.2f})"


def _prediction_error(m: dict) -> str | None:
    predicted = m.get("predicted_step_time_s")
    return None if predicted is None else f"{(predicted - m['median_step_time_s']) / m['median_step_time_s']:+.0%}"


def _cpu_prediction_error(m: dict, ranks_per_core: float) -> str | None:
    predicted, cpu = m.get("predicted_step_time_s"), m.get("median_cpu_time_s")
    if predicted is None or not cpu or ranks_per_core > 1:
        return None
    return f"{(predicted - cpu) / cpu:+.0%}"


def _load_md(load: dict) -> str:
    if load.get("before") is None:
        return ""
    return (
        f" Load average (1 min) of the machine: {load['before']:.1f} before the run, {load['after']:.1f} after "
        f"(with {os.cpu_count()} CPUs, more than the ranks means other work shared the cores)."
    )


def _calibration_md(cal: dict) -> str:
    """How the prediction was priced: the cost model as profiled on this machine before the run."""
    host = cal.get("host", {})
    parts = [
        "Predicted: autopar's plan priced by the cost model profiled on this machine just before the run: "
        "every op timed at the shapes one rank runs, with other ops run between its calls (ProfiledEstimator)"
    ]
    if host:
        parts.append(
            f"host costs per op {host['op_forward_s'] * 1e6:.1f} µs forward, {host['op_backward_s'] * 1e6:.1f}"
            f" µs backward, per view {host['view_forward_s'] * 1e6:.1f} µs + "
            f"{host['view_backward_s'] * 1e6:.1f} µs"
        )
    for name, m in (cal.get("models") or {}).items():
        fwd, bwd = m["in_step"]["scale"]
        part = (
            f"{name}, calibrated just before its run: its traced graph run forward and backward at one rank's "
            f"share took {fwd:.2f}x and {bwd:.2f}x the sums of its ops' profiles, and every op is scaled so"
        )
        if m.get("link"):
            part += (
                f"; the gloo link, fitted to what all-reduces among the ranks add to a step of host work: "
                f"{m['link']['latency_s'] * 1e6:.0f} µs per ring step, "
                f"{m['link']['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
            )
            for kind, f in (m["link"].get("per_collective") or {}).items():
                part += (
                    f", {kind.replace('_', '-')} fitted on its own: {f['latency_s'] * 1e6:.0f} µs per ring step, "
                    f"{f['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
                )
        elif m.get("link_error"):
            part += f"; link: the cpu preset's ({m['link_error']})"
        if m.get("overlap"):
            o = m["overlap"]
            part += (
                f"; overlap efficiency {o['eta']:.2f} (median over repetitions; medians: an all-reduce of "
                f"{fmt_ms(o['comm_s'])} launched while {fmt_ms(o['compute_s'])} of matmuls ran took "
                f"{fmt_ms(o['both_s'])} in all)"
            )
        if m.get("ranks_per_core", 1) > 1:
            part += (
                f"; its training step ran {m['ranks_per_core']:.2f}x slower with all ranks at once than alone "
                f"on the {cal['cores']} cores, and is priced so"
            )
        parts.append(part)
    return "; ".join(parts) + "."


def plot(results: list[dict], path: Path) -> None:
    """Grouped bars: median measured step time per method and model, with the min-max range."""
    names = list(dict.fromkeys(n for r in results for n in r["methods"]))
    plt = pyplot()
    if plt is None or not names:  # no plotting library, or every model skipped every method
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(results):
            m = r["methods"].get(name)
            if m is None:
                continue
            xs.append(i + j * width)
            ys.append(m["median_step_time_s"] * 1e3)
            lo.append((m["median_step_time_s"] - m["min_step_time_s"]) * 1e3)
            hi.append((m["max_step_time_s"] - m["median_step_time_s"]) * 1e3)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=name, capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], [r["model"] for r in results])
    ax.set_ylabel("measured step time (ms)")
    ax.set_title("autopar bench run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["markdown", "plot"]

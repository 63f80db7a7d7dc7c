"""`autopar bench run`: real training steps on local CPU ranks, autopar next to PyTorch's own APIs.

One spawned gloo job (one process per rank, one thread each, rendezvous through a file) trains
each model with every method in turn (`autopar.bench.run_methods`: autopar, free or with its layout
pinned, DDP, FSDP2 and, for LLaMA, tensor parallelism with `parallelize_module`).

Every method starts from the same initial weights and trains on the same global batch (DDP and
FSDP2 ranks take their slice, tensor-parallel ranks the whole batch, autopar takes its own
share). After warm-up steps, the methods take turns, one repetition of a few steps each, with
the order rotated every repetition so that no method always runs first; a repetition's time is
the slowest rank's mean step time. Each method's step is also timed with its collectives replaced
by no-ops (`autopar.bench.noop_collectives`), in the same rotation: the difference, repetition by
repetition, is the communication the step waits for (its exposed communication).

Memory per rank, two figures: `state_bytes`, counted from the tensors a rank holds after a step
(its parameters, gradients and optimizer states, local shards only), and `peak_rss_delta_bytes`,
the growth of the process's resident set over a repetition (the kernel's high-water mark, reset
through /proc/self/clear_refs before it; None where that file cannot be written).
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from autopar.bench.common import environment, run_on_ranks, write_json
from autopar.bench.execution_report import markdown, plot
from autopar.bench.noop_collectives import noop_collectives
from autopar.bench.run_calibration import LINK_RECORD, calibrate_cost_model, model_estimator, plan_model
from autopar.bench.run_methods import (
    BASELINES,
    DEFAULT_METHODS,
    METHODS,
    PAIRS,
    Method,
    is_autopar,
    select,
    tp_skip_reason,
)
from autopar.bench.run_models import ALL_MODELS, MODELS, QUICK_MODELS, RunModel, model_and_batch
from autopar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RunSettings:
    """How long to measure: steps before timing, repetitions, steps per repetition, samples per calibration.

    `repetitions` is the least; a model whose steps are short gets more, up to `max_repetitions`, until
    each method has been timed for about `min_measured_s` (as `timeit` picks its loop count): a few
    steps of a millisecond-scale model are too few to tell its methods apart on a busy machine.
    """

    warmup_steps: int = 2
    repetitions: int = 5
    steps_per_repetition: int = 5
    calibration_repeats: int = 5
    min_measured_s: float = 1.5
    max_repetitions: int = 30
    # also time each method's step with its collectives replaced by no-ops (`noop_collectives`), interleaved with
    # the real steps, for the communication the step waits for
    measure_exposed: bool = True
    # count the ATen ops one step of each method dispatches (after warm-up, once): its host time per op
    count_ops: bool = False


QUICK_SETTINGS = RunSettings(
    warmup_steps=2, repetitions=3, steps_per_repetition=3, calibration_repeats=3, min_measured_s=0.5, max_repetitions=15
)


def run_settings(settings: RunSettings, repetitions: int | None = None) -> RunSettings:
    """`settings` with at least `repetitions` repetitions (None: as they are); the most grows with the least."""
    if repetitions is None:
        return settings
    if repetitions < 1:
        raise ConfigError(f"bench run: repetitions must be at least 1, got {repetitions}")
    return replace(settings, repetitions=repetitions, max_repetitions=max(settings.max_repetitions, repetitions))


def _repetitions(settings: RunSettings, methods: dict) -> int:
    """Repetitions for these methods: enough that each is timed for about `min_measured_s` (one step of every
    method timed to estimate it), the same on every rank (the slowest rank's estimate)."""
    import torch.distributed as dist

    if settings.min_measured_s <= 0 or settings.max_repetitions <= settings.repetitions:
        return settings.repetitions
    dist.barrier()
    t0 = time.perf_counter()
    for m in methods.values():
        m.step()
    mean_step = torch.tensor([(time.perf_counter() - t0) / len(methods)], dtype=torch.float64)
    dist.all_reduce(mean_step, op=dist.ReduceOp.MAX)
    need = math.ceil(settings.min_measured_s / (mean_step.item() * settings.steps_per_repetition))
    return max(settings.repetitions, min(settings.max_repetitions, need))


# -------------------------------------------------------------------------------------- measuring


def _rss_reset() -> int | None:
    """Reset the resident-set high-water mark; return the current resident set, bytes (None if unsupported)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _measure(method: Method, steps: int) -> tuple[float, float, int | None]:
    """Mean step time and CPU time over `steps` (the slowest rank's of each) and this rank's resident-set growth.

    The CPU time (the process's, gloo's threads included) is the work a step costs a rank whatever else
    runs on the machine: wall time grows with other load, CPU time hardly does.
    """
    import torch.distributed as dist

    rss0 = _rss_reset()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        method.step()
    return _spent(t0, c0, steps, rss0)


def _measure_noop(method: Method, steps: int) -> tuple[float, int, bool]:
    """Mean step time over `steps` with every collective a no-op (`noop_collectives`), the slowest rank's; the
    collectives replaced per step (this rank's) and whether every loss stayed finite. The method's loss is the
    last real step's afterwards: what no-op steps compute is not the training the run reports."""
    import torch.distributed as dist

    loss = method.last_loss
    finite = True
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with noop_collectives() as replaced:
        for _ in range(steps):
            method.step()
            finite = finite and math.isfinite(float(method.last_loss))
    wall, _, _ = _spent(t0, c0, steps, None)
    method.last_loss = loss
    return wall, replaced.total // steps, finite


def _spent(t0: float, c0: float, steps: int, rss0: int | None) -> tuple[float, float, int | None]:
    """(wall, CPU time) per step since `t0`, `c0`, the slowest rank's, and the resident-set growth since `rss0`."""
    import torch.distributed as dist

    spent = torch.tensor([(time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    hwm = _proc_status("VmHWM")
    wall, cpu = spent.tolist()
    return wall, cpu, (hwm - rss0 if rss0 is not None and hwm is not None else None)


def count_ops(step) -> int:
    """The ATen ops `step()` dispatches (forward, backward, collectives and optimizer), counted by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.count += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        step()
    return Counting.count


def _train_model(
    spec: RunModel, settings: RunSettings, rank: int, world: int, say, plans: dict[str, str], names: tuple[str, ...]
) -> dict:
    config, base, ids = model_and_batch(spec)
    skip = {"tp": tp_skip_reason(config, world)} if "tp" in names else {}
    skip |= {n: METHODS[n].skip_reason(spec.optimizer) for n in names if METHODS[n].skip_reason(spec.optimizer)}
    methods = {}
    for n in names:
        if not skip.get(n):
            extra = {"plan_json": plans.get(n)} if is_autopar(n) else {}
            methods[n] = METHODS[n](copy.deepcopy(base), ids, rank, world, optimizer=spec.optimizer, **extra)
    skipped = {n: r for n, r in skip.items() if r}
    if not methods:  # every method named skips this model: nothing to time
        return {
            "model": spec.name,
            "num_parameters": sum(p.numel() for p in base.parameters()),
            "methods": {},
            "skipped": skipped,
            "optimizer": spec.optimizer,
        }
    for m in methods.values():
        for _ in range(settings.warmup_steps):
            m.step()
    ops = {n: count_ops(m.step) for n, m in methods.items()} if settings.count_ops else {}
    times, rss, cpu_times = ({n: [] for n in methods} for _ in range(3))
    noop_times, replaced, finite = ({n: [] for n in methods} for _ in range(3))
    # a no-op step takes its turn like a method: the rotation spreads the load of the machine over both
    order = [(n, noop) for n in methods for noop in ((False, True) if settings.measure_exposed else (False,))]
    repetitions = _repetitions(settings, methods)
    for rep in range(repetitions):
        say(f"{spec.name}: repetition {rep + 1}/{repetitions}")
        for n, noop in order[rep % len(order) :] + order[: rep % len(order)]:
            if noop:
                t, count, ok = _measure_noop(methods[n], settings.steps_per_repetition)
                noop_times[n].append(t)
                replaced[n].append(count)
                finite[n].append(ok)
                continue
            t, cpu, grow = _measure(methods[n], settings.steps_per_repetition)
            times[n].append(t)
            cpu_times[n].append(cpu)
            rss[n].append(grow)
    out = {}
    for n, m in methods.items():
        out[n] = {
            "times_s": times[n],
            "cpu_times_s": cpu_times[n],
            "rss_delta_bytes": rss[n],
            "state_bytes": m.state_bytes(),
            "setup_time_s": m.setup_time_s,
            "final_loss": m.last_loss,
        } | m.extra()
        if n in ops:
            out[n]["ops_per_step"] = ops[n]
        if settings.measure_exposed:
            out[n] |= {
                "noop_times_s": noop_times[n],
                "noop_collectives_per_step": max(replaced[n]),
                "noop_losses_finite": all(finite[n]),
            }
    return {
        "model": spec.name,
        "num_parameters": sum(p.numel() for p in base.parameters()),
        "methods": out,
        "skipped": skipped,
        "optimizer": spec.optimizer,
    }


def _measure_on_rank(rank: int, world: int, models, settings, show_progress: bool, plans, names) -> list[dict]:
    def say(msg):
        if rank == 0 and show_progress:
            print(f"[autopar bench run] {msg}", file=sys.stderr, flush=True)

    return [_train_model(spec, settings, rank, world, say, plans.get(spec.name, {}), names) for spec in models]


def spawn_ranks(
    world: int,
    models,
    settings: RunSettings,
    *,
    show_progress: bool = True,
    plans: dict[str, dict[str, str]] | None = None,
    methods: tuple[str, ...] = DEFAULT_METHODS,
) -> list[list[dict]]:
    """Run the measurements on `world` spawned gloo ranks; each rank's list of per-model results.

    `plans` maps a model's name to {autopar method: the JSON of the plan it runs} (planned on the ranks, with the
    method's constraints, where absent); `methods` names the methods to measure (`METHODS`).
    """
    return run_on_ranks(
        world,
        _measure_on_rank,
        tuple(models),
        settings,
        show_progress,
        dict(plans or {}),
        tuple(methods),
        label="bench run",
    )


# ---------------------------------------------------------------------------------------- reporting


# what `_summarise` carries over from rank 0's record of a method as it is
_CARRIED = (
    "predicted_step_time_s",
    "predicted_breakdown_s",
    "program",
    "mesh",
    "zero_stage",
    "plan_stats",
    "predicted_exposed_comm_s",
    "predicted_hidden_comm_s",
    "overlap",
    "noop_times_s",
    "noop_collectives_per_step",
    "ops_per_step",
)


def _summarise(per_rank: list[list[dict]]) -> list[dict]:
    """Combine the ranks' results per model: times (already the slowest rank's), memory as the max over ranks."""
    results = []
    for i, first in enumerate(per_rank[0]):
        methods = {}
        for name, m in first["methods"].items():
            ranks = [pr[i]["methods"][name] for pr in per_rank]
            median = statistics.median(m["times_s"])
            deltas = [d for r in ranks for d in r["rss_delta_bytes"] if d is not None]
            methods[name] = {
                "median_step_time_s": median,
                "min_step_time_s": min(m["times_s"]),
                "max_step_time_s": max(m["times_s"]),
                "spread": (max(m["times_s"]) - min(m["times_s"])) / median,
                "times_s": m["times_s"],
                "median_cpu_time_s": statistics.median(m["cpu_times_s"]),
                "cpu_times_s": m["cpu_times_s"],
                "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
                "peak_rss_delta_bytes": max(deltas) if deltas else None,
                "setup_time_s": max(r["setup_time_s"] for r in ranks),
                "final_loss": [r["final_loss"] for r in ranks],
            } | {k: v for k, v in m.items() if k in _CARRIED}
            methods[name] |= _exposed(m, ranks)
        base = {n: methods[n]["median_step_time_s"] for n in BASELINES if n in methods}
        best = min(base, key=base.get) if base else None
        for m in methods.values():
            m["ratio_to_best_baseline"] = m["median_step_time_s"] / base[best] if best else None
            # the methods take turns within a repetition, so a repetition's ratio sees the same load on both
            m["paired_ratio_to_best_baseline"] = (
                statistics.median(t / b for t, b in zip(m["times_s"], methods[best]["times_s"], strict=True))
                if best
                else None
            )
        results.append(
            {
                "model": first["model"],
                "num_parameters": first["num_parameters"],
                "methods": methods,
                "skipped": first["skipped"],
                "optimizer": first.get("optimizer", "adamw"),
                "pairs": _pairs(methods),
            }
        )
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _exposed(m: dict, ranks: list[dict]) -> dict:
    """The communication a step waits for, measured: per repetition, its step time minus the same repetition's
    no-op step time (both the slowest rank's); the median and range over repetitions."""
    if "noop_times_s" not in m:
        return {}
    exposed = [t - n for t, n in zip(m["times_s"], m["noop_times_s"], strict=True)]
    return {
        "noop_median_step_time_s": statistics.median(m["noop_times_s"]),
        "exposed_comm_s": exposed,
        "measured_exposed_comm_s": _spread(exposed),
        "noop_losses_finite": all(r["noop_losses_finite"] for r in ranks),
    }


def _pairs(methods: dict) -> dict:
    """For each (autopar method, the method it is compared with) of `PAIRS` both measured: the per-repetition ratios of their step
    times (the two take turns within a repetition, so a ratio sees one load), median and range."""
    out = {}
    for a, b in PAIRS:
        if a in methods and b in methods:
            ratios = [x / y for x, y in zip(methods[a]["times_s"], methods[b]["times_s"], strict=True)]
            out[f"{a}/{b}"] = _spread(ratios) | {"ratios": ratios}
    return out


def run(
    out_dir: str | Path,
    *,
    cluster: str = "cpu:2",
    quick: bool = False,
    models=None,
    settings=None,
    show_progress: bool = True,
    methods=DEFAULT_METHODS,
    repetitions: int | None = None,
) -> dict:
    """Run the run suite on local CPU ranks and write `run.json`, `run.md` and `run.png` into `out_dir`.

    Args:
        out_dir: folder for the results (created).
        cluster: "cpu:N", the number of local gloo ranks to spawn.
        quick: the tiny models, fewer repetitions.
        models: RunModel objects, or their names in `ALL_MODELS` (a list or comma-separated text), to train
            instead of the built-in list.
        settings: RunSettings to use instead of the built-in ones.
        show_progress: rank 0 prints a line per repetition on stderr.
        methods: the methods to measure, names in `METHODS` (a list or comma-separated text).
        repetitions: the least number of repetitions (the settings' `repetitions`; their maximum grows with it).
    """
    world = _cpu_world(cluster)
    if isinstance(models, str) or (models is not None and any(isinstance(m, str) for m in models)):
        models = select(models, {m.name: m for m in ALL_MODELS}, "model")
    methods = tuple(m.name for m in select(methods, METHODS, "method"))
    models = tuple(models) if models is not None else (QUICK_MODELS if quick else MODELS)
    settings = run_settings(settings or (QUICK_SETTINGS if quick else RunSettings()), repetitions)
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Each model is calibrated (link, shared cores, in-step scale) and planned just before it is measured: the
    # machine's speed drifts over minutes, and a calibration taken long before a run prices another machine.
    calibration: dict = {"models": {}}
    load_before = _load_average()
    results = []
    for m in models:
        cluster_spec, record = calibrate_cost_model(
            world, out, repeats=settings.calibration_repeats, show_progress=show_progress
        )
        link = {k: record.pop(k) for k in LINK_RECORD if k in record}
        calibration.update(record)
        estimator, calibration["models"][m.name] = model_estimator(
            m, world, out, repeats=settings.calibration_repeats, show_progress=show_progress
        )
        calibration["models"][m.name] |= link
        plans = {
            n: plan_model(
                m, cluster_spec, estimator, METHODS[n].constraints(world), METHODS[n].plan_options()
            ).to_json()
            for n in methods
            if is_autopar(n) and not METHODS[n].skip_reason(m.optimizer)
        }
        results += _summarise(
            spawn_ranks(world, [m], settings, show_progress=show_progress, plans={m.name: plans}, methods=methods)
        )
    doc = {
        "environment": environment(),
        "cluster": cluster,
        "world_size": world,
        "settings": asdict(settings),
        "calibration": calibration,
        "load_average": {"before": load_before, "after": _load_average()},
        "memory_measure": "state_bytes_per_rank: parameters + gradients + optimizer states held by a rank, "
        "counted from its tensors; peak_rss_delta_bytes: growth of the resident set "
        "(VmHWM after reset through /proc/self/clear_refs) over a repetition, max over ranks",
        "time_measure": "median over repetitions of the mean step time of a repetition, slowest rank "
        "(CPU time per step: the same for the process's CPU time)",
        "wall_time_s": time.perf_counter() - t0,
        "results": results,
    }
    write_json(out / "run.json", doc)
    (out / "run.md").write_text(markdown(doc))
    plot(results, out / "run.png")
    return doc


def _load_average() -> float | None:
    """The machine's one-minute load average: other work on the cores slows a run that the cost model cannot see."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _cpu_world(cluster: str) -> int:
    text = str(cluster).strip().lower()
    if not text.startswith("cpu:") or not text[4:].isdigit() or int(text[4:]) < 1:
        raise ConfigError(
            f"bench run trains on local CPU ranks: --cluster must be 'cpu:N' (e.g. cpu:2), got {cluster!r}"
        )
    return int(text[4:])

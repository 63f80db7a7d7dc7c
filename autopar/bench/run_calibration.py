"""What `autopar bench run` measures of the machine and of each model before running it, for the cost model to
price the run with: the link and overlap among the local ranks (`calibrate_cost_model`), the shared-core slowdown
and in-step scale of a model (`model_estimator`); and autopar's plan of a model priced so (`plan_model`)."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from autopar.bench.run_methods import make_optimizer
from autopar.bench.run_models import RunModel, model_and_batch

# what `calibrate_cost_model` records of the link: kept per model, as each model's run is priced with its own
LINK_RECORD = ("collective_median_s", "link", "link_error", "overlap")


def calibrate_cost_model(world: int, folder: Path, *, repeats: int = 5, show_progress: bool = True):
    """What the cost model needs of this machine for `world` local ranks, whatever the model: (cluster, record).

    The cluster is cpu:`world` with its link fitted to gloo all-reduces among `world` processes
    (`calibrate.measure_gloo_collectives`, `calibrate.fit_link`) and its overlap efficiency measured among them
    (`calibrate.measure_overlap_efficiency`); the record says what was measured, for run.json, including
    the host costs of the profile cache in `folder` (so every run profiles afresh). What depends on
    the model is measured by `model_estimator`.
    """
    from autopar.cluster import ClusterSpec
    from autopar.cost_model.calibrate import fit_link, measure_gloo_collectives, measure_overlap_efficiency
    from autopar.cost_model.profiler import ProfiledEstimator

    overrides: dict = {"cluster": f"cpu:{world}"}
    record: dict = {}
    if world > 1:
        if show_progress:
            print(
                f"[autopar bench run] measuring gloo all-reduce, all-gather and reduce-scatter among {world} ranks",
                file=sys.stderr,
                flush=True,
            )
        times = measure_gloo_collectives(world, repeats)
        record["collective_median_s"] = {kind: {str(k): v for k, v in t.items()} for kind, t in times.items()}
        try:
            overrides["intra_node_link"] = fit_link(times, world)
        except ValueError as e:  # a machine too busy to measure: keep the preset's link, and say so
            warnings.warn(f"bench run: {e}; pricing the link with the cpu preset's figures", stacklevel=2)
            record["link_error"] = str(e)
        else:
            record["link"] = overrides["intra_node_link"]
        record["overlap"] = measure_overlap_efficiency(world)
        overrides["device"] = {"overlap_efficiency": record["overlap"]["eta"]}
    cluster = ClusterSpec.from_overrides(overrides, source="bench run calibration")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    estimator = ProfiledEstimator(_profile_cache(folder))
    record |= {
        "cores": cores,
        "ranks_per_core_nominal": max(1.0, world / cores),
        "host": estimator.host_overheads(),
        "profile_cache": str(estimator.cache_path),
    }
    return cluster, record


def _profile_cache(folder: Path) -> Path:
    return Path(folder) / "profile-cpu.json"


def _one_rank(spec: RunModel, world: int):
    """`spec`'s model and the rows of its global batch one of `world` data-parallel ranks trains on."""
    _, model, ids = model_and_batch(spec)
    return model, ids[: max(1, ids.shape[0] // world)]


def plain_training_step(spec: RunModel, world: int):
    """A step (forward, backward, the spec's optimizer) of `spec`'s model on one rank's share of the batch, as a callable."""
    model, ids = _one_rank(spec, world)
    optimizer = make_optimizer(model.parameters(), spec.optimizer)

    def step():
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def model_estimator(spec: RunModel, world: int, folder: Path, *, repeats: int = 5, show_progress: bool = True):
    """The profiled estimator autopar plans `spec` with on `world` local ranks: (estimator, record).

    Two things it is told are measured with the model itself, at one rank's share of the batch:

    - how much longer a training step of the model runs while all `world` ranks run theirs than alone
      (`calibrate.measure_shared_core_slowdown` on `plain_training_step`): ranks on the same cores
      time-slice them, and even at a core each they share caches and memory bandwidth, by an amount
      that depends on the work;
    - how the model's traced graph, run forward and backward as a step, compares with the sum of its
      ops' profiles (`profiler.measure_in_step_scale`).

    A model trained with another optimizer than AdamW has the estimator price that optimizer's step, measured
    (`calibrate.measure_optimizer_step`) and cached in the profile, instead of the profile's AdamW.

    Every op is still priced from its own profile; these two scale them.
    """
    import functools

    from autopar.cost_model.calibrate import measure_shared_core_slowdown
    from autopar.cost_model.profiler import ProfiledEstimator, measure_in_step_scale
    from autopar.passes.program_graph import drop_assertions_pass
    from autopar.runtime import flat_inputs, placeholder_values
    from autopar.trace import trace_model

    if show_progress:
        print(
            f"[autopar bench run] {spec.name}: measuring its step alone and on {world} ranks at once",
            file=sys.stderr,
            flush=True,
        )
    slowdown = (
        measure_shared_core_slowdown(world, make_work=functools.partial(plain_training_step, spec, world))
        if world > 1
        else 1.0
    )
    model, ids = _one_rank(spec, world)
    traced = trace_model(model, (ids,), {"labels": ids})
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    params = [named[n].detach().clone().requires_grad_(named[n].requires_grad) for n in traced.param_names]
    values = placeholder_values(
        traced,
        params,
        [buffers[n] for n in traced.buffer_names],
        traced.exported.constants.get,
        flat_inputs(traced, (ids,), {"labels": ids}),
    )
    gm = drop_assertions_pass(traced.graph_module, None)
    measured = measure_in_step_scale(
        ProfiledEstimator(_profile_cache(folder)),
        gm,
        values,
        loss_index=traced.num_mutated_outputs,
        repeats=max(repeats, 5),
    )
    # the optimizer the methods train with, measured as the profile measures AdamW (one thread, as a rank runs)
    optimizer = (
        None if spec.optimizer == "adamw" else (spec.optimizer, functools.partial(make_optimizer, kind=spec.optimizer))
    )
    estimator = ProfiledEstimator(
        _profile_cache(folder), ranks_per_core=slowdown, in_step=measured.scale, optimizer=optimizer
    )
    record = {
        "shared_core_slowdown": slowdown,
        "ranks_per_core": estimator.ranks_per_core,
        "in_step": asdict(measured) | {"scale": list(measured.scale)},
    }
    if optimizer is not None:
        record["optimizer_step"] = {"optimizer": spec.optimizer} | estimator.optimizer_overheads()
    return estimator, record


def plan_model(spec: RunModel, cluster, estimator, constraints: dict | None = None, options: dict | None = None):
    """autopar's plan for `spec` on `cluster`, priced by `estimator`, with `constraints` (and the other `autopar.plan`
    settings in `options`) pinned."""
    import autopar

    _, base, ids = model_and_batch(spec)
    return autopar.plan(
        base,
        cluster,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
        estimator=estimator,
        alternatives=False,
        constraints=constraints,
        **(options or {}),
    )


__all__ = ["LINK_RECORD", "calibrate_cost_model", "model_estimator", "plain_training_step", "plan_model"]

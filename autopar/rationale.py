"""Why a plan won: the layouts a user would pick by hand, priced by the same cost model, and the terms of a step.

The report's "Why this plan" and "Your layout" sections are built from what this module records while
planning (`autopar.plan` stores it in the plan, so a plan read back from JSON reports the same):

- `time_terms`: one step's predicted time split into compute, recompute, the communication of each
  mesh axis (tp: resharding inside ops; dp: gradient sync and ZeRO gathers; pp: stage-to-stage sends; cp:
  attention's K/V traffic across the group),
  the pipeline bubble, host offload traffic, the optimizer step and what is left (the sharded
  runtime's per-op overhead). The terms sum to the step time; a communication term is what the step
  waits for (exposed), and `hidden_terms` is, per mesh axis, what overlap hides behind compute.
- `standard_layouts`: the hand-configured layouts (pure data parallelism, ZeRO-1/2/3, tensor parallel
  across a node) as `autopar.plan` constraints, the one list of them: `bench plans` prices every one,
  the report DDP and ZeRO-3 (`REPORTED_LAYOUTS`) next to the best Megatron-style tp x pp point.
- `entry`: one priced layout (or the reason it cannot run) as a JSON-ready dict, with the one line
  that says why it lost to the chosen plan (`loss_reason`), worked out from the two plans' terms.
- `parse_layout`: the `--compare` syntax, "tp=8,pp=4,zero=1", as constraints.
- `format_flops_rate`: a FLOP/s figure as the plan's summary and the report write it.
"""

from __future__ import annotations

import dataclasses
import warnings

from autopar.errors import AutoparError, ConfigError

# the terms of one step, in the order the report stacks them
TERMS = ("compute", "recompute", "comm_tp", "comm_dp", "comm_pp", "comm_cp", "bubble", "offload", "optimizer", "other")
# the terms that are one mesh axis's communication: exposed in `time_terms`, hidden in `hidden_terms`
COMM_TERMS = ("comm_tp", "comm_dp", "comm_pp", "comm_cp")
TERM_LABELS = {
    "compute": "compute",
    "recompute": "recompute",
    "comm_tp": "tp communication (resharding)",
    "comm_dp": "dp communication (gradient sync, ZeRO gathers)",
    "comm_pp": "pp communication (stage sends)",
    "comm_cp": "cp communication (attention across the group)",
    "bubble": "pipeline bubble",
    "offload": "host offload traffic",
    "optimizer": "optimizer step",
    "other": "runtime overhead",
}
# layout keys `parse_layout` accepts and how their values read ("zero" is the ZeRO stage)
_INT_KEYS = ("tp", "dp", "pp", "cp", "zero", "num_microbatches", "micro_batch_size", "virtual_stages")
_STR_KEYS = ("schedule", "recompute", "cp_attention")
_ALIASES = {
    "m": "num_microbatches",
    "microbatches": "num_microbatches",
    "mbs": "micro_batch_size",
    "v": "virtual_stages",
}


def sharded_terms(
    *,
    step_s: float,
    compute_s: float,
    recompute_s: float,
    reshard_s: float,
    grad_sync_s: float,
    offload_s: float,
    optimizer_s: float,
    cp_comm_s: float = 0.0,
) -> dict[str, float]:
    """The terms of a layout without a pipeline (`compute_s` includes `recompute_s`, as the solver reports it;
    `cp_comm_s`, cp attention's exposed communication, is not in it)."""
    terms = {
        "compute": compute_s - recompute_s,
        "recompute": recompute_s,
        "comm_tp": reshard_s,
        "comm_dp": grad_sync_s,
        "comm_cp": cp_comm_s,
        "offload": offload_s,
        "optimizer": optimizer_s,
    }
    other = step_s - sum(terms.values())
    terms["other"] = other if other > 1e-12 * step_s else 0.0  # below that, rounding in the sums
    return {k: terms.get(k, 0.0) for k in TERMS}


def hidden_terms(
    *, grad_sync_hidden_s: float, transfer_hidden_s: float = 0.0, cp_hidden_s: float = 0.0, tp_hidden_s: float = 0.0
) -> dict[str, float]:
    """Per mesh axis (its `COMM_TERMS` key), the communication time overlap hides behind compute: not in the step.

    The data axis: gradient reductions that run while backward goes on (`grad_sync_hidden_s`: the data-parallel
    program's, priced by `ShardingProgram.add_overlap_constraint`; the sharded program's gradient buckets and its
    ZeRO gathers issued ahead of use, `ShardingProgram.add_sharded_overlap_constraint`; a pipeline's, the sync of
    the stage that ends the step hidden behind its own last backward and the backwards still running,
    `passes.pipeline`). The
    pipeline axis: the part of the stage transfers of a step that runs behind the stage's compute
    (`transfer_hidden_s`). The cp axis: what cp attention's compute hides of its communication (a ring's hops
    behind the blocks they feed, `cp_hidden_s`). The tensor axis: the collectives the interpreter launches where
    their value is made, behind the ops before its first use (`tp_hidden_s`, `MeshGroups.early_window`).
    Axes that hide nothing are left out, so a plan without overlap has none.
    """
    terms = {
        "comm_dp": grad_sync_hidden_s,
        "comm_pp": transfer_hidden_s,
        "comm_cp": cp_hidden_s,
        "comm_tp": tp_hidden_s,
    }
    return {k: v for k, v in terms.items() if v > 1e-12}  # solver rounding (1e-18 s) is no hidden time


def pipeline_terms(
    *,
    step_s: float,
    num_microbatches: int,
    stage_s: float,
    transfer_s: float,
    grad_sync_s: float,
    optimizer_s: float,
    cp_s: float = 0.0,
) -> dict[str, float]:
    """The terms of a pipeline: the slowest stage's m micro-batches of compute and sends, the bubble the rest.

    `stage_s` and `transfer_s` are the bottleneck stage's compute (with its tp resharding and `cp_s`, the exposed
    communication of its cp attention) and the exposed part of its sends per micro-batch, `grad_sync_s` the exposed
    sync of the stage that ends the step (what overlap hides of either is in `hidden_terms`); the step is
    (m + bubble slots) x (stage_s + transfer_s) + grad_sync_s + optimizer_s.
    """
    busy = num_microbatches * (stage_s + transfer_s)
    terms = {
        "compute": num_microbatches * (stage_s - cp_s),
        "comm_cp": num_microbatches * cp_s,
        "comm_pp": num_microbatches * transfer_s,
        "bubble": max(0.0, step_s - grad_sync_s - optimizer_s - busy),
        "comm_dp": grad_sync_s,
        "optimizer": optimizer_s,
    }
    return {k: terms.get(k, 0.0) for k in TERMS}


# why a faster alternative did not replace the chosen plan (`loss_reason`), unless the caller knows better
PINNED = "whose layout the constraints pin"
# the hand layouts the report's "Why this plan" prices (`bench plans` prices every one of `standard_layouts`)
REPORTED_LAYOUTS = ("dp", "zero3")


def standard_layouts(cluster) -> dict[str, tuple[str, dict]]:
    """The hand-configured layouts, name -> (label, `autopar.plan` constraints), none of them pipelined: DDP,
    ZeRO-1/2/3 (no tensor axis, states sharded over every device) and tp across one node (dp across nodes).

    The one list of them: `bench plans` prices all, the report those named in `REPORTED_LAYOUTS`. What a
    layout does not pin (micro-batches, recompute, the ZeRO stage of the tensor-parallel one) is left to the
    solver, as a careful user would tune it, so each is the best of its family.
    """
    per_node = cluster.devices_per_node
    words = {1: "optimizer states", 2: "optimizer states and gradients"}
    out = {"dp": ("pure data parallelism (DDP: every state replicated)", {"pp": 1, "tp": 1, "zero": 0})}
    out |= {
        f"zero{k}": (f"ZeRO-{k} ({words[k]} sharded over all devices)", {"pp": 1, "tp": 1, "zero": k}) for k in (1, 2)
    }
    out["zero3"] = ("ZeRO-3 / FSDP (every state sharded over all devices)", {"pp": 1, "tp": 1, "zero": 3})
    out["tp_intra_node"] = (
        f"tensor parallel across the {per_node} devices of a node, data parallel across nodes",
        {"pp": 1, "tp": per_node},
    )
    return out


def megatron_tp_sizes(cluster) -> list[int]:
    """Tensor-parallel sizes of the Megatron-style grid: the node's devices (at most 8) and half of that."""
    full = max(d for d in range(1, min(8, cluster.devices_per_node) + 1) if cluster.devices_per_node % d == 0)
    return sorted({full, full // 2} - {0}, reverse=True)


def layout_words(plan) -> str:
    """'pp=8 dp=16 tp=4, ZeRO-1, 96 micro-batches, 1f1b, selective recompute' for a plan."""
    ep = plan.expert_parallel.get("degree", 1)
    mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.items()) + (f" ep={ep}" if ep > 1 else "")
    words = [mesh, f"ZeRO-{plan.zero_stage}"]
    if plan.num_microbatches > 1:
        words.append(f"{plan.num_microbatches} micro-batches")
    if plan.pipeline:
        v = plan.pipeline.get("virtual_stages", 1)
        words.append(plan.pipeline.get("schedule", "") + (f" x{v}" if v > 1 else ""))
    if plan.layer_modes:
        words.append("per-layer activation treatment")
    elif plan.recompute != "none":
        words.append(f"{plan.recompute} recompute")
    if plan.offload:
        words.append(f"{plan.offload.get('optimizer_fraction', 0.0):.0%} of optimizer states on the host")
    return ", ".join(words)


def entry(name: str, label: str, constraints: dict, priced, chosen, kept: str = PINNED) -> dict:
    """One alternative for the report: `priced` is its Plan, or the autopar error that says why it cannot run
    (`kept`: see `loss_reason`)."""
    base = {"name": name, "label": label, "constraints": dict(constraints)}
    if isinstance(priced, Exception):
        return base | {
            "feasible": False,
            "layout": _constraint_words(constraints),
            "step_time_s": None,
            "peak_memory_bytes": None,
            "reason": f"{type(priced).__name__}: {priced}",
        }
    p = priced.predicted
    return base | {
        "feasible": True,
        "layout": layout_words(priced),
        "mesh": dict(priced.mesh),
        "zero_stage": priced.zero_stage,
        "num_microbatches": priced.num_microbatches,
        "program": str(priced.program),
        "step_time_s": p.step_time_s,
        "mfu": p.mfu,
        "peak_memory_bytes": p.peak_memory_bytes,
        "memory": dict(p.memory_breakdown),
        "terms": dict(priced.time_breakdown),
        **({"hidden": dict(priced.hidden_communication)} if priced.hidden_communication else {}),
        "reason": loss_reason(priced, chosen, kept),
    }


GREW_AS_PERCENT = 10.0  # a term that grew by more than 10 times itself is given from what it was, not in % (+117096%)


def loss_reason(alt, chosen, kept: str = PINNED) -> str:
    """One line: why `alt` (a Plan) lost to `chosen`, from the term that grew most; `kept` says why a faster `alt`
    did not replace it."""
    t_alt, t_chosen = alt.predicted.step_time_s, chosen.predicted.step_time_s
    if _same_layout(alt, chosen):
        return "the chosen plan's layout"
    if t_alt < t_chosen * (1 - 1e-9):  # a pinned plan, or one priced after planning (a free plan adopts a faster one)
        return f"{1 - t_alt / t_chosen:.1%} faster than the chosen plan, {kept}"
    if t_alt <= t_chosen * (1 + 1e-9):
        return "as fast as the chosen plan"
    deltas = {k: alt.time_breakdown.get(k, 0.0) - chosen.time_breakdown.get(k, 0.0) for k in TERMS}
    worst = max(deltas, key=deltas.get)
    before = chosen.time_breakdown.get(worst, 0.0)
    if before <= 0:  # the chosen plan has none of it
        grew = ""
    elif deltas[worst] <= GREW_AS_PERCENT * before:
        grew = f" (+{deltas[worst] / before:.0%})"
    else:  # a percentage of a near-zero term says nothing (+117096%): what it grew from does
        grew = f" (from {_seconds(before)})"
    prefix = ""
    tp, per_node = alt.mesh.get("tp", 1), alt.cluster.devices_per_node
    if tp > per_node and alt.cluster.num_nodes > 1:
        prefix = f"tp={tp} crosses nodes: "
    return (
        f"{prefix}{t_alt / t_chosen - 1:+.0%} step time, most of it {TERM_LABELS[worst]} "
        f"+{_seconds(deltas[worst])}{grew}"
    )


def _same_layout(a, b) -> bool:
    return (
        a.mesh == b.mesh
        and a.expert_parallel.get("degree", 1) == b.expert_parallel.get("degree", 1)
        and a.zero_stage == b.zero_stage
        and a.num_microbatches == b.num_microbatches
        and a.recompute == b.recompute
        and a.layer_modes == b.layer_modes
        and bool(a.offload) == bool(b.offload)
        and a.pipeline.get("schedule") == b.pipeline.get("schedule")
        and a.pipeline.get("virtual_stages") == b.pipeline.get("virtual_stages")
    )


def format_flops_rate(tflops: float) -> str:
    """A FLOP/s figure given in TFLOP/s, in GFLOP/s below one TFLOP/s (CPU plans would read 0.0 otherwise)."""
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:,.2f} GFLOP/s"


def _seconds(s: float) -> str:
    return f"{s:,.2f} s" if s >= 1 else f"{s * 1e3:,.2f} ms"


def _constraint_words(constraints: dict) -> str:
    return ", ".join(f"{'ZeRO' if k == 'zero' else k}={v}" for k, v in constraints.items()) or "(free)"


def parse_layout(text) -> dict:
    """'tp=8,pp=4,zero=1' (or a dict) as `autopar.plan` constraints; a ConfigError names what is wrong."""
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).replace(" ", ",").split(","):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not value:
                raise ConfigError(f"layout {text!r}: {part!r} is not key=value; write layouts like 'tp=8,pp=4,zero=1'")
            items.append((key.strip().lower(), value.strip()))
    out = {}
    for key, value in items:
        key = _ALIASES.get(key, key)
        if key in _INT_KEYS:
            try:
                out[key] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"layout {text!r}: {key}={value!r} is not a whole number") from None
        elif key in _STR_KEYS:
            out[key] = str(value)
        else:
            raise ConfigError(
                f"layout {text!r}: unknown key {key!r}; expected some of {', '.join(_INT_KEYS + _STR_KEYS)}"
            )
    if not out:
        raise ConfigError(f"layout {text!r} names nothing; write layouts like 'tp=8,pp=4,zero=1'")
    return out


def layout_name(constraints: dict) -> str:
    """The --compare spelling of a layout's constraints."""
    return ",".join(f"{k}={v}" for k, v in constraints.items())


def with_rationale(
    chosen, runner_up, price, *, say=None, baselines: bool = True, compare=(), adopt: bool = True, kept: str = PINNED
):
    """`chosen` with its `baselines` and `comparisons` priced; the fastest plan of all when one beats it.

    Args:
        chosen: the search's plan.
        runner_up: the search's next best layout: a Plan, constraints to price, or None.
        price: callable(constraints) -> Plan under the same cost model and settings; raises an autopar
            error (InfeasiblePlanError, ConfigError) when the layout cannot run.
        say: progress callable.
        baselines: price DDP, ZeRO-3, the Megatron-style grid and the runner-up.
        compare: the user's layouts ("tp=8,pp=4,zero=1" strings or constraint dicts).
        adopt: let a faster alternative replace `chosen` (False when the user pinned the layout: the
            alternatives are then listed next to the pinned plan, not put in its place).
        kept: why a faster alternative did not replace `chosen`, as its one line says it (adopt=False).
    """
    say = say or (lambda msg: None)
    rows = []  # (name, label, constraints, Plan or error)
    if baselines:
        hand = standard_layouts(chosen.cluster)
        rows += [_price_one(name, *hand[name], price, say) for name in REPORTED_LAYOUTS]
        rows.append(_best_grid_point(chosen, price, say, searched=adopt))
        if isinstance(runner_up, dict):
            rows.append(_price_one("runner_up", "the search's runner-up", runner_up, price, say))
        elif runner_up is not None:
            rows.append(
                ("runner_up", "the search's runner-up (the best plan without a pipeline)", {"pp": 1}, runner_up)
            )
    mine = [
        _price_one(layout_name(pins), "your layout", pins, price, say) for pins in (parse_layout(c) for c in compare)
    ]
    if adopt and _fastest(rows + mine, chosen) is not chosen:
        chosen = _adopt(chosen, rows, mine, price, say)
    return dataclasses.replace(
        chosen,
        baselines=tuple(entry(*r, chosen, kept) for r in rows),
        comparisons=tuple(entry(*r, chosen, kept) for r in mine),
    )


def _fastest(rows: list[tuple], chosen):
    """The plan of `rows` that is faster than `chosen` (beyond float noise) and fastest, else `chosen`."""
    fitting = [r[3] for r in rows if not isinstance(r[3], Exception)]
    best = min(fitting, key=lambda p: p.predicted.step_time_s, default=chosen)
    return best if best.predicted.step_time_s < chosen.predicted.step_time_s * (1 - 1e-9) else chosen


def _adopt(searched, rows: list[tuple], mine: list[tuple], price, say):
    """The fastest alternative in place of the search's plan `searched`, which a layout its pruning passed over
    beats under the same cost model; `rows` gains the search's answer as an alternative.

    The best Megatron-style grid point was taken to be the search's plan (`_best_grid_point`, searched=True);
    beaten, that no longer holds, so the grid is priced point by point before the fastest is picked. The plan
    keeps the search's table of meshes solved (its own is that of one pinned layout) and says what it adopted
    (stats["adopted"]: the alternative's name) in the search's planning statistics.
    """
    at = next((i for i, r in enumerate(rows) if r[0] == "megatron" and r[3] is searched), None)
    if at is not None:
        rows[at] = _best_grid_point(searched, price, say, searched=False)
    best = _fastest(rows + mine, searched)
    name = next(r[0] for r in rows + mine if r[3] is best)
    say(f"an alternative beats the search's plan: {name}: {layout_words(best)}")
    rows.append(("search", "the search's own answer (beaten by an alternative)", {}, searched))
    return dataclasses.replace(best, alternatives=searched.alternatives, stats=searched.stats | {"adopted": name})


def _best_grid_point(chosen, price, say, *, searched: bool) -> tuple:
    """The fastest point of the Megatron-style grid: tp inside a node, pp (and micro-batches) searched.

    `searched`: `chosen` is the search's optimum over a space that holds the whole grid (a free plan: the
    search covers every tensor axis inside a node, with and without a pipeline). No grid point is then
    faster than `chosen`, and when its tensor axis is one of the grid's (and it splits no sequence over a cp
    axis, which the grid does not) it is the best grid point itself: nothing is priced again. Otherwise each of
    the grid's tensor axes is searched with tp pinned (and no cp).
    """
    sizes = megatron_tp_sizes(chosen.cluster)
    label = f"best Megatron-style grid point (tp in {{{', '.join(map(str, sizes))}}} x pp searched)"
    tp = chosen.mesh.get("tp", 1)
    # a cp plan is no point of the grid, nor an ep plan
    if searched and tp in sizes and chosen.mesh.get("cp", 1) == 1 and chosen.expert_parallel.get("degree", 1) == 1:
        say(f"alternative megatron: the search's own plan (tp={tp})")
        return "megatron", label, {"tp": tp}, chosen
    priced = [_price_one("megatron", label, {"tp": t}, price, say) for t in sizes]
    fitting = [r for r in priced if not isinstance(r[3], Exception)]
    if fitting:
        return min(fitting, key=lambda r: r[3].predicted.step_time_s)
    return priced[0]


def _price_one(name: str, label: str, pins: dict, price, say) -> tuple:
    say(f"pricing alternative {name}: {layout_name(pins)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's own plan already said what these would
            return name, label, pins, price(dict(pins))
    except AutoparError as e:
        return name, label, pins, e

"""The plan report's sections on where the model runs: the Layer table (each layer's ops, sharding and
stage) and the Pipeline (stages, schedule, and a Gantt chart of one step). `explain.py` renders them.
"""

from __future__ import annotations

from collections import Counter

from autopar.cost_model.experts import EXPERT_SYNC_AXIS
from autopar.report_charts import gantt_svg, gantt_text, schedule_order, simulate
from autopar.report_figures import fmt_gib, fmt_ms, index_ranges


def _stage_of(plan, name: str):
    """The pipeline stage that holds parameter `name` (by its layer index), or None."""
    if not plan.pipeline:
        return None
    idx = next((int(p) for p in name.split(".") if p.isdigit()), None)
    for st in plan.pipeline["stages"]:
        if idx is None:
            if (st["index"] == 0) == ("embed" in name or "wte" in name or "wpe" in name):
                return st["index"] if st["index"] == 0 else plan.pipeline["stages"][-1]["index"]
        elif any(a <= idx < b for a, b in st["layers"]):
            return st["index"]
    return None


def layer_blocks(plan) -> list:
    groups: dict[str, Counter] = {}
    stages: dict[str, set] = {}
    for name, pl in plan.param_placements.items():
        key = ".".join("*" if p.isdigit() else p for p in name.split("."))
        groups.setdefault(key, Counter())[pl] += 1
        st = _stage_of(plan, name)
        if st is not None:
            stages.setdefault(key, set()).add(st)
    rows = [
        [
            f"`{key}`",
            ", ".join(f"{pl} x{n}" if n > 1 else pl for pl, n in cnt.items()),
            index_ranges(stages[key]) if key in stages else "-",
        ]
        for key, cnt in groups.items()
    ]
    blocks = [
        ("h2", "Layer table"),
        (
            "p",
            "Parameters by kind (layer indices folded into *), their placement on the tensor axis, and the "
            "pipeline stage(s) holding them.",
        ),
        ("table", ["parameter", "placement", "stage"], rows),
    ]
    if plan.layer_ops:
        blocks.append(
            (
                "p",
                "Each deduplicated layer's ops (one layer stands for all alike), with their placement on the "
                "tensor axis (the inputs as the op needs them, its output) and the collectives the plan "
                "inserts for them: kind, mesh axis, pass, bytes (the full tensor on one data-parallel rank "
                "for one micro-batch), time of one run, runs per step (layers x micro-batches) and time per "
                "step, and the part of it the step waits for (exposed). Views and elementwise ops that keep their "
                "producer's layout and need no collective are left out; a parameter's dp row is its "
                "gradient sync (and ZeRO gathers) in one step"
                + _expert_sync_words(plan)
                + "."
                + _apportion_words(plan),
            )
        )
        for entry in plan.layer_ops:
            blocks += _layer_ops(entry)
    strategies = Counter(s for s in plan.node_strategy.values() if not s.startswith("follows"))
    if strategies:
        blocks += [
            ("h3", "Op strategies (whole model)"),
            ("table", ["strategy", "ops"], [[s or "(single choice)", str(n)] for s, n in strategies.most_common()]),
        ]
    return blocks


def _expert_sync_words(plan) -> str:
    """What an expert weight's row is, in a plan with an expert axis ("" without one)."""
    degree = plan.expert_parallel.get("degree", 1)
    if degree == 1:
        return ""
    return (
        f"; an expert weight's row names axis {EXPERT_SYNC_AXIS}: its gradient is all-reduced over the "
        f"{EXPERT_SYNC_AXIS} ranks holding the same experts (one of each ep={degree} group), and its bytes are the "
        f"1/{degree} of the experts a rank holds"
    )


def _apportion_words(plan) -> str:
    """How the layer table's dp rows share the data axis's hidden sync ("" where nothing is hidden)."""
    if not plan.hidden_communication.get("comm_dp"):
        return ""
    rows = "dp row's" if plan.expert_parallel.get("degree", 1) == 1 else f"dp or {EXPERT_SYNC_AXIS} row's"
    return (
        f" Overlap hides part of the gradient sync, priced for the step as a whole, not per bucket: each {rows} "
        "exposed part is its share of the step's exposed sync, pro rata to its sync time (the same fraction for "
        "every row); the one bucket latency a step pays is in no row."
    )


def _layer_ops(entry: dict) -> list:
    """One layer's (or the ops outside the layers') table: each op, then a row per collective inserted for it."""
    if entry["layer"]:
        title = f"Ops of one `{entry['layer']}.*` layer (it stands for {entry['num_layers']} layers"
    else:
        title = "Ops outside the layers (embeddings, final norm, head, loss"
    stages = entry.get("stages") or []
    title += f"; pipeline stage{'s' if len(stages) > 1 else ''} {index_ranges(stages)})" if stages else ")"
    rows, totals, exposed = [], Counter(), Counter()
    for op in entry["ops"]:
        head = [f"`{op['node']}`", op["op"], op["strategy"], ", ".join(op["inputs"]) or "-", op["output"]]
        if not op["collectives"]:
            rows.append(head + [""] * 8)
        for i, c in enumerate(op["collectives"]):
            per_step = c["time_s"] * c["per_step"]
            # a collective without "exposed_s" hides nothing: the step waits for all of it
            waits = c.get("exposed_s", c["time_s"]) * c["per_step"]
            totals[(c["axis"], c["pass"])] += per_step
            exposed[(c["axis"], c["pass"])] += waits
            what = c["kind"] + (f" of `{c['from']}` ({c['placements']})" if c.get("placements") else "")
            rows.append(
                (head if i == 0 else [""] * 5)
                + [
                    what,
                    c["axis"],
                    c["pass"],
                    _bytes(c["bytes"]),
                    f"{c['time_s'] * 1e3:,.3f}",
                    f"{c['per_step']:,.4g}",
                    f"{per_step * 1e3:,.3f}",
                    f"{waits * 1e3:,.3f}",
                ]
            )
    words = "; ".join(
        f"{axis} {when} {t * 1e3:,.3f} ms"
        + (f" ({exposed[axis, when] * 1e3:,.3f} ms exposed)" if exposed[axis, when] < t else "")
        for (axis, when), t in sorted(totals.items())
    )
    return [
        ("h3", title),
        ("p", f"Collectives per step: {words}." if words else "No collectives."),
        (
            "table",
            [
                "node",
                "op",
                "strategy",
                "inputs",
                "output",
                "collective",
                "axis",
                "pass",
                "bytes",
                "ms per run",
                "runs per step",
                "ms per step",
                "exposed ms per step",
            ],
            rows,
        ),
    ]


def _bytes(n: float) -> str:
    """Bytes in MiB, or KiB below one MiB."""
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.2f} KiB"


def pipeline_blocks(plan) -> list:
    info = plan.pipeline
    if not info:
        return []
    blocks = [
        ("h2", "Pipeline"),
        (
            "p",
            f"Schedule {info['schedule']}, {info.get('virtual_stages', 1)} virtual stage(s) per device, "
            f"{plan.num_microbatches} micro-batches of {info['micro_batch_size']} sample(s) per data-parallel "
            f"rank, bubble {info['bubble_fraction']:.1%} of the time without one ((p - 1) / m, / v when "
            "interleaved).",
        ),
    ]
    without = info.get("step_time_without_pipeline_s")
    blocks.append(
        (
            "p",
            f"The best plan without a pipeline: {fmt_ms(without)} ms."
            if without
            else "No plan without a pipeline was priced (the number of stages is pinned) or none fits.",
        )
    )
    rows = [
        [
            str(st["index"]),
            ", ".join(f"{a}-{b - 1}" for a, b in st["layers"]),
            f"dp={st['dp']} tp={st['tp']}",
            str(st["zero_stage"]),
            st["recompute"],
            f"{st['time_per_microbatch_s'] * 1e3:,.3f}",
            f"{st['transfer_per_microbatch_s'] * 1e3:,.3f}",
            f"{st['activation_copies']:g}",
            fmt_gib(st["memory_bytes"]),
        ]
        for st in info["stages"]
    ]
    blocks.append(
        (
            "table",
            [
                "stage",
                "layers",
                "sub-mesh",
                "ZeRO",
                "recompute",
                "ms / micro-batch",
                "transfer ms",
                "micro-batches in flight",
                "memory GiB",
            ],
            rows,
        )
    )
    blocks += _gantt(plan)
    priced = sorted(info.get("priced", ()), key=lambda c: (c["step_time_s"] is None, c["step_time_s"] or 0.0))
    if priced:
        rows = [
            [
                f"pp={c['pp']} dp={c['dp']} tp={c['tp']}",
                str(c["num_microbatches"]),
                c["schedule"] + (f" x{c['virtual_stages']}" if c.get("virtual_stages", 1) > 1 else ""),
                fmt_ms(c["estimate_s"]),
                fmt_ms(c["step_time_s"]) if c["step_time_s"] is not None else c.get("reason", ""),
            ]
            for c in priced
        ]
        blocks += [
            (
                "p",
                "Layouts priced exactly, fastest first (each at its best cut of the layers; the search stops "
                "once no remaining layout's estimate can beat the best):",
            ),
            ("table", ["layout", "micro-batches", "schedule", "estimate ms", "step ms"], rows),
        ]
    return blocks


GANTT_LIMIT_BOXES = 20_000  # past this many boxes a chart says nothing a reader can see, and takes long to draw


def _gantt(plan) -> list:
    """One step of the schedule: the slowest stage's time per micro-batch, split 1:2 between forward and backward."""
    info, pp = plan.pipeline, plan.mesh.get("pp", 1)
    boxes = 2 * pp * plan.num_microbatches * info.get("virtual_stages", 1)
    if boxes > GANTT_LIMIT_BOXES:
        return [("h3", "Schedule"), ("p", f"The chart of one step is left out: it would have {boxes:,} boxes.")]
    slowest = max(info["stages"], key=lambda st: st["time_per_microbatch_s"] + st["transfer_per_microbatch_s"])
    per_mb = slowest["time_per_microbatch_s"] + slowest["transfer_per_microbatch_s"]
    v = info.get("virtual_stages", 1)
    orders = schedule_order(info["schedule"], pp, plan.num_microbatches, v)
    slots = simulate(orders, 1.0 / (3 * v), 2.0 / (3 * v))
    title = (
        f"One step of {info['schedule']}" + (f" x{v}" if v > 1 else "") + f": {pp} stages, "
        f"{plan.num_microbatches} micro-batches"
    )
    return [
        ("h3", "Schedule"),
        (
            "p",
            "Boxes are the forward (F) and backward (B) of each micro-batch on each stage in the order the "
            "schedule runs them, every stage at the slowest stage's time per micro-batch "
            f"({fmt_ms(per_mb)} ms, forward to backward drawn 1:2); gaps are the bubble. The step's gradient sync "
            "and optimizer step follow the last backward.",
        ),
        ("chart", gantt_svg(slots, pp, title=title, unit_s=per_mb), gantt_text(slots, pp)),
    ]

"""Strategy-explain reports: what the plan chose, what it predicts, and what it was chosen over.

`render_markdown` (readable in a terminal, charts as text bars) and `render_html` (one self-contained page,
charts as inline SVG) render the same sections, in this order: Summary, Memory per device, Context parallelism
(when the plan has or searched a cp axis), Time breakdown,
Layer table, Pipeline (with a Gantt chart of one step), Why this plan, Your layout, Assumptions, then an
appendix (fusion, ops without a rule, planning statistics). Every figure is one of the plan's own fields,
formatted; nothing is priced again here, so a plan read back from JSON reports identically.
"""

from __future__ import annotations

import html
from collections import Counter

from autopar.rationale import COMM_TERMS, TERM_LABELS, TERMS, format_flops_rate, layout_words
from autopar.report_charts import bars_svg, bars_text, gantt_svg, gantt_text, schedule_order, simulate
from autopar.units import GIB

_RECOMPUTE_WORDS = {
    "none": "none (every layer keeps its activations for backward)",
    "selective": "selective (attention internals run again in backward)",
    "full": "full (each layer keeps its input; its forward runs again in backward)",
}


def _activation_words(plan) -> str:
    """What each layer does with its activations: one mode for all, or how many layers get which treatment."""
    modes = getattr(plan, "layer_modes", {})
    if not modes:
        return _RECOMPUTE_WORDS.get(plan.recompute, plan.recompute)
    words = {"offload": "activations kept on the host", "full": "full recompute", "selective": "selective recompute"}
    parts = [f"{words[m]} in layers {_ranges(layers)}" for m, layers in modes.items()]
    off = getattr(plan, "activation_offload", {})
    if off:
        parts.append(
            f"offloaded activations {off['bytes_per_device'] / GIB:,.2f} GiB per device on the host, copies "
            f"adding {off['time_s'] * 1e3:,.2f} ms"
        )
    return "per layer: " + "; ".join(parts) + "; the other layers keep theirs"


def _ranges(indices) -> str:
    """0, 1, 2, 5 as "0-2, 5"."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _offload_words(plan) -> str:
    """Where the optimizer states and gradients live, in one line of the summary."""
    off = plan.offload
    if not off:
        return "none (every state on the device)"
    weights = (
        f", with their {off['param_bytes_per_device'] / GIB:,.2f} GiB of weights per device (brought up at each gather)"
        if off.get("param_bytes_per_device")
        else ""
    )
    return (
        f"{off['optimizer_fraction']:.0%} of the optimizer states (fp32 master weights and moments) and "
        f"{off['grad_fraction']:.0%} of the gradients on the host{weights}: "
        f"{off['host_bytes_per_device'] / GIB:,.2f} GiB "
        f"per device, {off['host_bytes_per_node'] / GIB:,.1f} GiB per node; the host link and the CPU AdamW step "
        f"add {off['time_s'] * 1e3:,.2f} ms"
    )


def _fusion_words(fusion: dict) -> str:
    """'on: 32 flash_attention, 65 rms_norm, ...' (ops of the whole model), or 'off'."""
    if not fusion.get("enabled"):
        return "off (ATen ops)"
    counts = ", ".join(f"{n} {op}" for op, n in fusion.get("counts", {}).items() if n) or "nothing matched"
    skipped = len(fusion.get("skipped", ()))
    return f"on: {counts}" + (f"; {skipped} site(s) left alone (see Fusion)" if skipped else "")


# ------------------------------------------------------------------------------------------ blocks
# A report is a list of blocks, rendered to Markdown (charts as text) or HTML (charts as inline SVG):
#   ("h1" | "h2" | "h3" | "p" | "li", text)   ("table", header, rows)   ("chart", svg, text lines)


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.2f}"


def _gib(b) -> str:
    return "-" if b is None else f"{b / GIB:,.2f}"


def _mapping_words(plan) -> str:
    """How the mesh axes lie on the nodes (tensor innermost), and the link each one crosses."""
    cluster, inner, words = plan.cluster, 1, []
    for axis in reversed(list(plan.mesh)):
        size = plan.mesh[axis]
        if size > 1:
            link = cluster.link_for_axis(size, inner)
            where = "inside a node" if cluster.axis_shape(size, inner)[1] == 1 else "across nodes"
            words.append(f"{axis}={size} {where} ({link.name})")
        inner *= size
    return "; ".join(reversed(words)) or "one device"


def _summary(plan) -> list:
    p, st = plan.predicted, plan.stats
    hidden = st.get("hidden_size")
    model = f"{plan.num_parameters / 1e9:,.2f} B parameters, {st.get('layers', '?')} layers" + (
        f", hidden size {hidden}" if hidden else ""
    )
    rows = [
        ["model", f"{plan.model_name}: {model}"],
        ["cluster", plan.cluster.describe()],
        ["mesh", " x ".join(f"{k}={v}" for k, v in plan.mesh.items()) + f" ({_mapping_words(plan)})"],
        ["program", f"{plan.program}"],
        ["ZeRO stage (over dp)", str(plan.zero_stage)],
        [
            "micro-batches per step",
            f"{plan.num_microbatches} of {plan.micro_batch_size} sample(s) per data-parallel rank",
        ],
        ["activation recompute", _activation_words(plan)],
        ["host offload", _offload_words(plan)],
        ["precision", plan.precision],
        ["global batch", f"{plan.global_batch_size} ({plan.tokens_per_step:,} tokens)"],
        ["predicted step time", f"{_ms(p.step_time_s)} ms"],
        ["tokens/s", f"{p.tokens_per_s:,.0f}"],
        ["FLOP/s per device (model FLOPs)", format_flops_rate(p.tflops_per_device)],
        ["MFU (model FLOPs)", f"{p.mfu:.1%}"],
        ["hardware FLOPs utilisation", f"{p.hardware_flops_utilization:.1%}"],
        ["peak memory per device", f"{_gib(p.peak_memory_bytes)} GiB"],
        ["kernel fusion", _fusion_words(plan.fusion)],
        ["planning time", f"{st['total_time_s']:,.2f} s" if "total_time_s" in st else _NO_PLANNING_TIME],
    ]
    return [("h1", f"autopar plan: {plan.model_name}"), ("h2", "Summary"), ("table", ["", ""], rows)]


# plan files leave wall-clock figures out to stay byte-identical across runs (`autopar.plan` module docstring)
_NO_PLANNING_TIME = "not kept in plan files (the report written by `autopar plan --report` shows it)"
_MEMORY_WORDS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "recompute": "recompute working set",
    "transient": "transient peak",
    "buffers": "buffers",
}


def _memory(plan) -> list:
    p = plan.predicted
    capacity = plan.cluster.device.memory_bytes
    budget = plan.assumptions.get("memory_budget_bytes", capacity)
    stages = plan.pipeline.get("stages", ()) if plan.pipeline else ()
    if stages and all("memory" in s for s in stages):
        rows = [(f"stage {s['index']}", dict(s["memory"])) for s in stages]
    else:
        rows = [(f"each of {plan.cluster.world_size} {plan.cluster.device.name}", dict(p.memory_breakdown))]
    kinds = list(dict.fromkeys(k for _, mem in rows for k in mem))
    table = [
        [label] + [_gib(mem.get(k, 0.0)) for k in kinds] + [_gib(sum(mem.values())), _gib(budget)]
        for label, mem in rows
    ]
    blocks = [
        ("h2", "Memory per device"),
        (
            "p",
            "Peak bytes per device by kind, at the turn from forward to backward where every saved activation "
            f"is live; capacity {_gib(capacity)} GiB per device, budget {_gib(budget)} GiB.",
        ),
        ("table", ["device"] + [_MEMORY_WORDS.get(k, k) for k in kinds] + ["total GiB", "budget GiB"], table),
    ]
    fullest = max(sum(mem.values()) for _, mem in rows)
    # a budget far above every bar would flatten them to slivers: it is then in the words above, not on the axis
    limit = ("budget", budget) if budget <= 4 * fullest else None
    blocks.append(
        (
            "chart",
            bars_svg(rows, unit="GiB", scale=GIB, title="Memory per device (GiB)", labels=_MEMORY_WORDS, limit=limit),
            bars_text(rows, unit="GiB", scale=GIB, labels=_MEMORY_WORDS, limit=limit),
        )
    )
    host = [f"optimizer states and gradients: {_offload_words(plan)}"] if plan.offload else []
    if plan.activation_offload:
        off = plan.activation_offload
        host.append(f"activations of {off.get('layers', 0)} layer(s): {_gib(off['bytes_per_device'])} GiB per device")
    blocks.append(("p", "On the host: " + ("; ".join(host) if host else "nothing (every state on the device).")))
    return blocks + _host_memory(plan)


def _host_memory(plan) -> list:
    """What each device keeps on the host, by kind, against its share of the node's host memory ([] if nothing)."""
    held = {
        "optimizer": plan.offload.get("optimizer_bytes_per_device", 0.0),
        "grads": plan.offload.get("grad_bytes_per_device", 0.0),
        "activations": plan.activation_offload.get("bytes_per_device", 0.0),
    }
    held = {k: v for k, v in held.items() if v}
    if not held:
        return []
    capacity, per_node = plan.cluster.host_memory_bytes_per_device, plan.cluster.devices_per_node
    total = sum(held.values())
    rows = [[_MEMORY_WORDS[k], _gib(v), _gib(v * per_node)] for k, v in held.items()]
    rows += [
        ["**total**", _gib(total), _gib(total * per_node)],
        ["host capacity", _gib(capacity), _gib(plan.cluster.host_memory_bytes)],
    ]
    chart = [("host, per device", held)]
    limit = ("host capacity", capacity)
    weights = plan.offload.get("param_bytes_per_device")
    words = (
        f" The {_gib(weights)} GiB of weights per device whose optimizer states are on the host have no copy on "
        "the device between uses: each gather brings them up from the host's fp32 master weights (counted with "
        "the optimizer states)."
        if weights
        else ""
    )
    return [
        ("h3", "Host memory"),
        (
            "p",
            f"Bytes each device keeps on the host, by kind, against its share of the node's host memory "
            f"({_gib(capacity)} GiB of {_gib(plan.cluster.host_memory_bytes)} GiB over {per_node} devices): "
            f"{total / capacity:.1%} of it.{words}",
        ),
        ("table", ["kind", "GiB per device", "GiB per node"], rows),
        (
            "chart",
            bars_svg(
                chart, unit="GiB", scale=GIB, title="Host memory per device (GiB)", labels=_MEMORY_WORDS, limit=limit
            ),
            bars_text(chart, unit="GiB", scale=GIB, labels=_MEMORY_WORDS, limit=limit),
        ),
    ]


_HIDING = {
    "comm_dp": "gradient all-reduces overlapping backward",
    "comm_tp": "resharding overlapping compute",
    "comm_pp": "stage sends overlapping compute",
    "comm_cp": "ring hops overlapping attention blocks",
}


def _context_parallel(plan) -> list:
    """The cp axis: its degree and attention algorithm with every algorithm's price, and the degrees the planner
    searched with their memory per device (degree 1: without cp). Empty for a plan that neither has nor
    searched one."""
    cp = plan.context_parallel
    if not cp:
        return []
    degree = plan.mesh.get("cp", 1)
    blocks = [("h2", "Context parallelism")]
    if degree > 1:
        words = (
            f"The sequence is split over cp={degree} ranks in the {cp.get('layout', 'zigzag')} layout (each rank "
            f"holds chunks r and {2 * degree - 1}-r); attention runs across the group by **{cp['algorithm']}**, "
            f"the fastest priced algorithm whose memory fits. Each algorithm, per attention layer and "
            f"micro-batch on the busiest rank:"
        )
        blocks += [("p", words)] + [("li", line) for line in cp.get("priced", ())]
    search = cp.get("search")
    if search:
        step = plan.predicted.step_time_s

        def why(r: dict) -> str:
            if r["degree"] == degree:
                return "chosen"
            return r.get("reason") or f"{r['step_time_s'] / step - 1:.1%} slower" if step else ""

        rows = [
            [str(r["degree"]), _ms(r["step_time_s"]), _gib(r["peak_memory_bytes"]), r.get("algorithm") or "-", why(r)]
            for r in search
        ]
        blocks += [
            ("p", "The cp degrees searched (1: without cp), each at its best layout; memory is the peak per device:"),
            ("table", ["cp", "step time (ms)", "peak memory (GiB)", "attention", "not chosen because"], rows),
        ]
    elif degree > 1:
        blocks.append(("p", "cp was pinned, so the layout without it was not priced; plan without the pin to compare."))
    return blocks


def _time(plan) -> list:
    hidden = plan.hidden_communication
    terms = {k: v for k, v in plan.time_breakdown.items() if v or hidden.get(k)}
    if not terms:
        return []
    step = plan.predicted.step_time_s
    rows = [
        [
            TERM_LABELS.get(k, k),
            _ms(v),
            f"{v / step:.1%}" if step else "-",
            _ms(hidden.get(k, 0.0)) if k in COMM_TERMS else "",
        ]
        for k, v in terms.items()
    ]
    chart_rows = [("chosen plan", {k: v for k, v in terms.items() if v})]
    axes = [k for k in COMM_TERMS if k in terms]
    per_axis = "; ".join(
        f"{k.removeprefix('comm_')}: {_ms(terms[k])} ms exposed, "
        + (f"{_ms(hidden[k])} ms hidden ({_HIDING[k]})" if hidden.get(k) else "nothing hidden")
        for k in axes
    )
    overlap = (
        "Communication per mesh axis, exposed (the step waits for it: its term above) and hidden behind compute "
        f"(overlapped, not counted in the step): {per_axis}."
        if axes
        else "No communication."
    )
    return [
        ("h2", "Time breakdown"),
        (
            "p",
            f"One step's predicted time by term; the terms add up to the step time ({_ms(step)} ms). A "
            "communication term is its exposed part; the last column is what overlap hides of it.",
        ),
        ("table", ["term", "ms", "share", "hidden ms (not in the step)"], rows),
        ("p", overlap),
        (
            "chart",
            bars_svg(
                chart_rows,
                unit="ms",
                scale=1e-3,
                title="Step time (ms)",
                labels=TERM_LABELS,
                hidden={"chosen plan": hidden},
            ),
            bars_text(chart_rows, unit="ms", scale=1e-3, labels=TERM_LABELS, hidden={"chosen plan": hidden}),
        ),
    ]


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


def _layers(plan) -> list:
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
            _ranges(stages[key]) if key in stages else "-",
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
                "gradient sync (and ZeRO gathers) in one step." + _apportion_words(plan),
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


def _apportion_words(plan) -> str:
    """How the layer table's dp rows share the data axis's hidden sync ("" where nothing is hidden)."""
    if not plan.hidden_communication.get("comm_dp"):
        return ""
    return (
        " Overlap hides part of the gradient sync, priced for the step as a whole, not per bucket: each dp row's "
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
    title += f"; pipeline stage{'s' if len(stages) > 1 else ''} {_ranges(stages)})" if stages else ")"
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


def _pipeline(plan) -> list:
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
            f"The best plan without a pipeline: {_ms(without)} ms."
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
            _gib(st["memory_bytes"]),
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
                _ms(c["estimate_s"]),
                _ms(c["step_time_s"]) if c["step_time_s"] is not None else c.get("reason", ""),
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
            f"({_ms(per_mb)} ms, forward to backward drawn 1:2); gaps are the bubble. The step's gradient sync "
            "and optimizer step follow the last backward.",
        ),
        ("chart", gantt_svg(slots, pp, title=title, unit_s=per_mb), gantt_text(slots, pp)),
    ]


def _why(plan) -> list:
    blocks = [("h2", "Why this plan")]
    if plan.baselines:
        step = plan.predicted.step_time_s
        rows = [["**chosen**", layout_words(plan), _ms(step), "-", _gib(plan.predicted.peak_memory_bytes), "yes", ""]]
        for b in sorted(plan.baselines, key=lambda b: (not b["feasible"], b["step_time_s"] or 0.0)):
            rows.append(
                [
                    b["label"],
                    b["layout"],
                    _ms(b["step_time_s"]),
                    f"{b['step_time_s'] / step:.2f}x" if b["feasible"] and step else "-",
                    _gib(b["peak_memory_bytes"]),
                    "yes" if b["feasible"] else "no",
                    b["reason"],
                ]
            )
        blocks += [
            (
                "p",
                "The layouts a user would pick by hand, each priced by the same cost model with what it does not "
                "pin left to the solver (the best of its family); a layout that cannot run says which "
                "constraint ruled it out and by how much.",
            ),
            ("table", ["alternative", "layout", "step ms", "vs chosen", "peak GiB", "fits", "why not"], rows),
        ]
        shown = [b for b in plan.baselines if b["feasible"] and b.get("terms")]
        chart_rows = [("chosen", plan.time_breakdown)] + [(b["name"], b["terms"]) for b in shown]
        hidden = {"chosen": plan.hidden_communication} | {b["name"]: b.get("hidden", {}) for b in shown}
        blocks.append(
            (
                "chart",
                bars_svg(
                    chart_rows,
                    unit="ms",
                    scale=1e-3,
                    title="Step time of each alternative (ms)",
                    labels=TERM_LABELS,
                    hidden=hidden,
                ),
                bars_text(chart_rows, unit="ms", scale=1e-3, labels=TERM_LABELS, hidden=hidden),
            )
        )
    else:
        blocks.append(("p", "No alternatives were priced for this plan (planned with alternatives=False)."))
    searched = next((b for b in plan.baselines if b["name"] == "search"), None)
    if searched is not None:
        adopted = next((b for b in plan.baselines + plan.comparisons if b["name"] == plan.stats.get("adopted")), None)
        label = adopted["label"] if adopted else plan.stats.get("adopted", "an alternative")
        blocks.append(
            (
                "p",
                f"The search's own answer ({searched['layout']}, {_ms(searched['step_time_s'])} ms) was "
                f"beaten by {label}, priced by the same cost model: the plan is that layout, and the "
                "search's answer is listed above as an alternative. The meshes below are the search's.",
            )
        )
    if plan.alternatives:
        blocks += [
            ("h3", "Meshes solved"),
            (
                "p",
                "Every factorisation of the world size into dp x tp was solved; each row is the optimum for "
                "that mesh, with the fewest micro-batches whose activations fit, recomputing activations only "
                "where memory required it.",
            ),
        ]
        rows = []
        for alt in sorted(plan.alternatives, key=lambda a: (a["step_time_s"] is None, a["step_time_s"] or 0.0)):
            mesh = alt["dp"] == plan.mesh.get("dp") and alt["tp"] == plan.mesh.get("tp")
            chosen = " (chosen)" if mesh and searched is None else " (the search's answer)" if mesh else ""
            rows.append(
                [
                    f"dp={alt['dp']} tp={alt['tp']}" + chosen,
                    str(alt.get("num_microbatches", 1)),
                    _ms(alt["step_time_s"]) if alt["feasible"] else "-",
                    _ms(alt["compute_s"]),
                    _ms(alt["reshard_s"]),
                    _ms(alt["grad_sync_s"]),
                    str(alt["zero_stage"]) if alt["feasible"] else "-",
                    alt.get("recompute", "none") if alt["feasible"] else "-",
                    _gib(sum(alt["memory"].values())) if alt["feasible"] else alt.get("reason") or "does not fit",
                ]
            )
        blocks.append(
            (
                "table",
                [
                    "mesh",
                    "micro-batches",
                    "step ms",
                    "compute ms",
                    "reshard ms",
                    "grad sync ms",
                    "ZeRO",
                    "recompute",
                    "memory GiB",
                ],
                rows,
            )
        )
    return blocks


def _yours(plan) -> list:
    if not plan.comparisons:
        return []
    blocks = [
        ("h2", "Your layout"),
        (
            "p",
            "Each layout you asked for, priced by the same cost model next to the chosen plan, with the "
            "difference per term (positive: yours takes longer or needs more).",
        ),
    ]
    chosen = plan.time_breakdown
    for c in plan.comparisons:
        blocks.append(("h3", f"{c['name']}: {c['layout']}"))
        if not c["feasible"]:
            blocks.append(("p", f"Cannot run: {c['reason']}"))
            continue
        rows = [
            [
                TERM_LABELS.get(k, k),
                _ms(chosen.get(k, 0.0)),
                _ms(c["terms"].get(k, 0.0)),
                f"{(c['terms'].get(k, 0.0) - chosen.get(k, 0.0)) * 1e3:+,.2f}",
            ]
            for k in TERMS
            if chosen.get(k) or c["terms"].get(k)
        ]
        mine, ours = c.get("hidden", {}), plan.hidden_communication
        rows += [
            [
                f"{TERM_LABELS[k]}, hidden (not in the step)",
                _ms(ours.get(k, 0.0)),
                _ms(mine.get(k, 0.0)),
                f"{(mine.get(k, 0.0) - ours.get(k, 0.0)) * 1e3:+,.2f}",
            ]
            for k in COMM_TERMS
            if ours.get(k) or mine.get(k)
        ]
        rows.append(
            [
                "**step time**",
                _ms(plan.predicted.step_time_s),
                _ms(c["step_time_s"]),
                f"{(c['step_time_s'] - plan.predicted.step_time_s) * 1e3:+,.2f}",
            ]
        )
        rows.append(
            [
                "peak memory GiB",
                _gib(plan.predicted.peak_memory_bytes),
                _gib(c["peak_memory_bytes"]),
                f"{(c['peak_memory_bytes'] - plan.predicted.peak_memory_bytes) / GIB:+,.2f}",
            ]
        )
        blocks += [
            ("table", ["term (ms)", "chosen", "yours", "difference"], rows),
            ("p", f"In one line: {c['reason']}."),
        ]
    return blocks


def _assumptions(plan) -> list:
    dev, a = plan.cluster.device, plan.assumptions
    rows = [[f"peak matrix FLOP/s ({dt.value})", format_flops_rate(rate / 1e12)] for dt, rate in dev.matmul_flops_per_s]
    rows += [
        ["peak vector FLOP/s", format_flops_rate(dev.vector_flops_per_s / 1e12)],
        ["matmul efficiency (achievable share of peak)", f"{dev.matmul_efficiency:.3f}"],
        ["memory bandwidth", f"{dev.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s"],
        ["memory efficiency", f"{dev.memory_efficiency:.3f}"],
        ["kernel overhead per op", f"{dev.kernel_overhead_s * 1e6:,.1f} µs"],
        ["device memory", f"{_gib(dev.memory_bytes)} GiB"],
        ["memory budget per device", f"{_gib(a['memory_budget_bytes'])} GiB" if "memory_budget_bytes" in a else "-"],
        ["host AdamW rate per device", f"{dev.host_adamw_params_per_s / 1e9:,.2f} G parameters/s"],
    ]
    # the cluster's links, which a cluster file or `bench run`'s fit may set apart from the device preset's
    cluster = plan.cluster
    for level, link in (
        ("inside a node", cluster.intra_node_link),
        ("across nodes", cluster.inter_node_link),
        ("to the host", cluster.host_link),
    ):
        rows.append(
            [
                f"link {level}: {link.name}",
                f"{link.bandwidth_bytes_per_s / 1e9:,.1f} GB/s per device, latency {link.latency_s * 1e6:,.1f} µs",
            ]
        )
        for kind, latency, bandwidth in link.per_collective:
            rows.append(
                [
                    f"link {level}: {kind.replace('_', '-')}, measured on its own",
                    f"{bandwidth / 1e9:,.2f} GB/s per device, latency {latency * 1e6:,.1f} µs",
                ]
            )
    estimator = a.get("estimator", plan.stats.get("estimator", "?"))
    prof = a.get("profile")
    if prof:
        where = (
            f"op times measured on {prof.get('device')} and cached in {prof['path']} (written {prof.get('written')}), "
            f"scaled by {prof.get('ranks_per_core', 1):g} for ranks sharing cores"
        )
    elif estimator == "analytic":
        where = "the analytic roofline: each op's FLOPs and bytes against the figures above"
    else:
        where = f"the estimator {estimator}"
    rows.append(["op costs from", where])
    overlap = (
        "the data-parallel program's gradient all-reduces overlap the last micro-batch's backward (exposed: "
        "every bucket's latency, and of their time on the wire what backward cannot hide, at least the last "
        "bucket's; of the backward it overlaps, the share "
        f"{plan.cluster.device.overlap_efficiency:g} hides it, the device's overlap efficiency: 1 on GPUs, "
        "less where communication takes the compute's cores); the sharded program's gradient buckets and "
        "the weights it gathers ahead of use hide likewise behind backward and forward, and tensor-axis "
        "collectives launched early behind the ops before their use; no collective's latency hides"
        if plan.overlap
        else "communication not overlapped with compute (overlap off)"
    )
    if plan.pipeline and plan.overlap:
        overlap = (
            "pipeline transfers are posted ahead and hide their time on the wire behind one micro-batch's "
            "compute (their latency and tp all-gather do not hide); each stage's gradient sync starts after "
            "its last backward and hides behind the backwards the stages before it still run (the first "
            "stage's, which ends the step, hides nothing)"
        )
    rows.append(
        [
            "collectives",
            "alpha-beta model of the link each mesh axis crosses (ring all-reduce moves "
            f"2(n-1)/n of the bytes); {overlap}",
        ]
    )
    return [("h2", "Assumptions"), ("table", ["constant", "value"], rows)]


def _appendix(plan) -> list:
    blocks = []
    skipped = plan.fusion.get("skipped", ())
    if skipped:
        blocks += [
            ("h2", "Fusion"),
            ("p", "Sites left as ATen ops:"),
            ("table", ["kind", "node", "reason"], [[s["kind"], f"`{s['node']}`", s["reason"]] for s in skipped]),
        ]
    if plan.unruled_ops:
        blocks += [("h2", "Ops without a sharding rule (run replicated on the tensor axis)")]
        blocks += [("li", f"`{op}`") for op in plan.unruled_ops]
    if plan.stats:
        blocks += [("h2", "Planning")] + [("li", f"{k}: {v}") for k, v in plan.stats.items()]
    return blocks


def report_blocks(plan) -> list:
    """The report's sections, in order: Summary, Memory, Time, Layers, Pipeline, Why, Your layout, Assumptions."""
    return [
        *_summary(plan),
        *_memory(plan),
        *_context_parallel(plan),
        *_time(plan),
        *_layers(plan),
        *_pipeline(plan),
        *_why(plan),
        *_yours(plan),
        *_assumptions(plan),
        *_appendix(plan),
    ]


# --------------------------------------------------------------------------------------- renderers


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def render_markdown(plan) -> str:
    """The report as Markdown: tables, and charts as fixed-width text bars a terminal shows."""
    lines: list[str] = []
    for block in report_blocks(plan):
        kind = block[0]
        if lines and lines[-1].startswith("- ") and kind != "li":
            lines.append("")
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "li":
            lines.append("- " + block[1])
            continue
        elif kind == "table":
            lines += _md_table(block[1], block[2]) + [""]
        elif kind == "chart":
            lines += ["```", *block[2], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _inline(text: str) -> str:
    """Markdown's `code` and **bold** in a cell, escaped."""
    out = html.escape(str(text))
    parts = out.split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


_STYLE = (
    "body{font-family:sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;"
    "vertical-align:top}th{background:#f4f4f4}code{font-size:90%}.chart{margin:1em 0;overflow-x:auto}"
    "h2{border-bottom:1px solid #ddd;padding-bottom:2px;margin-top:1.6em}"
)


def render_html(plan) -> str:
    """One self-contained page: the same sections, tables as HTML, charts as inline SVG (nothing fetched)."""
    body, in_list = [], False
    for block in report_blocks(plan):
        kind = block[0]
        if in_list and kind != "li":
            body.append("</ul>")
            in_list = False
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "li":
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{_inline(block[1])}</li>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in block[2])
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif kind == "chart":
            body.append(f'<div class="chart">{block[1]}</div>')
    if in_list:
        body.append("</ul>")
    title = html.escape(f"autopar plan: {plan.model_name}")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )

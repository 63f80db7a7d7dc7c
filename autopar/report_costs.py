"""The plan report's sections on what the plan predicts: Summary, Memory per device (and host memory when
offloading), Context parallelism, Time breakdown. `explain.py` puts the sections in order and renders them.
"""

from __future__ import annotations

from autopar.cost_model.experts import EXPERT_SYNC_AXIS
from autopar.rationale import COMM_TERMS, TERM_LABELS, format_flops_rate
from autopar.report_charts import bars_svg, bars_text
from autopar.report_experts import expert_sync_s
from autopar.report_figures import fmt_gib, fmt_ms, index_ranges
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
    parts = [f"{words[m]} in layers {index_ranges(layers)}" for m, layers in modes.items()]
    off = getattr(plan, "activation_offload", {})
    if off:
        parts.append(
            f"offloaded activations {off['bytes_per_device'] / GIB:,.2f} GiB per device on the host, copies "
            f"adding {off['time_s'] * 1e3:,.2f} ms"
        )
    return "per layer: " + "; ".join(parts) + "; the other layers keep theirs"


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


def summary_blocks(plan) -> list:
    p, st = plan.predicted, plan.stats
    hidden = st.get("hidden_size")
    model = f"{plan.num_parameters / 1e9:,.2f} B parameters, {st.get('layers', '?')} layers" + (
        f", hidden size {hidden}" if hidden else ""
    )
    rows = [
        ["model", f"{plan.model_name}: {model}"],
        ["cluster", plan.cluster.describe()],
        ["mesh", " x ".join(f"{k}={v}" for k, v in plan.mesh.items()) + f" ({_mapping_words(plan)})" + _ep_words(plan)],
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
        ["predicted step time", f"{fmt_ms(p.step_time_s)} ms"],
        ["tokens/s", f"{p.tokens_per_s:,.0f}"],
        ["FLOP/s per device (model FLOPs)", format_flops_rate(p.tflops_per_device)],
        ["MFU (model FLOPs)", f"{p.mfu:.1%}"],
        ["hardware FLOPs utilisation", f"{p.hardware_flops_utilization:.1%}"],
        ["peak memory per device", f"{fmt_gib(p.peak_memory_bytes)} GiB"],
        ["kernel fusion", _fusion_words(plan.fusion)],
        ["planning time", f"{st['total_time_s']:,.2f} s" if "total_time_s" in st else _NO_PLANNING_TIME],
    ]
    limit = st.get("time_limit")
    if isinstance(limit, dict) and limit.get("cut_short"):
        not_tried = "; ".join(str(x) for x in limit.get("not_tried", []))
        rows.append(
            [
                "time limit",
                f"{limit.get('limit_s')} s passed: the best plan found by then, not the search's answer "
                f"(not tried: {not_tried})",
            ]
        )
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


def memory_blocks(plan) -> list:
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
        [label] + [fmt_gib(mem.get(k, 0.0)) for k in kinds] + [fmt_gib(sum(mem.values())), fmt_gib(budget)]
        for label, mem in rows
    ]
    blocks = [
        ("h2", "Memory per device"),
        (
            "p",
            "Peak bytes per device by kind, at the turn from forward to backward where every saved activation "
            f"is live; capacity {fmt_gib(capacity)} GiB per device, budget {fmt_gib(budget)} GiB.",
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
        host.append(
            f"activations of {off.get('layers', 0)} layer(s): {fmt_gib(off['bytes_per_device'])} GiB per device"
        )
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
    rows = [[_MEMORY_WORDS[k], fmt_gib(v), fmt_gib(v * per_node)] for k, v in held.items()]
    rows += [
        ["**total**", fmt_gib(total), fmt_gib(total * per_node)],
        ["host capacity", fmt_gib(capacity), fmt_gib(plan.cluster.host_memory_bytes)],
    ]
    chart = [("host, per device", held)]
    limit = ("host capacity", capacity)
    weights = plan.offload.get("param_bytes_per_device")
    words = (
        f" The {fmt_gib(weights)} GiB of weights per device whose optimizer states are on the host have no copy on "
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
            f"({fmt_gib(capacity)} GiB of {fmt_gib(plan.cluster.host_memory_bytes)} GiB over {per_node} devices): "
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


def context_parallel_blocks(plan) -> list:
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
            [
                str(r["degree"]),
                fmt_ms(r["step_time_s"]),
                fmt_gib(r["peak_memory_bytes"]),
                r.get("algorithm") or "-",
                why(r),
            ]
            for r in search
        ]
        blocks += [
            ("p", "The cp degrees searched (1: without cp), each at its best layout; memory is the peak per device:"),
            ("table", ["cp", "step time (ms)", "peak memory (GiB)", "attention", "not chosen because"], rows),
        ]
    elif degree > 1:
        blocks.append(("p", "cp was pinned, so the layout without it was not priced; plan without the pin to compare."))
    return blocks


def _ep_words(plan) -> str:
    """The expert axis of the summary's mesh ("" without one): its groups are carved from dp, not a mesh factor."""
    degree = plan.expert_parallel.get("degree", 1)
    return "" if degree == 1 else f", ep={degree} within dp (the experts split over groups of {degree} dp ranks)"


def _expert_words(plan, axes) -> str:
    """What the dp term holds of an expert axis ("" without one): its all-to-alls and, where ranks share
    experts, the experts' gradient sync over the dp / ep ranks holding the same experts."""
    ep = plan.expert_parallel
    if ep.get("degree", 1) == 1 or "comm_dp" not in axes:
        return ""
    sync = expert_sync_s(plan)
    return f" (dp holds the ep all-to-alls, {fmt_ms(ep['all_to_all_s'])} ms" + (
        f", and the experts' gradient sync over {EXPERT_SYNC_AXIS}, {fmt_ms(sync)} ms before overlap)" if sync else ")"
    )


def time_blocks(plan) -> list:
    hidden = plan.hidden_communication
    terms = {k: v for k, v in plan.time_breakdown.items() if v or hidden.get(k)}
    if not terms:
        return []
    step = plan.predicted.step_time_s
    rows = [
        [
            TERM_LABELS.get(k, k),
            fmt_ms(v),
            f"{v / step:.1%}" if step else "-",
            fmt_ms(hidden.get(k, 0.0)) if k in COMM_TERMS else "",
        ]
        for k, v in terms.items()
    ]
    chart_rows = [("chosen plan", {k: v for k, v in terms.items() if v})]
    axes = [k for k in COMM_TERMS if k in terms]
    per_axis = "; ".join(
        f"{k.removeprefix('comm_')}: {fmt_ms(terms[k])} ms exposed, "
        + (f"{fmt_ms(hidden[k])} ms hidden ({_HIDING[k]})" if hidden.get(k) else "nothing hidden")
        for k in axes
    ) + _expert_words(plan, axes)
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
            f"One step's predicted time by term; the terms add up to the step time ({fmt_ms(step)} ms). A "
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

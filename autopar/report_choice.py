"""The plan report's sections on why: Why this plan (what it was chosen over), Your layout (the layout you
asked for, priced), Assumptions (the constants the prices rest on), and the appendix (fusion, ops without a rule,
planning statistics). `explain.py` renders them.
"""

from __future__ import annotations

from autopar.rationale import COMM_TERMS, TERM_LABELS, TERMS, format_flops_rate, layout_words
from autopar.report_charts import bars_svg, bars_text
from autopar.report_figures import fmt_gib, fmt_ms, priced_rows
from autopar.units import GIB


def why_blocks(plan) -> list:
    blocks = [("h2", "Why this plan")]
    if plan.baselines:
        step = plan.predicted.step_time_s
        rows = [
            ["**chosen**", layout_words(plan), fmt_ms(step), "-", fmt_gib(plan.predicted.peak_memory_bytes), "yes", ""]
        ]
        rows += priced_rows(plan.baselines, step)
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
                f"The search's own answer ({searched['layout']}, {fmt_ms(searched['step_time_s'])} ms) was "
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
                    fmt_ms(alt["step_time_s"]) if alt["feasible"] else "-",
                    fmt_ms(alt["compute_s"]),
                    fmt_ms(alt["reshard_s"]),
                    fmt_ms(alt["grad_sync_s"]),
                    str(alt["zero_stage"]) if alt["feasible"] else "-",
                    alt.get("recompute", "none") if alt["feasible"] else "-",
                    fmt_gib(sum(alt["memory"].values())) if alt["feasible"] else alt.get("reason") or "does not fit",
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


def yours_blocks(plan) -> list:
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
                fmt_ms(chosen.get(k, 0.0)),
                fmt_ms(c["terms"].get(k, 0.0)),
                f"{(c['terms'].get(k, 0.0) - chosen.get(k, 0.0)) * 1e3:+,.2f}",
            ]
            for k in TERMS
            if chosen.get(k) or c["terms"].get(k)
        ]
        mine, ours = c.get("hidden", {}), plan.hidden_communication
        rows += [
            [
                f"{TERM_LABELS[k]}, hidden (not in the step)",
                fmt_ms(ours.get(k, 0.0)),
                fmt_ms(mine.get(k, 0.0)),
                f"{(mine.get(k, 0.0) - ours.get(k, 0.0)) * 1e3:+,.2f}",
            ]
            for k in COMM_TERMS
            if ours.get(k) or mine.get(k)
        ]
        rows.append(
            [
                "**step time**",
                fmt_ms(plan.predicted.step_time_s),
                fmt_ms(c["step_time_s"]),
                f"{(c['step_time_s'] - plan.predicted.step_time_s) * 1e3:+,.2f}",
            ]
        )
        rows.append(
            [
                "peak memory GiB",
                fmt_gib(plan.predicted.peak_memory_bytes),
                fmt_gib(c["peak_memory_bytes"]),
                f"{(c['peak_memory_bytes'] - plan.predicted.peak_memory_bytes) / GIB:+,.2f}",
            ]
        )
        blocks += [
            ("table", ["term (ms)", "chosen", "yours", "difference"], rows),
            ("p", f"In one line: {c['reason']}."),
        ]
    return blocks


def assumptions_blocks(plan) -> list:
    dev, a = plan.cluster.device, plan.assumptions
    rows = [[f"peak matrix FLOP/s ({dt.value})", format_flops_rate(rate / 1e12)] for dt, rate in dev.matmul_flops_per_s]
    rows += [
        ["peak vector FLOP/s", format_flops_rate(dev.vector_flops_per_s / 1e12)],
        ["matmul efficiency (achievable share of peak)", f"{dev.matmul_efficiency:.3f}"],
        ["memory bandwidth", f"{dev.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s"],
        ["memory efficiency", f"{dev.memory_efficiency:.3f}"],
        ["kernel overhead per op", f"{dev.kernel_overhead_s * 1e6:,.1f} µs"],
        ["device memory", f"{fmt_gib(dev.memory_bytes)} GiB"],
        ["memory budget per device", f"{fmt_gib(a['memory_budget_bytes'])} GiB" if "memory_budget_bytes" in a else "-"],
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


def appendix_blocks(plan) -> list:
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

"""Strategy-explain reports: what the plan chose, what it predicts, and what it was chosen over."""

from __future__ import annotations

import html
from collections import Counter

from autopar.plan import format_flops_rate

GIB = 1024**3
_RECOMPUTE_WORDS = {
    "none": "none (every layer keeps its activations for backward)",
    "selective": "selective (attention internals run again in backward)",
    "full": "full (each layer keeps its input; its forward runs again in backward)",
}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _linear_summary(plan) -> list[list[str]]:
    """How the parameters of each kind are laid out on the tensor axis (names with layer indices folded)."""
    groups: dict[str, Counter] = {}
    for name, pl in plan.param_placements.items():
        parts = [("*" if p.isdigit() else p) for p in name.split(".")]
        key = ".".join(parts)
        groups.setdefault(key, Counter())[pl] += 1
    rows = []
    for key, cnt in groups.items():
        rows.append([f"`{key}`", ", ".join(f"{pl} x{n}" if n > 1 else pl for pl, n in cnt.items())])
    return rows


def _activation_words(plan) -> str:
    """What each layer does with its activations: one mode for all, or how many layers get which treatment."""
    modes = getattr(plan, "layer_modes", {})
    if not modes:
        return _RECOMPUTE_WORDS.get(plan.recompute, plan.recompute)
    words = {"offload": "activations kept on the host", "full": "full recompute", "selective": "selective recompute"}
    parts = [f"{words[m]} in layers {_ranges(layers)}" for m, layers in modes.items()]
    off = getattr(plan, "activation_offload", {})
    if off:
        parts.append(f"offloaded activations {off['bytes_per_device'] / GIB:,.2f} GiB per device on the host, copies "
                     f"adding {off['time_s'] * 1e3:,.2f} ms")  # fmt: skip
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
    weights = (f", with their {off['param_bytes_per_device'] / GIB:,.2f} GiB of weights per device (brought up at "
               f"each gather)" if off.get("param_bytes_per_device") else "")  # fmt: skip
    return (f"{off['optimizer_fraction']:.0%} of the optimizer states (fp32 master weights and moments) and "
            f"{off['grad_fraction']:.0%} of the gradients on the host{weights}: "
            f"{off['host_bytes_per_device'] / GIB:,.2f} GiB "
            f"per device, {off['host_bytes_per_node'] / GIB:,.1f} GiB per node; the host link and the CPU AdamW step "
            f"add {off['time_s'] * 1e3:,.2f} ms")  # fmt: skip


def _pipeline_section(plan) -> list[str]:
    """Stages, schedule and bubble of a pipeline plan (nothing for a plan without one)."""
    info = plan.pipeline
    if not info:
        return []
    lines = ["## Pipeline", "",
             f"Schedule {info['schedule']}, {info.get('virtual_stages', 1)} virtual stage(s) per device, "
             f"{plan.num_microbatches} micro-batches of {info['micro_batch_size']} sample(s) per data-parallel rank, "
             f"bubble {info['bubble_fraction']:.1%} of the time without one ((p - 1) / m, / v when interleaved)."]  # fmt: skip
    without = info.get("step_time_without_pipeline_s")
    lines += [f"The best plan without a pipeline: {without * 1e3:,.2f} ms." if without else
              "No plan without a pipeline was priced (the number of stages is pinned) or none fits.", ""]  # fmt: skip
    rows = [[str(st["index"]), ", ".join(f"{a}-{b - 1}" for a, b in st["layers"]), f"dp={st['dp']} tp={st['tp']}",
             str(st["zero_stage"]), st["recompute"], f"{st['time_per_microbatch_s'] * 1e3:,.3f}",
             f"{st['transfer_per_microbatch_s'] * 1e3:,.3f}", f"{st['activation_copies']:g}",
             f"{st['memory_bytes'] / GIB:,.2f}"] for st in info["stages"]]  # fmt: skip
    lines += _table(["stage", "layers", "sub-mesh", "ZeRO", "recompute", "ms / micro-batch", "transfer ms",
                     "micro-batches in flight", "memory GiB"], rows)  # fmt: skip
    priced = sorted(info.get("priced", ()), key=lambda c: (c["step_time_s"] is None, c["step_time_s"] or 0.0))
    if priced:
        lines += ["", "Layouts priced exactly, fastest first (each at its best cut of the layers; the search "
                  "stops once no remaining layout's estimate can beat the best):", ""]  # fmt: skip
        rows = [[f"pp={c['pp']} dp={c['dp']} tp={c['tp']}", str(c["num_microbatches"]),
                 c["schedule"] + (f" x{c['virtual_stages']}" if c.get("virtual_stages", 1) > 1 else ""),
                 f"{c['estimate_s'] * 1e3:,.2f}",
                 f"{c['step_time_s'] * 1e3:,.2f}" if c["step_time_s"] is not None else c.get("reason", "")]
                for c in priced]  # fmt: skip
        lines += _table(["layout", "micro-batches", "schedule", "estimate ms", "step ms"], rows)
    return lines + [""]


def _fusion_words(fusion: dict) -> str:
    """'on: 32 flash_attention, 65 rms_norm, ...' (ops of the whole model), or 'off'."""
    if not fusion.get("enabled"):
        return "off (ATen ops)"
    counts = ", ".join(f"{n} {op}" for op, n in fusion.get("counts", {}).items() if n) or "nothing matched"
    skipped = len(fusion.get("skipped", ()))
    return f"on: {counts}" + (f"; {skipped} site(s) left alone (see Fusion)" if skipped else "")


def _fusion_section(plan) -> list[str]:
    """The sites the fusion pass matched but left alone, with the reason (nothing when there are none)."""
    skipped = plan.fusion.get("skipped", ())
    if not skipped:
        return []
    rows = [[s["kind"], f"`{s['node']}`", s["reason"]] for s in skipped]
    return ["## Fusion", "", "Sites left as ATen ops:", "", *_table(["kind", "node", "reason"], rows), ""]


def render_markdown(plan) -> str:
    p = plan.predicted
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    lines = [f"# autopar plan: {plan.model_name}", "", f"Cluster: {plan.cluster.describe()}.", ""]
    lines += [
        "## Summary",
        "",
        *_table(["", ""], [
            ["mesh", mesh],
            ["ZeRO stage (over dp)", str(plan.zero_stage)],
            ["micro-batches per step (gradient accumulation)",
             f"{plan.num_microbatches} of {plan.micro_batch_size} sample(s) per data-parallel rank"],
            ["activation recompute", _activation_words(plan)],
            ["host offload", _offload_words(plan)],
            ["precision", plan.precision],
            ["parameters", f"{plan.num_parameters / 1e6:,.1f} M"],
            ["global batch", f"{plan.global_batch_size} ({plan.tokens_per_step:,} tokens)"],
            ["predicted step time", f"{p.step_time_s * 1e3:,.2f} ms (compute {p.compute_s * 1e3:,.2f}, "
                                    f"resharding {p.reshard_s * 1e3:,.2f}, gradient sync {p.grad_sync_s * 1e3:,.2f}, "
                                    f"optimizer step {p.optimizer_s * 1e3:,.2f}, host offload {p.offload_s * 1e3:,.2f})"],
            ["FLOP/s per device (model FLOPs)", format_flops_rate(p.tflops_per_device)],
            ["MFU (model FLOPs)", f"{p.mfu:.1%}"],
            ["hardware FLOPs utilisation", f"{p.hardware_flops_utilization:.1%}"],
            ["peak memory per device", f"{p.peak_memory_bytes / GIB:,.2f} GiB"],
            ["kernel fusion", _fusion_words(plan.fusion)],
        ]),  # fmt: skip
        "",
        "## Memory per device (peak, at the turn from forward to backward)",
        "",
        *_table(["part", "GiB"], [[k, f"{v / GIB:,.3f}"] for k, v in p.memory_breakdown.items()]),
        "",
        *_pipeline_section(plan),
        *_fusion_section(plan),
    ]
    if plan.alternatives:  # a pipeline plan lists the layouts it priced in its Pipeline section instead
        lines += [
            "## Why this mesh",
            "",
            "Every factorisation of the world size into dp x tp was solved; each row is the optimum for that "
            "mesh, with the fewest micro-batches whose activations fit (more when that let the states stay less "
            "sharded), recomputing activations only where memory required it.",
            "",
        ]
    rows = []
    for alt in sorted(plan.alternatives, key=lambda a: (a["step_time_s"] is None, a["step_time_s"] or 0.0)):
        chosen = alt["dp"] == plan.mesh.get("dp") and alt["tp"] == plan.mesh.get("tp")
        rows.append([
            f"dp={alt['dp']} tp={alt['tp']}" + (" (chosen)" if chosen else ""),
            str(alt.get("num_microbatches", 1)),
            f"{alt['step_time_s'] * 1e3:,.2f}" if alt["feasible"] else "-",
            f"{alt['compute_s'] * 1e3:,.2f}", f"{alt['reshard_s'] * 1e3:,.2f}", f"{alt['grad_sync_s'] * 1e3:,.2f}",
            str(alt["zero_stage"]) if alt["feasible"] else "-",
            alt.get("recompute", "none") if alt["feasible"] else "-",
            f"{sum(alt['memory'].values()) / GIB:,.2f}" if alt["feasible"] else alt.get("reason") or "does not fit",
        ])  # fmt: skip
    if rows:
        lines += _table(["mesh", "micro-batches", "step ms", "compute ms", "reshard ms", "grad sync ms", "ZeRO",
                         "recompute", "memory GiB"], rows)  # fmt: skip
    lines += ["", "## Parameter placements on the tensor axis", ""]
    lines += _table(["parameter", "placement"], _linear_summary(plan))
    strategies = Counter(s for s in plan.node_strategy.values() if not s.startswith("follows"))
    if strategies:
        lines += ["", "## Op strategies", ""]
        lines += _table(["strategy", "ops"], [[s or "(single choice)", str(n)] for s, n in strategies.most_common()])
    if plan.unruled_ops:
        lines += ["", "## Ops without a sharding rule (run replicated on the tensor axis)", ""]
        lines += [f"- `{op}`" for op in plan.unruled_ops]
    st = plan.stats
    if st:
        lines += ["", "## Planning", ""]
        lines += [f"- {k}: {v}" for k, v in st.items()]
    return "\n".join(lines) + "\n"


def render_html(plan) -> str:
    """A self-contained page: the Markdown report with its tables rendered."""
    body = []
    in_table = False
    for line in render_markdown(plan).splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            if not in_table:
                body.append("<table>")
                in_table = True
            body.append("<tr>" + "".join(f"<td>{html.escape(c).replace('`', '')}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:]).replace('`', '')}</li>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    style = "body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}" \
            "td{border:1px solid #ccc;padding:2px 8px}"  # fmt: skip
    return f"<!doctype html><html><head><meta charset='utf-8'><title>autopar plan</title><style>{style}</style>" \
           f"</head><body>{''.join(body)}</body></html>\n"  # fmt: skip

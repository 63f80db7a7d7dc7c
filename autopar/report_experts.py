"""The report's section on an expert axis (`plan.expert_parallel`): how the experts are split, what the all-to-alls
cost, what memory the split saves, and, for a plan whose search weighed ep (`autopar.ep_search`), why ep was or was
not chosen. Empty for a plan without experts."""

from __future__ import annotations

from autopar.cost_model.experts import EXPERT_SYNC_AXIS
from autopar.report_figures import fmt_gib, fmt_ms, priced_rows


def expert_parallel_blocks(plan) -> list:
    """The ep axis: its groups, the all-to-all traffic and time per step, the memory it saves per device; the ep
    degrees the search weighed."""
    ep = plan.expert_parallel
    if not ep:
        return []
    blocks: list = [("h2", "Expert parallelism")]
    if "degree" in ep:
        blocks += _axis_blocks(plan, ep)
    if "search" in ep:
        blocks += _search_blocks(plan, ep["search"])
    return blocks


def _axis_blocks(plan, ep: dict) -> list:
    degree, experts = ep["degree"], ep["num_experts"]
    groups = plan.mesh.get("dp", 1) // degree
    words = (
        f"The experts are split over ep={degree} ranks of the data axis ({groups} group(s) of {degree} consecutive "
        f"ranks): each holds {experts // degree} of the {experts} experts of every MoE layer, and each token goes to "
        f"its top-{ep['top_k']} experts' ranks by all-to-all and comes back by another. Routing is priced as "
        f"balanced; the run is dropless. The memory checked against the budget holds 1/{degree} of the experts' "
        f"weights, gradients and optimizer states; "
        + (
            f"their gradients are all-reduced over the {groups} ranks holding the same experts (axis "
            f"{EXPERT_SYNC_AXIS} in the layer tables), "
            if groups > 1
            else "their gradients are not reduced (each expert is on one rank), "
        )
        + "the rest over the whole data axis."
    )
    rows = [
        ["all-to-alls per step (dispatch and combine, forward and backward)", str(ep["all_to_alls_per_step"])],
        ["bytes each re-splits over the group", f"{ep['all_to_all_bytes']:,}"],
        ["time per step (ms), in dp communication", fmt_ms(ep["all_to_all_s"])],
        ["experts' weights, gradients and optimizer states saved per device (GiB)", fmt_gib(ep["memory_saved_bytes"])],
    ]
    if groups > 1:
        rows.append(
            [
                f"experts' gradient sync per step (ms), axis {EXPERT_SYNC_AXIS}, in dp communication",
                fmt_ms(expert_sync_s(plan)),
            ]
        )
    return [("p", words), ("table", ["", ""], rows)]


def expert_sync_s(plan) -> float:
    """Seconds a step spends on the experts' gradient sync over the dp / ep ranks holding the same experts: the
    layer tables' rows of axis `EXPERT_SYNC_AXIS`, each run times its runs per step (before overlap)."""
    return sum(
        c["time_s"] * c["per_step"]
        for entry in plan.layer_ops
        for op in entry["ops"]
        for c in op["collectives"]
        if c["axis"] == EXPERT_SYNC_AXIS
    )


def _search_blocks(plan, search: dict) -> list:
    """Why the search chose ep, or not: its plan without ep and each degree it priced, against the plan."""
    if not search["degrees"]:
        return [("p", f"The model has experts, and the search weighed no expert axis: {search['reason']}.")]
    degrees = ", ".join(map(str, search["degrees"]))
    without = next((e for e in search["entries"] if e["name"] == "no_ep"), None)
    if search["chosen"] > 1 and without is not None:
        words = (
            f"The search weighed ep in {{{degrees}}} (the degrees that divide the data axis and the experts, on the "
            f"layout expert parallelism runs: ZeRO-0, no recompute, no tensor or pipeline axis) against its plan "
            f"without ep ({without['layout']}, {fmt_ms(without['step_time_s'])} ms): ep={search['chosen']} is "
            f"faster and fits, so the plan is that layout."
        )
    else:
        words = (
            f"The search weighed ep in {{{degrees}}} (the degrees that divide the data axis and the experts, on the "
            f"layout expert parallelism runs: ZeRO-0, no recompute, no tensor or pipeline axis): none beats the "
            f"plan, so it has no expert axis. Each row says why."
        )
    step = plan.predicted.step_time_s
    rows = priced_rows(search["entries"], step)
    return [("p", words), ("table", ["weighed", "layout", "step ms", "vs chosen", "peak GiB", "fits", "why not"], rows)]

"""The report's section on an expert axis (`plan.expert_parallel`): how the experts are split, what the all-to-alls
cost, what memory the split saves. Empty for a plan without one."""

from __future__ import annotations

from autopar.report_figures import fmt_gib, fmt_ms


def expert_parallel_blocks(plan) -> list:
    """The ep axis: its groups, the all-to-all traffic and time per step, the memory it saves per device."""
    ep = plan.expert_parallel
    if not ep:
        return []
    degree, experts = ep["degree"], ep["num_experts"]
    groups = plan.mesh.get("dp", 1) // degree
    words = (
        f"The experts are split over ep={degree} ranks of the data axis ({groups} group(s) of {degree} consecutive "
        f"ranks): each holds {experts // degree} of the {experts} experts of every MoE layer, and each token goes to "
        f"its top-{ep['top_k']} experts' ranks by all-to-all and comes back by another. Routing is priced as "
        f"balanced; the run is dropless."
    )
    rows = [
        ["all-to-alls per step (dispatch and combine, forward and backward)", str(ep["all_to_alls_per_step"])],
        ["bytes each re-splits over the group", f"{ep['all_to_all_bytes']:,}"],
        ["time per step (ms), in dp communication", fmt_ms(ep["all_to_all_s"])],
        ["experts' weights, gradients and optimizer states saved per device (GiB)", fmt_gib(ep["memory_saved_bytes"])],
    ]
    return [("h2", "Expert parallelism"), ("p", words), ("table", ["", ""], rows)]

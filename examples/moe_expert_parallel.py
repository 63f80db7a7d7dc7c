"""Plan a mixture of experts and estimate what expert parallelism would change in its predicted step.

autopar's expert axis (`constraints={"ep": N}`, docs/moe.md) runs so far on the data-parallel layout alone (ZeRO-0,
no tensor or pipeline axis), where a model of this size does not fit; in the layouts that fit, a mixture of
experts' weights are parameters like any other (split by ZeRO over dp, or stored split over tp and gathered whole
for each use), and its routed matmuls run on the tokens each rank holds, replicated on a tensor axis. This script
plans a preset, then prices expert parallelism over the axis that holds the experts now (dp without a
tensor axis, else tp) from the cost model's own figures:

    G    the experts' collectives as the plan priced them (its `layer_ops`), per step (per micro-batch
         on a pipeline stage: G / m): gone, every device keeps its E / e experts whole
    A2A  one all-to-all of the routed tokens (tokens x k x hidden, bf16) over the e expert ranks;
         four per MoE layer and micro-batch (dispatch and combine, forward and backward)
    C    the routed matmuls' forward and backward on one device; on a tensor axis every rank runs all
         of them now, with experts split over it each runs 1/e
    no pipeline:   dT = m x 4 L A2A - G - m (1 - 1/e) C                    (C = 0 over dp)
    pipeline:      dT = (m + p - 1) x (4 L_s A2A - G / m - (1 - 1/e) C)     (on the bottleneck stage)

It assumes routing balanced over the experts (capacity factor 1) and no overlap of the all-to-alls, as
the cost model assumes for every collective.

    python examples/moe_expert_parallel.py mixtral-8x7b 8xH100-80GB 64 4096
"""

from __future__ import annotations

import argparse
import json

import torch

import autopar
from autopar import presets
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.compute import estimate_compute_time, matmul_cost
from autopar.cost_model.devices import DType

BF16_BYTES = 2


def expert_collectives_s(plan) -> float:
    """Seconds per step of the collectives that move expert weights (a pipeline: on a middle stage)."""
    seen, total = set(), 0.0
    for entry in plan.layer_ops:
        if plan.mesh.get("pp", 1) > 1 and 1 not in entry.get("stages", ()):
            continue
        for op in entry["ops"]:
            if "experts" in op["node"]:
                seen.add(op["node"])
            for c in op["collectives"]:
                weight = "grouped_mm" in op["op"] and c.get("arg") == 1
                if "experts" in op["node"] or (c.get("from") or "") in seen or weight:
                    seen.add(op["node"])
                    total += c["time_s"] * c["per_step"]
    return total


def routed_matmuls_s(plan, config, tokens: int) -> float:
    """Forward and backward of one MoE layer's grouped matmuls over `tokens` tokens, on one device."""
    h, i, e, k = config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok
    routed = tokens * k

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    total = 0.0
    for rows, cols in ((h, 2 * i), (i, h)):  # gate and up projections together, then down
        cost = matmul_cost(meta(routed, rows), meta(e, rows, cols), meta(routed, cols))
        for backward in (False, True):
            total += estimate_compute_time(cost, plan.cluster.device, DType.BF16, backward=backward)
    return total


def estimate(plan, config) -> dict:
    """The terms of the module docstring and the predicted step with expert parallelism."""
    pp, dp, tp = (plan.mesh.get(a, 1) for a in ("pp", "dp", "tp"))
    m, seq = plan.num_microbatches, plan.tokens_per_step // plan.global_batch_size
    layers = config.num_hidden_layers // pp
    tokens = plan.global_batch_size // (dp * m) * seq  # one micro-batch of one data rank
    axis, e = ("tp", tp) if tp > 1 else ("dp", min(dp, config.num_local_experts, plan.cluster.devices_per_node))
    link = plan.cluster.link_for_axis(e, 1 if axis == "tp" else tp)
    # the whole tensor the all-to-all re-splits: every expert rank's routed tokens (a tensor axis shares them)
    a2a_bytes = tokens * config.num_experts_per_tok * config.hidden_size * BF16_BYTES * (e if axis == "dp" else 1)
    a2a = estimate_collective_time(Collective.ALL_TO_ALL, a2a_bytes, e, link)
    g = expert_collectives_s(plan)
    c = layers * routed_matmuls_s(plan, config, tokens) if axis == "tp" else 0.0
    if pp > 1:
        delta = (m + pp - 1) * (4 * layers * a2a - g / m - (1 - 1 / e) * c)
    else:
        delta = m * 4 * layers * a2a - g - m * (1 - 1 / e) * c
    step = plan.predicted.step_time_s
    return dict(
        mesh=dict(plan.mesh),
        zero=plan.zero_stage,
        microbatches=m,
        program=str(plan.program),
        step_s=step,
        expert_collectives_s=g,
        axis=axis,
        ep=e,
        a2a_bytes=a2a_bytes,
        a2a_s=a2a,
        routed_matmuls_s=c,
        delta_s=delta,
        step_with_ep_s=step + delta,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("cluster")
    parser.add_argument("global_batch_size", type=int)
    parser.add_argument("seq_len", type=int)
    args = parser.parse_args()
    plan = autopar.plan(args.preset, args.cluster, global_batch_size=args.global_batch_size, seq_len=args.seq_len)
    print(json.dumps(estimate(plan, presets.load_config(args.preset)), indent=1))


if __name__ == "__main__":
    main()

"""Weighing an expert axis in a free search: which ep degrees a plan of a mixture of experts prices, which of them
wins, and what the plan records of them.

A plan of a model with experts and no pinned ep (`planning.plan_model`) is solved as usual, then each degree of
`ep_degrees` is priced as a pinned ep is (the layout the expert-parallel program runs, solved with the experts'
states and gradient sync split, then its all-to-alls added: `autopar.expert_parallel`). The fastest that fits
replaces the search's plan only when it is faster beyond float noise (`search_ep`); every degree priced, and the
search's own plan, are recorded in the plan's `expert_parallel["search"]` with the one line that says why each lost
(`ep_record`, the report's style of `rationale.entry`). Terms: a degree d splits each MoE layer's experts over d
consecutive data-parallel ranks; 1 is the plan without ep.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from autopar import time_limit
from autopar.errors import AutoparError
from autopar.expert_parallel import LAYOUT_PINS, MoeShape
from autopar.rationale import entry

__all__ = ["ep_degrees", "ep_record", "search_ep"]

# what the search's plan without ep is called in the record
SEARCH_LABEL = "the search's plan without ep"


def ep_degrees(shape: MoeShape, constraints, world_size: int, offload) -> tuple[list[int], str]:
    """(the ep degrees a free plan prices, ascending; why none is, "" when some are).

    The expert-parallel program runs on dp x 1 with ZeRO-0 and no recompute (`LAYOUT_PINS`): its data axis is the
    world (or a pinned dp that equals it), and a degree divides that axis and the experts of each layer. Pins that
    contradict that layout, or all states on the host (offload=True), rule ep out.
    """
    contrary = {k: constraints[k] for k, v in LAYOUT_PINS.items() if k in constraints and constraints[k] != v}
    if constraints.get("dp") not in (None, world_size):
        contrary["dp"] = constraints["dp"]
    if contrary:
        pins = ", ".join(f"{k}={v}" for k, v in contrary.items())
        return [], f"the constraints pin {pins}, and expert parallelism runs on data parallelism alone so far"
    if offload is True:
        return [], "offload=True puts every state on the host, and expert parallelism keeps them on the device"
    degrees = [d for d in range(2, math.gcd(world_size, shape.num_experts) + 1) if world_size % d == 0]
    degrees = [d for d in degrees if shape.num_experts % d == 0]
    if not degrees:
        return [], f"no ep > 1 divides both the data axis (dp={world_size}) and the {shape.num_experts} experts"
    return degrees, ""


def search_ep(searched, price: Callable[[int], object], degrees: list[int]) -> tuple:
    """(the fastest plan of `searched` (the search's plan without ep) and the ep degrees' plans, [(degree, its Plan
    or the autopar error that says why it has none)]).

    `price(d)` plans the expert-parallel layout at degree d or raises an autopar error. An ep plan replaces
    `searched` only when faster beyond float noise; degrees left unpriced by the time limit are recorded as such.
    """
    priced: list[tuple[int, object]] = []
    for d in degrees:
        if time_limit.expired():
            time_limit.skipped(f"ep={d}")
            priced.append((d, TimeoutError("not priced: the time limit had passed")))
            continue
        try:
            priced.append((d, price(d)))
        except AutoparError as e:
            priced.append((d, e))
    fitting = [p for _, p in priced if not isinstance(p, Exception)]
    best = min(fitting, key=lambda p: p.predicted.step_time_s, default=searched)
    if best.predicted.step_time_s < searched.predicted.step_time_s * (1 - 1e-9):
        return best, priced
    return searched, priced


def ep_record(chosen, searched, priced: list[tuple], why_not: str = "") -> dict:
    """What the plan says of the ep degrees it weighed: {"degrees", "chosen" (the plan's degree, 1: none),
    "entries" (`rationale.entry` of the search's plan without ep and of each degree, against `chosen`),
    "reason" (why no degree was priced, "" when some were)}."""
    entries = [entry("no_ep", SEARCH_LABEL, {}, searched, chosen)] if searched is not None else []
    for d, plan in priced:
        entries.append(entry(f"ep{d}", f"ep={d}", {"ep": d} | LAYOUT_PINS, plan, chosen))
    return {
        "degrees": [d for d, _ in priced],
        "chosen": chosen.expert_parallel.get("degree", 1),
        "entries": entries,
        "reason": why_not,
    }

"""Searching the context-parallel (cp) degree of a plan: which degrees to price, in which order, and what the plan
records of them.

`plan` traces and solves the model once per degree (`planning.plan_model`: a cp graph holds each sequence as cp
zig-zag chunks, so every degree is its own trace); this module only decides which degrees that costs, from the
sequence, the world and the pins (`cp_degrees`), and which of them are priced at all (`search_cp`). Terms: a
degree c splits each sequence over c ranks; 1 is the plan without cp.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from autopar.context_parallel.inputs import check_cp_inputs, sequence_length
from autopar.errors import ConfigError, InfeasiblePlanError

__all__ = ["MIN_CP_CHUNK_TOKENS", "cp_degrees", "search_cp"]

# A rank's share of a sequence below which cp is not searched: ring blocks this short cannot hide their hop
# behind their attention on a GPU, and a sequence this short holds few activations against the model states.
MIN_CP_CHUNK_TOKENS = 4096


def cp_degrees(constraints: dict, world_size: int, args, kwargs) -> list[int]:
    """The cp degrees an unpinned plan prices, ascending, 1 (no cp) first; [1] when none applies.

    Powers of two that divide the world (and what pinned dp and tp leave of it) and leave every rank two zig-zag
    chunks of the sequence of at least `MIN_CP_CHUNK_TOKENS` together. None when cp is pinned, the inputs cannot
    be split (a padding mask, no token ids), or nothing applies. Where the plan searches pipelines (or pins pp),
    each degree is priced with its pipelines: the room for cp is what the pins leave of the world, pp included.
    """
    if "cp" in constraints:
        return [1]
    try:
        seq = sequence_length(args, kwargs)
        check_cp_inputs(args, kwargs, 1)
    except ConfigError:
        return [1]
    room = world_size // ((constraints.get("dp") or 1) * (constraints.get("tp") or 1) * (constraints.get("pp") or 1))
    out, c = [1], 2
    while c <= room and room % c == 0 and seq % (2 * c) == 0 and seq // c >= MIN_CP_CHUNK_TOKENS:
        out.append(c)
        c *= 2
    return out


def search_cp(price: Callable[[int], tuple], degrees: list[int]) -> tuple:
    """The fastest plan over the cp degrees `degrees` (ascending, 1 first): `price`'s (plan, runner-up, job).

    `price(c)` plans for cp degree c (1: none) and returns (plan, runner-up, job), or raises InfeasiblePlanError
    (nothing fits) or ConfigError (above 1: the model cannot be split by cp; at 1: the batch cannot be laid out
    without cp, e.g. one sequence over a data axis of two ranks, which is recorded when a cp degree has a plan).

    At a fixed tensor axis every degree gives a device the same tokens per step (the data axis dp·cp has the same
    size); what cp changes is the smallest micro-batch, one chunk of seq/cp tokens instead of a whole sequence,
    at the price of attention's communication. Degrees above 1 are priced from the largest down, then 1:

    * a degree that does not fit means no smaller one does, 1 included (each holds more of a sequence at once per
      device, with the same states): the search stops there (a sound cut);
    * a degree slower than the one above it has met the memory measures (recompute, micro-batches, a wider
      tensor axis) that more splitting avoided, and halving cp again only needs more of them: the degrees
      between it and 1 are not priced (a cut that assumes the step time has one minimum over the degrees);
      1 is, as the plan without cp is what every cp plan must beat.

    The plan records every degree with its step time and memory, or why it was not priced
    (``context_parallel["search"]``).
    """
    results: dict[int, tuple | Exception] = {}
    for c in reversed(degrees):
        try:
            results[c] = price(c)
        except InfeasiblePlanError as e:
            results[c] = e
            break
        except ConfigError as e:
            if c == 1:
                if not any(isinstance(r, tuple) for r in results.values()):
                    raise
                results[1] = e  # e.g. one sequence cannot be split over a data axis: only cp uses the ranks
                break
            # this model cannot be split by cp (a token-mixing convolution, no attention op): plan it without
            results.update({d: e for d in degrees if d > 1})
            results[1] = price(1)
            break
        above = results.get(2 * c)
        if c > 1 and isinstance(above, tuple) and results[c][0].predicted.step_time_s >= above[0].predicted.step_time_s:
            if 1 not in results:
                results[1] = _price_without_cp(price)
            break
    plans = {c: r for c, r in results.items() if isinstance(r, tuple)}
    if not plans:
        raise next(r for r in results.values() if isinstance(r, InfeasiblePlanError))
    best = min(plans, key=lambda c: (plans[c][0].predicted.step_time_s, c))
    chosen, runner_up, job = plans[best]
    record = [_searched(c, results.get(c), degrees, results) for c in degrees]
    cp_info = dict(chosen.context_parallel) if best > 1 else {"degree": 1}
    return dataclasses.replace(chosen, context_parallel=cp_info | {"search": record}), runner_up, job


def _price_without_cp(price: Callable[[int], tuple]):
    """(plan, runner-up, job) without cp, or the InfeasiblePlanError that says it does not fit."""
    try:
        return price(1)
    except (InfeasiblePlanError, ConfigError) as e:  # does not fit, or the batch does not split without cp
        return e


def _searched(c: int, result, degrees: list[int], results: dict) -> dict:
    """One degree of the cp search as the plan records it: its price, or why it was not priced."""
    out = {"degree": c, "feasible": False, "step_time_s": None, "peak_memory_bytes": None}
    if isinstance(result, tuple):
        p = result[0].predicted
        return out | {
            "feasible": True,
            "step_time_s": p.step_time_s,
            "peak_memory_bytes": p.peak_memory_bytes,
            "memory_breakdown": dict(p.memory_breakdown),
            "algorithm": result[0].context_parallel.get("algorithm"),
            "reason": "",
        }
    if isinstance(result, Exception):
        need = re.search(r"needs at least ([0-9.,]+ \w+) per device", str(result))
        return out | {
            "reason": f"does not fit: needs at least {need.group(1)} per device" if need else str(result).split(";")[0]
        }
    higher = [d for d in degrees if d > c and d in results]
    lowest = min(higher) if higher else None
    if lowest is not None and isinstance(results[lowest], InfeasiblePlanError):
        why = f"not priced: cp={lowest} does not fit, and cp={c} holds more of a sequence per device"
    else:
        why = f"not priced: cp={lowest} was slower than cp={2 * lowest}, and less cp only adds memory measures"
    return out | {"reason": why}

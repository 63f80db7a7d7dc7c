"""The pins the pipeline search reads, checked once before anything is priced.

Expects the user's constraints (a dict) and what the search knows of the model (its `LayerStructure`, or None when
it has no layers to cut) and of the world. Gives the constraints back with "schedule" as a `Schedule`, or raises a
`ConfigError` that names the pin, the value found and the values that would hold. Nothing is priced here: a pin
that holds may still leave no layout that fits the memory budget (the search says so).

Pins read: "pp" (stages, dividing the world, at most the layers), "schedule" and "virtual_stages" (`schedules`:
interleaving needs v >= 2 and pp x v layers, and is not searched over several stacks), "tp" and "dp" (a stage's
sub-mesh), "num_microbatches" and "micro_batch_size" (per data-parallel rank), "zero" (0 or 1 with a pipeline:
at 2 or 3 a stage would gather and reduce-scatter every weight once per micro-batch).
-> Implemented in: check_pins(), wants_pipeline().
"""

from __future__ import annotations

from autopar.errors import ConfigError
from autopar.ir import OpGraph
from autopar.passes.pipeline.layers import LayerStructure, why_no_layer_run
from autopar.passes.pipeline.schedules import Schedule
from autopar.plan import PIPELINE_ZERO_STAGES

# the pins that ask for stages: the plan without a pipeline is solved without them
PIPELINE_CONSTRAINT_KEYS = frozenset({"pp", "schedule", "virtual_stages"})


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def wants_pipeline(c: dict) -> bool:
    """Whether the pins ask for pipeline stages (pp above 1, a schedule, or virtual stages)."""
    return (c.get("pp") or 0) > 1 or c.get("schedule") is not None or (c.get("virtual_stages") or 1) > 1


def _check_constraints(constraints: dict, world: int, num_layers: int) -> dict:
    """Validate the pins this search reads; ConfigError says what to change."""
    c = dict(constraints)
    for key in ("pp", "tp", "dp", "num_microbatches", "micro_batch_size", "virtual_stages"):
        if key in c and c[key] is not None and not _is_count(c[key]):
            raise ConfigError(f"constraints[{key!r}]={c[key]!r}: expected a positive integer")
    pp = c.get("pp")
    if pp is not None and world % pp:
        raise ConfigError(
            f"constraints['pp']={pp} does not divide the world size {world}; choose one of {divisors(world)}"
        )
    if pp is not None and pp > max(num_layers, 1):
        raise ConfigError(
            f"constraints['pp']={pp}: the model has {num_layers} layer(s) to cut and every stage needs "
            f"at least one; choose pp <= {max(num_layers, 1)}"
        )
    if c.get("zero") not in (None, 0, 1, 2, 3):
        raise ConfigError(f"constraints['zero']={c['zero']!r}: expected 0, 1, 2 or 3")
    if c.get("zero") not in (None, *PIPELINE_ZERO_STAGES) and wants_pipeline(c):
        raise ConfigError(
            f"constraints: ZeRO-{c['zero']} is not run with a pipeline (a stage would gather every split "
            f"weight and reduce-scatter its gradient once per micro-batch, each collective waited on "
            f"where it is issued); with pp pin zero 0 or 1 (ZeRO-1 gathers each weight once a step, "
            f"behind compute), or drop pp, schedule and virtual_stages for ZeRO-{c['zero']}"
        )
    sched = c.get("schedule")
    if sched is not None:
        try:
            c["schedule"] = Schedule(sched)
        except ValueError:
            raise ConfigError(
                f"constraints['schedule']={sched!r}: expected one of {', '.join(repr(s.value) for s in Schedule)}"
            ) from None
    v = c.get("virtual_stages")
    if v is not None and v > 1 and c.get("schedule") not in (None, Schedule.INTERLEAVED_1F1B):
        raise ConfigError(
            f"constraints['virtual_stages']={v} needs schedule 'interleaved_1f1b', not "
            f"{c['schedule'].value!r}; drop one of the two"
        )
    if v == 1 and c.get("schedule") == Schedule.INTERLEAVED_1F1B:
        raise ConfigError("constraints: the interleaved schedule needs virtual_stages >= 2 (with 1 it is '1f1b')")
    if v is not None and v > 1 and pp is not None and pp * v > num_layers:
        raise ConfigError(
            f"constraints: pp={pp} x virtual_stages={v} chunks need at least {pp * v} layers, the "
            f"model has {num_layers}; lower virtual_stages"
        )
    return c


def check_pins(constraints: dict | None, graph: OpGraph, structure: LayerStructure | None, world: int) -> dict:
    """The constraints with the pins this search reads checked (see the module docstring).

    Args:
        constraints: the user's constraints, or None.
        graph: the traced model (named in the error when it has no layers to cut).
        structure: its layers (`layers.layer_structure` or `layers.stack_structure`), or None.
        world: the world size.
    Raises:
        ConfigError: a pin that cannot hold, with the values that would.
    """
    num_layers = structure.num_layers if structure is not None else 1
    pinned_pp = (constraints or {}).get("pp")
    if structure is None and isinstance(pinned_pp, int) and pinned_pp > 1:
        raise ConfigError(f"constraints['pp']={pinned_pp}: {why_no_layer_run(graph)}; drop 'pp'")
    c = _check_constraints(dict(constraints or {}), world, num_layers)
    if (
        structure is not None
        and structure.stacks
        and (c.get("schedule") == Schedule.INTERLEAVED_1F1B or (c.get("virtual_stages") or 1) > 1)
    ):
        names = " and ".join(path for path, _ in structure.stacks)
        raise ConfigError(
            f"constraints: interleaved schedules are not searched over several stacks of layers "
            f"({names}); pin schedule '1f1b' or 'gpipe', or drop the pin"
        )
    return c

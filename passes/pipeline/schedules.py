r"""Pipeline schedules: which ones the search tries, how long a step of each lasts, what each stage keeps alive.

Expects the shape of a pipeline: p stages, m micro-batches per step on each data-parallel rank and, interleaved,
v chunks per device. Gives the figures of a schedule that the stage and step prices read (activation copies,
slots, bubble) and the layers each device runs; it prices nothing itself. The names match
`torch.distributed.pipelining`'s schedules, which `runtime.pipeline` runs.

Terms:
    p  pipeline stages (device blocks), s = 0 .. p-1;  m  micro-batches per step;  v  virtual stages (chunks)
       per device, 1 unless interleaved
    a_s  micro-batches whose activations stage s keeps alive at once
    k_s  layers of stage s

Activations kept (-> Implemented in: activation_copies()):
    GPipe        a_s = m
    1F1B         a_s = min(p - s, m)
    interleaved  a_s = min((v - 1) p + 2 (p - 1 - s) + 1, m v) / v     (Megatron-LM)

A step lasts `slots` times the slowest stage's micro-batch, the bubble being the idle share of the busy time
(-> Implemented in: schedule_slots(), bubble_fraction()):
    GPipe, 1F1B   slots = m + p - 1          bubble (p - 1) / m
    interleaved   slots = m + (p - 1) / v    bubble (p - 1) / (v m)

Which schedules run (-> Implemented in: schedule_choices()). 1F1B needs m >= p (as torch.distributed.pipelining's
Schedule1F1B does) and keeps fewer activations than GPipe at the same bubble, so GPipe is tried only where 1F1B
cannot run (m < p) or when it is pinned. Interleaving needs m to be a multiple of p and every chunk to hold a
layer (k_s >= v); v runs from 2 to MAX_VIRTUAL_STAGES unless pinned.

Layers of a device (-> Implemented in: stage_layer_ranges()): one block of consecutive layers; interleaved, v
chunks, device d running chunks d, d + p, ..., d + (v-1) p, its k_s layers spread over them as evenly as they go.
"""

from __future__ import annotations

from enum import StrEnum

MAX_VIRTUAL_STAGES = 8  # searched unless pinned: more chunks pay more transfers than the bubble they save


class Schedule(StrEnum):
    """The pipeline schedules autopar prices and runs (their names are the CLI's `--schedule` values)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


def activation_copies(schedule: Schedule, pp: int, stage: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` keeps at once (the module docstring's a_s)."""
    m, p, v = num_microbatches, pp, virtual_stages
    if schedule == Schedule.GPIPE:
        return float(m)
    if schedule == Schedule.ONE_F_ONE_B:
        return float(min(p - stage, m))
    return min((v - 1) * p + 2 * (p - 1 - stage) + 1, m * v) / v


def bubble_fraction(schedule: Schedule | None, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of the pipeline relative to its busy time: (p-1)/m, or (p-1)/(v m) interleaved."""
    if schedule is None or pp == 1:
        return 0.0
    v = virtual_stages if schedule == Schedule.INTERLEAVED_1F1B else 1
    return (pp - 1) / (v * num_microbatches)


def schedule_slots(schedule: Schedule, pp: int, m: int, v: int) -> float:
    """Micro-batch slots of the slowest stage that a step lasts: m plus the bubble."""
    return m + (pp - 1) / (v if schedule == Schedule.INTERLEAVED_1F1B else 1)


def schedule_choices(c: dict, pp: int, m: int, num_layers: int) -> list[tuple[Schedule, int]]:
    """(schedule, v) pairs to try for pp stages and m micro-batches (see the module docstring).

    Args:
        c: the checked pins (`Schedule` under "schedule", an int or None under "virtual_stages").
        pp, m: stages and micro-batches per step.
        num_layers: layers to cut (each of the pp * v chunks holds one at least).
    """
    pinned, pinned_v = c.get("schedule"), c.get("virtual_stages")
    out = []
    if pinned == Schedule.GPIPE or (pinned is None and m < pp and pinned_v in (None, 1)):
        out.append((Schedule.GPIPE, 1))
    if pinned in (None, Schedule.ONE_F_ONE_B) and m >= pp and pinned_v in (None, 1):
        out.append((Schedule.ONE_F_ONE_B, 1))
    if pinned in (None, Schedule.INTERLEAVED_1F1B) and m % pp == 0 and pinned_v != 1:
        vs = [pinned_v] if pinned_v else range(2, min(num_layers // pp, MAX_VIRTUAL_STAGES) + 1)
        out += [(Schedule.INTERLEAVED_1F1B, v) for v in vs if pp * v <= num_layers]
    return out


def stage_layer_ranges(alloc: list[int], schedule: Schedule, pp: int, v: int) -> list[tuple[tuple[int, int], ...]]:
    """The layers each stage runs: consecutive blocks, or v chunks per device in the order d, d + p, ...

    Args:
        alloc: layers per stage (k_s), in stage order.
        schedule, pp, v: the schedule, its stages and chunks per device.
    """
    if schedule != Schedule.INTERLEAVED_1F1B:
        starts = [sum(alloc[:s]) for s in range(len(alloc))]
        return [((a, a + k),) for a, k in zip(starts, alloc, strict=True)]
    sizes = {(d, j): alloc[d] // v + (j < alloc[d] % v) for d in range(pp) for j in range(v)}
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    start = 0
    for j in range(v):
        for d in range(pp):
            ranges[d].append((start, start + sizes[(d, j)]))
            start += sizes[(d, j)]
    return [tuple(r) for r in ranges]

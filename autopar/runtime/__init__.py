"""The emitted programs: one base (`base.Program`), one file per program kind, one table from kind to class.

`plan.program` (the one rule in `autopar.plan.program_kind`) names the kind; `program_class` gives its class:

- `data-parallel` (`data_parallel.py`): the whole model per rank, plain tensors, bucketed all-reduce;
- `sharded` (`sharded.py`): the traced graph on DTensors (tensor axis, ZeRO stages, recompute);
- `pipeline` (`pipeline.py`): stages over the pp axis with torch.distributed.pipelining schedules;
- `offload` (`offload.py`): ZeRO-3 chunks whose states (and weights) partly live on the host;
- `expert-parallel` (`experts.py`): data-parallel, a mixture of experts' experts split over ep groups.
"""

from __future__ import annotations

from autopar.plan import Plan, ProgramKind
from autopar.runtime.base import (
    Program,
    call_spec,
    compute_dtype,
    default_optimizer,
    device_type,
    ensure_process_group,
    flat_inputs,
    micro_batches,
    placeholder_values,
    rank_rows,
    sum_in_buckets,
)
from autopar.runtime.data_parallel import DataParallelProgram
from autopar.runtime.experts import ExpertParallelProgram
from autopar.runtime.offload import OffloadProgram
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.sharded import ShardedProgram

PROGRAMS: dict[ProgramKind, type[Program]] = {
    ProgramKind.DATA_PARALLEL: DataParallelProgram,
    ProgramKind.SHARDED: ShardedProgram,
    ProgramKind.PIPELINE: PipelineProgram,
    ProgramKind.OFFLOAD: OffloadProgram,
    ProgramKind.EXPERT_PARALLEL: ExpertParallelProgram,
}


def program_class(plan: Plan) -> type[Program]:
    """The class that runs `plan`."""
    return PROGRAMS[plan.program]


__all__ = [
    "PROGRAMS",
    "DataParallelProgram",
    "ExpertParallelProgram",
    "OffloadProgram",
    "PipelineProgram",
    "Program",
    "ShardedProgram",
    "call_spec",
    "compute_dtype",
    "default_optimizer",
    "device_type",
    "ensure_process_group",
    "flat_inputs",
    "micro_batches",
    "placeholder_values",
    "program_class",
    "rank_rows",
    "sum_in_buckets",
]

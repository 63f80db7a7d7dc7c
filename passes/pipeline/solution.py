"""What the pipeline search returns: the chosen layout, each stage's figures, and what it was compared with.

Expects nothing: plain frozen records, filled by `search.search_pipeline` and read by `autopar.plan` (which turns
them into a `Plan`'s pipeline section), the report and the tests. Guarantees one `StagePlan` per stage, in stage
order, with the per-device figures of one device of that stage.

Terms (the symbols of `step_cost` and `stage_cost`):
    t_s  compute of one micro-batch;  c_s, e_s  its transfers and their exposed part;  S_s, G_s, E_s, L_s  the
         gradient sync of a step, the part overlap may hide, the exposed part, the last bucket;  a_s  activation
         copies;  m, b, v  micro-batches per step, samples per micro-batch, chunks per device
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.pipeline.schedules import Schedule
from autopar.passes.sharding.solution import ShardingSolution


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage (one device of it for the per-device figures).

    Attributes:
        index: stage (device block) index, 0 first.
        layers: half-open ranges [start, stop) of the model's layers the stage runs, in order; one range,
            or one per chunk with an interleaved schedule.
        num_layers: layers in those ranges.
        first, last: whether it runs the nodes before the layers (embeddings) / after them (head, loss).
        dp, tp: its sub-mesh; zero_stage: its ZeRO stage over dp.
        time_per_microbatch_s: compute, resharding and exposed cp attention communication of one micro-batch (t_s).
        transfer_per_microbatch_s: point-to-point sends of one micro-batch (c_s).
        grad_sync_s: gradient synchronisation per step (S_s, with optimizer_s).
        activation_copies: micro-batches whose activations it keeps at once (a_s).
        memory: per-device bytes by kind (params, grads, optimizer, activations, transient).
        sharding: the stage program's layout (placements of the view's nodes and parameters).
        optimizer_s: its optimizer step, once per step after the last backward (part of S_s).
        transfer_exposed_per_microbatch_s: the part of c_s the stage waits for (e_s; c_s without overlap).
        grad_sync_hidden_s: the part of grad_sync_s (G_s) hidden behind the stage's own last backward and the
            later backwards of the step (H(G_s, w_s + min(b_s, G_s - L_s)), `step_cost`).
        last_bucket_s: L_s, the bandwidth part of the reduction of the bucket its last backward fills last (waits for
            that backward).
    """

    index: int
    layers: tuple[tuple[int, int], ...]
    num_layers: int
    first: bool
    last: bool
    dp: int
    tp: int
    zero_stage: int
    time_per_microbatch_s: float
    transfer_per_microbatch_s: float
    grad_sync_s: float
    activation_copies: float
    memory: dict
    sharding: ShardingSolution | None = None
    optimizer_s: float = 0.0
    transfer_exposed_per_microbatch_s: float | None = None
    grad_sync_hidden_s: float = 0.0
    last_bucket_s: float = 0.0

    def __post_init__(self):
        if self.transfer_exposed_per_microbatch_s is None:  # nothing hidden unless told
            object.__setattr__(self, "transfer_exposed_per_microbatch_s", self.transfer_per_microbatch_s)

    @property
    def grad_sync_exposed_s(self) -> float:
        """E_s: the part of the gradient sync the step waits for."""
        return self.grad_sync_s - self.grad_sync_hidden_s

    @property
    def peak_memory_bytes(self) -> float:
        return float(sum(self.memory.values()))


@dataclass(frozen=True, slots=True)
class PipelineSolution:
    """The chosen pipeline (or the plan without one, pp = 1) and what it was compared with.

    Attributes:
        pp, dp, tp: stages and the sub-mesh of every stage (pp * dp * tp = world size).
        stages: one StagePlan per stage, in order.
        num_microbatches: micro-batches per step on each data-parallel rank (m).
        micro_batch_size: samples per micro-batch per data-parallel rank (b).
        schedule: the pipeline schedule; None when pp = 1.
        virtual_stages: chunks per device (v; 1 unless interleaved).
        bubble_fraction: (p-1)/m or (p-1)/(v m).
        step_time_s: predicted step time.
        peak_memory_bytes: the largest stage's per-device peak.
        single_stage_step_time_s: the best plan without a pipeline (None when none fits or pp is pinned).
        single_stage: that plan's layout (`solve_sharding`'s answer), which is the answer when pp = 1.
        candidates: the configurations priced, each a dict (pp, dp, tp, num_microbatches, schedule,
            virtual_stages, estimate_s, step_time_s or None, reason).
        num_stage_programs: stage programs solved.
        solve_time_s: wall time of the search.
    """

    pp: int
    dp: int
    tp: int
    stages: tuple[StagePlan, ...]
    num_microbatches: int
    micro_batch_size: int
    schedule: Schedule | None
    virtual_stages: int
    bubble_fraction: float
    step_time_s: float
    peak_memory_bytes: float
    single_stage_step_time_s: float | None
    single_stage: ShardingSolution | None
    candidates: tuple[dict, ...]
    num_stage_programs: int
    solve_time_s: float

    def __post_init__(self):
        assert len(self.stages) == self.pp, "one StagePlan per stage"

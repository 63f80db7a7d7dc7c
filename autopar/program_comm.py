"""How each program communicates over the data axis: one typed declaration, read by the runtime and the solver.

A plan runs as one program (`autopar.plan.program_kind`: data-parallel, sharded, pipeline, offload). What that
program sends over the data axis, when it sends it, and what of it runs beside compute is decided here, once, by
the properties of `ProgramComm`. The programs (`autopar.runtime`) read them where they decide what to run; the
sharding solver's pricing (`passes.sharding.sync`, `.memory`, `.offload`) reads the same properties to price what
runs. So a change to what a program does and the change to its price meet in this file.

    comm = ProgramComm(ProgramKind.SHARDED, zero_stage=2, data_ranks=4, overlap=True, prefetch_depth=1,
                       num_microbatches=2)
    comm.overlaps_data_axis, comm.reductions_per_step      # True, 2

Terms: the data axis is the dp·cp ranks a gradient is summed over (`data_ranks`); a bucket is a run of gradients
reduced by one collective (`autopar.units.BUCKET_BYTES`), filled in `gradient_order`; to overlap is to issue a
collective asynchronously and wait for it only where its result is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.errors import ConfigError
from autopar.plan import PIPELINE_ZERO_STAGES, ProgramKind


def resolved_prefetch_depth(requested: int | None, overlap: bool) -> int:
    """THE prefetch rule: how many layers ahead of their use a program gathers weights split over the data axis.
    Without overlap none (each weight is gathered where an op reads it); with it the `requested` depth, 1 when
    none is asked for. The plan records this depth, the solver prices it, the programs run it."""
    if not overlap:
        return 0
    return 1 if requested is None else int(requested)


def gradient_order(graph: fx.Graph, params: list[str]) -> list[str]:
    """The parameter placeholders named in `params`, in about the order backward completes their gradients: by
    their first use in the forward `graph`, the latest first (autograd differentiates later ops first, and a
    parameter's gradient is complete once its earliest use is differentiated); unused ones last, in reverse order.
    What the buckets follow, in the programs and in the plan's price of them."""
    position = {node.name: k for k, node in enumerate(graph.nodes)}
    first: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder" and node.users:
            first[node.name] = min(position[u.name] for u in node.users)
    rank = {name: k for k, name in enumerate(params)}
    return sorted(params, key=lambda name: (name not in first, -first.get(name, 0), -rank[name]))


@dataclass(frozen=True, slots=True)
class ProgramComm:
    """What one program does over the data axis (see the module docstring); validated on construction.

    Attributes:
        program: the program that runs the layout.
        zero_stage: the ZeRO stage it runs (0-3; a pipeline runs 0 or 1).
        data_ranks: ranks on the data axis (dp·cp).
        overlap: whether it issues its data-axis collectives from backward (and gathers ahead), asynchronously.
        prefetch_depth: layers a split weight is gathered ahead of its use (`resolved_prefetch_depth`: 0 without
            overlap).
        num_microbatches: micro-batches per step on each data-parallel rank.
    """

    program: ProgramKind
    zero_stage: int
    data_ranks: int = 1
    overlap: bool = True
    prefetch_depth: int = 0
    num_microbatches: int = 1

    def __post_init__(self):
        self._validate()

    def _validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage {self.zero_stage!r}: expected 0, 1, 2 or 3")
        for name in ("data_ranks", "num_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: expected a positive integer")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth={self.prefetch_depth!r}: expected a count of layers, 0 or more")
        if self.prefetch_depth and not self.overlap:
            raise ConfigError(
                f"prefetch_depth={self.prefetch_depth} without overlap: a program gathers ahead only when it "
                f"overlaps (resolved_prefetch_depth gives 0); turn overlap on or ask for depth 0"
            )
        if self.runs_plain and self.zero_stage != 0:
            raise ConfigError(
                f"the data-parallel program at ZeRO-{self.zero_stage}: it replicates every state (ZeRO-0); "
                f"a sharded stage runs on the sharded program (`autopar.plan.program_kind`)"
            )
        if self.program == ProgramKind.PIPELINE and self.zero_stage not in PIPELINE_ZERO_STAGES:
            raise ConfigError(
                f"the pipeline program at ZeRO-{self.zero_stage}: a pipeline runs ZeRO "
                f"{' or '.join(map(str, PIPELINE_ZERO_STAGES))}"
            )

    @classmethod
    def of_plan(cls, plan, program: ProgramKind | None = None) -> ProgramComm:
        """The declaration of `program` (default: the one `plan.program` names) running `plan` (an `autopar.Plan`)."""
        return cls(
            plan.program if program is None else program,
            plan.zero_stage,
            plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1),
            plan.overlap,
            resolved_prefetch_depth(plan.prefetch_depth, plan.overlap),
            plan.num_microbatches,
        )

    def at_stage(self, zero_stage: int) -> ProgramComm:
        """The same program at another ZeRO stage (a pipeline's parameters take the stage of the stages that read
        them)."""
        return replace(self, zero_stage=zero_stage)

    # ------------------------------------------------------------------ gradients replicated over the data axis

    @property
    def runs_plain(self) -> bool:
        """The data-parallel program (or the expert-parallel one, which is it with its experts split): the whole
        model on plain tensors with no tensor axis, DDP's layout."""
        return self.program in (ProgramKind.DATA_PARALLEL, ProgramKind.EXPERT_PARALLEL)

    @property
    def buckets_all_reduce(self) -> bool:
        """Gradients all-reduced over the data axis once a step, in buckets: the data-parallel program's, and a
        pipeline's at ZeRO-0 whatever its tensor and cp axes (the sharded program reduces each gradient on its own
        without overlap, in buckets from backward with it: `overlaps_data_axis`)."""
        return self.runs_plain or (self.program == ProgramKind.PIPELINE and self.zero_stage == 0)

    @property
    def overlaps_all_reduce(self) -> bool:
        """The data-parallel program launches each bucket's all-reduce from the last micro-batch's backward, as soon
        as its gradients are in; without overlap every bucket goes out after backward."""
        return self.runs_plain and self.overlap

    # ------------------------------------------------------------------ the sharded and offload programs

    @property
    def overlaps_data_axis(self) -> bool:
        """The sharded program (and the offload program, over chunks) issues its data-axis collectives asynchronously:
        gradient buckets from backward, weights gathered `prefetch_depth` layers ahead. Without it each parameter's
        collectives run where the graph reads it (a gather, a reduction in the backward of its first read), waited
        on where issued."""
        sharded = self.program in (ProgramKind.SHARDED, ProgramKind.OFFLOAD)
        return sharded and self.overlap and self.data_ranks > 1

    @property
    def reduces_every_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatter every micro-batch's gradients (as FSDP does); ZeRO-0/1 reduce the sum once, from
        the last micro-batch's backward."""
        return self.zero_stage >= 2

    @property
    def reductions_per_step(self) -> int:
        """How many times an overlapping step reduces each gradient (`reduces_every_microbatch`)."""
        return self.num_microbatches if self.reduces_every_microbatch else 1

    @property
    def accumulates_whole_grads(self) -> bool:
        """ZeRO-1 that reduces once a step (overlapping, or a pipeline's `gathers_once_a_step`) keeps each split
        parameter's whole gradient in fp32 on every rank until the last micro-batch's bucket sends the sum."""
        return self.zero_stage == 1 and (self.overlaps_data_axis or self.gathers_once_a_step)

    @property
    def holds_gathered_weights(self) -> bool:
        """ZeRO-1/2 with overlap gather each split weight once, in the step's first forward, and keep it whole for
        the step."""
        return self.overlaps_data_axis and 1 <= self.zero_stage < 3

    @property
    def releases_gathered_weights(self) -> bool:
        """ZeRO-3 frees each weight it gathers once the forward has used it and gathers it again for the backward
        (FSDP's reshard after forward)."""
        return self.data_ranks > 1 and self.zero_stage >= 3

    @property
    def gathers_at_each_use(self) -> bool:
        """ZeRO-1/2 without overlap (and a pipeline's ZeRO-1 without it) gather a split weight wherever an op reads it:
        a recomputed forward gathers it again."""
        once = self.runs_plain or self.overlaps_data_axis or self.gathers_once_a_step
        return self.data_ranks > 1 and self.zero_stage in (1, 2) and not once

    @property
    def gathers_by_layer(self) -> bool:
        """The sharded program gathers a layer's split weights in one all-gather (`autopar.runtime.layer_gather`, one
        flat buffer a layer as FSDP sends it): each gather's latency is paid once per layer, not per weight."""
        return self.program == ProgramKind.SHARDED and self.data_ranks > 1 and self.zero_stage >= 1

    @property
    def launches_early(self) -> bool:
        """Tensor-axis collectives are issued where their value is made, not where it is used
        (`passes.parallelize.launches_early`)."""
        return self.overlap

    # ------------------------------------------------------------------ the offload program's chunks

    @property
    def runs_chunks(self) -> bool:
        """The offload program on a data axis: ZeRO-3 over chunks of many parameters (one gather per chunk for forward
        and one for backward, one reduce-scatter of its fp32 gradient staging), whatever stage the plan names."""
        return self.program == ProgramKind.OFFLOAD and self.data_ranks > 1

    @property
    def prefetches_chunk(self) -> bool:
        """The offload program gathers the next chunk while the current one computes: one chunk ahead, whatever the
        depth beyond 0."""
        return self.program == ProgramKind.OFFLOAD and self.prefetch_depth > 0

    @property
    def chunk_reductions_in_flight(self) -> int:
        """Reduce-scatters of chunks the offload program leaves in flight while backward goes on (0: each waited on
        where it is issued)."""
        return 1 if self.program == ProgramKind.OFFLOAD and self.overlap else 0

    # ------------------------------------------------------------------ a pipeline's stages

    @property
    def gathers_once_a_step(self) -> bool:
        """A pipeline's ZeRO-1 with overlap: each split weight gathered once a step before the schedule and kept,
        its gradients summed over the micro-batches and reduce-scattered once, in buckets."""
        pipeline = self.program == ProgramKind.PIPELINE
        return pipeline and self.zero_stage == 1 and self.overlap and self.data_ranks > 1

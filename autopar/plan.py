"""Plan: the solver's answer, serialisable, with the predictions and the alternatives it beat.

A plan names the device mesh (axis name -> size, product = world size), the ZeRO stage, the
activation recompute mode ("none", "selective": attention internals, "full": whole layers), the
placement of every parameter and of every op's arguments and output on the tensor axis, and
what the cost model predicts for one training step: time, TFLOP/s per device, MFU (model FLOPs:
6 per parameter per token plus attention; recompute not counted), hardware FLOPs utilisation
(every FLOP the step executes), and peak memory per device with its breakdown. A plan that keeps
optimizer states and gradients on the host says how much in `offload` (fractions of each, bytes per
device and per node, the seconds the host link and the CPU optimizer add); empty when nothing is.

`to_json()` writes a versioned document; `Plan.from_json()` refuses other versions and corrupt
text with a `PlanFormatError` that says what to do.

Plan files are deterministic: the same model, cluster and options give the same bytes (in any process,
whatever its hash seed). How long planning took is the one thing that differs between runs, so
`to_json()` leaves the wall-clock figures (`WALL_CLOCK_KEYS`: the trace, solve, alternatives and total
planning times in `stats`, each priced alternative's solve time) out of the file; the Plan object keeps
them, so a report rendered from it (`plan.explain()`, `autopar plan --report/--explain`) shows the
planning time, and `to_json(timings=True)` writes them for whoever wants them on file. A report
rendered from a plan file without them says so instead of a time.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from autopar.cluster import ClusterSpec
from autopar.errors import PlanFormatError
from autopar.explain import render_html, render_markdown
from autopar.rationale import format_flops_rate, hidden_terms
from autopar.units import GIB

FORMAT_VERSION = 1
# what a plan file may hold, checked before it is parsed or turned into a Plan: a real plan of a 175B model on
# 512 devices is well under a megabyte; the counts are past any real job
PLAN_LIMIT_BYTES = 32 * 2**20
PLAN_MAX_DEPTH = 32
MAX_DEVICES = 2**20
MAX_COUNT = 2**20  # micro-batches, virtual stages, layers, samples in a global batch
MESH_AXES = ("pp", "dp", "cp", "tp")
PRECISIONS = ("bf16", "fp16", "fp32")
# what a plan may do with one layer's activations besides keeping them (`Plan.layer_modes`), in the
# order `passes.activation_plan` hands layers out
LAYER_TREATMENTS = ("offload", "full", "selective")
# the ZeRO stages a pipeline stage runs (`runtime.pipeline`): at 2 or 3 every micro-batch would gather and
# reduce-scatter each weight, waited on where issued
PIPELINE_ZERO_STAGES = (0, 1)
# wall-clock figures: they differ on every run and say nothing about the plan (`Plan.to_json`)
WALL_CLOCK_KEYS = frozenset({"trace_time_s", "solve_time_s", "total_time_s", "alternatives_time_s"})


def without_wall_clock(value):
    """`value` (parsed JSON) with every wall-clock field (`WALL_CLOCK_KEYS`) dropped, recursively."""
    if isinstance(value, dict):
        return {k: without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK_KEYS}
    if isinstance(value, (list, tuple)):
        return [without_wall_clock(v) for v in value]
    return value


class ProgramKind(StrEnum):
    """The programs a plan can run as (`autopar.runtime.PROGRAMS` maps each to its class)."""

    DATA_PARALLEL = "data-parallel"  # whole model per rank, plain tensors, bucketed gradient all-reduce
    SHARDED = "sharded"  # the traced graph on DTensors: tensor axis, ZeRO stages, recompute
    PIPELINE = "pipeline"  # stages over a pp axis, each sharded over its own dp x tp block
    OFFLOAD = "offload"  # ZeRO-3 chunks whose states (and weights) partly live on the host
    EXPERT_PARALLEL = "expert-parallel"  # data-parallel, with a mixture of experts' experts split over ep groups


def program_kind(
    *,
    pp: int = 1,
    tp: int = 1,
    zero_stage: int = 0,
    recompute: str = "none",
    layer_modes: dict | None = None,
    offload: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> ProgramKind:
    """THE rule from a layout to the program that runs it; the solver prices what it says, `compile` builds it.

    A pipeline axis runs the pipeline program; host offload the offload program; a layout with no tensor
    axis, no cp axis, replicated states and every layer keeping its activations is DDP's, run on plain
    tensors (the data-parallel program); anything else runs the traced graph on DTensors (the sharded
    program; without a pipeline, a cp axis runs there only). An expert axis (ep > 1) runs the expert-parallel
    program, the data-parallel one with its experts split (the planner pins the dp x 1 layout it needs).
    """
    if ep > 1:
        return ProgramKind.EXPERT_PARALLEL
    if pp > 1:
        return ProgramKind.PIPELINE
    if cp > 1:
        return ProgramKind.SHARDED
    if offload:
        return ProgramKind.OFFLOAD
    if tp == 1 and zero_stage == 0 and recompute == "none" and not layer_modes:
        return ProgramKind.DATA_PARALLEL
    return ProgramKind.SHARDED


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage of a plan (`Plan.stage_plans`, read from `plan.pipeline["stages"]`).

    `node_output` / `node_inputs` are the placements the stage was priced with, keyed by the nodes of the
    planned graph; a repeated layer's nodes are those of its first layer and stand for every layer of the
    stage (`OpGraph.representative`). Empty in plan files written before stages carried them.
    """

    index: int
    layers: tuple[tuple[int, int], ...]  # layer ranges [a, b), one per virtual stage on this device
    dp: int
    tp: int
    zero_stage: int
    recompute: str
    node_output: dict
    node_inputs: dict

    @classmethod
    def from_dict(cls, d: dict) -> StagePlan:
        try:
            return cls(
                index=int(d["index"]),
                layers=tuple((int(a), int(b)) for a, b in d["layers"]),
                dp=int(d["dp"]),
                tp=int(d["tp"]),
                zero_stage=int(d.get("zero_stage", 0)),
                recompute=str(d.get("recompute", "none")),
                node_output=dict(d.get("node_output") or {}),
                node_inputs={k: tuple(v) for k, v in (d.get("node_inputs") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PlanFormatError):
                raise
            raise PlanFormatError(f"corrupt pipeline stage in the plan: {type(e).__name__}: {e}") from e

    def __post_init__(self) -> None:
        if self.index < 0 or not 1 <= self.dp <= MAX_DEVICES or not 1 <= self.tp <= MAX_DEVICES:
            raise PlanFormatError(
                f"pipeline stage {self.index} has dp={self.dp}, tp={self.tp}: expected a stage index of 0 or more and "
                f"axis sizes of at least 1"
            )
        bad = [list(r) for r in self.layers if not 0 <= r[0] < r[1] <= MAX_COUNT]
        if not self.layers or bad:
            raise PlanFormatError(
                f"pipeline stage {self.index} has the layer ranges {bad or []}: expected ranges [a, b) with 0 <= a < b"
            )


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the cost model predicts for one training step (per device where it says so)."""

    step_time_s: float
    tflops_per_device: float
    mfu: float
    hardware_flops_utilization: float
    peak_memory_bytes: float
    memory_breakdown: dict = field(default_factory=dict)
    compute_s: float = 0.0
    reshard_s: float = 0.0
    grad_sync_s: float = 0.0
    tokens_per_s: float = 0.0
    offload_s: float = 0.0
    optimizer_s: float = 0.0  # the optimizer step on the device
    # gradient all-reduce time hidden behind backward (the data-parallel program overlaps them); grad_sync_s is
    # the exposed part
    grad_sync_hidden_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """A parallel layout for one model on one cluster (see the module docstring)."""

    model_name: str
    cluster: ClusterSpec
    mesh: dict
    zero_stage: int
    precision: str
    global_batch_size: int
    tokens_per_step: int
    num_parameters: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    predicted: Predicted
    param_placements: dict
    node_output: dict
    node_inputs: dict
    node_strategy: dict
    alternatives: tuple = ()
    unruled_ops: tuple = ()
    stats: dict = field(default_factory=dict)
    # kernel fusion (passes.fused_ops): {"enabled": bool, "counts": fused ops per kind, "skipped": sites left alone}
    fusion: dict = field(default_factory=dict)
    num_microbatches: int = 1
    # pipeline layouts: schedule, virtual stages, bubble, and per stage its layers, sub-mesh and figures
    pipeline: dict = field(default_factory=dict)
    recompute: str = "none"
    # host offload: optimizer_fraction, grad_fraction, *_bytes_per_device, host_bytes_per_node, time_s
    offload: dict = field(default_factory=dict)
    # per-layer activations (passes.activation_plan): "offload"/"full"/"selective" -> layer indices; the
    # layers not named keep theirs. Empty: `recompute` applies to every layer
    layer_modes: dict = field(default_factory=dict)
    # the offloaded layers' activations: layers, bytes_per_device, time_s (empty: none)
    activation_offload: dict = field(default_factory=dict)
    # the step's predicted time by term (`autopar.rationale.TERMS`: compute, recompute, each axis's
    # communication, bubble, offload, optimizer, other); the terms sum to predicted.step_time_s
    time_breakdown: dict = field(default_factory=dict)
    # per mesh axis (`autopar.rationale.COMM_TERMS`: comm_tp, comm_dp, comm_pp, comm_cp), the communication time
    # overlap hides behind compute (`autopar.rationale.hidden_terms`): not in the step, nor in time_breakdown, whose
    # communication terms are the exposed part; an axis that hides nothing is left out
    hidden_communication: dict = field(default_factory=dict)
    # the layouts a user would pick (DDP, ZeRO-3, the best Megatron-style tp x pp point, the search's
    # runner-up), each priced by the same cost model (`autopar.rationale.entry`), or why it cannot run
    baselines: tuple = ()
    # the layouts a user asked to see next to this plan (`autopar.compare`, `--compare`), in the same form
    comparisons: tuple = ()
    # what the predictions rest on besides the cluster's figures: estimator, profile, memory budget
    assumptions: dict = field(default_factory=dict)
    # tp > 1: split_fraction (of all parameter elements), layer_matmul_split_fraction, min_fraction (the
    # tp_min_split rule), replicated (parameter -> why it stays whole on the tensor axis); empty: no tensor axis
    tensor_split: dict = field(default_factory=dict)
    # mixed precision: the format ZeRO-0 gradients are held and all-reduced in ("fp32", or the compute format
    # when pinned); dp-sharded gradients (ZeRO >= 1) are reduce-scattered in the compute format
    grad_reduce: str = "fp32"
    # whether the program overlaps gradient all-reduces with backward (and the plan priced that); False prices and
    # runs them after backward
    overlap: bool = True
    # parameters split over the data axis (ZeRO >= 1): how many layers ahead of their use the sharded program
    # gathers them, asynchronously (0: each gathered when an op reads it); written for such plans only
    prefetch_depth: int = 1
    # per deduplicated layer (and one entry for what runs outside the layers), as the solver priced it
    # (`passes.sharding.report.layer_ops_report`): "layer", "num_layers", "stages" (pipeline stages running
    # it; empty without a pipeline) and "ops": each op's placements and the collectives inserted for it
    # (kind, mesh axis, pass, bytes, seconds per run, runs per step; a dp collective whose sync overlap partly hides
    # also its exposed seconds per run, "exposed_s")
    layer_ops: tuple = ()
    # a cp axis: "degree", "algorithm" its attention runs, "layout" ("zigzag"), and "priced": one line per
    # algorithm with its price or why it cannot run (`passes.context_parallel`); empty without a cp axis
    context_parallel: dict = field(default_factory=dict)
    # an expert axis carved from dp (`autopar.expert_parallel`): "degree", "num_experts", "top_k", "params" (the expert
    # weights split over it), the all-to-all traffic and time it adds and the memory it saves; empty without one
    expert_parallel: dict = field(default_factory=dict)
    # the global gradient norm the program clips to (`autopar.runtime.step_guard`), priced; None: no clipping
    max_grad_norm: float | None = None
    format_version: int = FORMAT_VERSION

    @property
    def program(self) -> ProgramKind:
        """The program that runs this plan (`program_kind` of its layout)."""
        return program_kind(
            pp=self.mesh.get("pp", 1),
            tp=self.mesh.get("tp", 1),
            zero_stage=self.zero_stage,
            recompute=self.recompute,
            layer_modes=self.layer_modes,
            offload=bool(self.offload),
            cp=self.mesh.get("cp", 1),
            ep=self.expert_parallel.get("degree", 1),
        )

    @property
    def stage_plans(self) -> tuple[StagePlan, ...]:
        """The pipeline's stages, typed (empty without a pipeline)."""
        return tuple(StagePlan.from_dict(d) for d in (self.pipeline or {}).get("stages", ()))

    @property
    def micro_batch_size(self) -> int:
        """Samples in one micro-batch on one data-parallel rank."""
        return self.global_batch_size // (self.mesh.get("dp", 1) * self.num_microbatches)

    def __post_init__(self):
        if not isinstance(self.model_name, str):
            raise PlanFormatError(f"plan model_name must be a string, got {self.model_name!r}")
        bad_axes = {
            k: v
            for k, v in self.mesh.items()
            if k not in MESH_AXES or isinstance(v, bool) or not isinstance(v, int) or v < 1
        }
        if bad_axes:
            raise PlanFormatError(
                f"plan mesh {self.mesh}: expected axes {', '.join(MESH_AXES)} with positive integer "
                f"sizes, found {bad_axes}"
            )
        if self.precision not in PRECISIONS:
            raise PlanFormatError(f"plan precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanFormatError(f"plan zero_stage {self.zero_stage!r} is not 0, 1, 2 or 3")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise PlanFormatError(f"plan max_grad_norm {self.max_grad_norm!r} is not a positive number")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise PlanFormatError(f"plan prefetch_depth {self.prefetch_depth!r} is not a count of layers (0 or more)")
        for name in ("global_batch_size", "num_microbatches", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise PlanFormatError(f"plan {name} must be at least 1, got {getattr(self, name)!r}")
        if self.global_batch_size % self.num_microbatches:
            raise PlanFormatError(
                f"plan global_batch_size {self.global_batch_size} does not split into "
                f"{self.num_microbatches} micro-batches"
            )
        stages = self.pipeline.get("stages", ()) if isinstance(self.pipeline, dict) else None
        if not isinstance(stages, (list, tuple)) or not all(isinstance(st, dict) for st in stages):
            raise PlanFormatError(f"plan pipeline stages must be a list of stage records, got {stages!r:.80}")
        # reading the stages checks every record
        bad = ({self.zero_stage} | {st.zero_stage for st in self.stage_plans}) - set(PIPELINE_ZERO_STAGES)
        if stages and bad:
            raise PlanFormatError(f"plan has pipeline stages at ZeRO-{max(bad)}: a pipeline runs ZeRO 0 or 1 only")
        size = 1
        for v in self.mesh.values():
            size *= v
        if size != self.cluster.world_size:
            raise PlanFormatError(
                f"plan mesh {self.mesh} has {size} devices but the cluster has {self.cluster.world_size}"
            )
        if self.recompute not in ("none", "selective", "full"):
            raise PlanFormatError(f"plan recompute mode {self.recompute!r} is not one of 'none', 'selective', 'full'")
        bad = set(self.layer_modes) - set(LAYER_TREATMENTS)
        if bad:
            raise PlanFormatError(f"plan layer_modes holds {sorted(bad)}: expected 'offload', 'full' or 'selective'")
        seen: set[int] = set()
        for layers in self.layer_modes.values():
            if seen & set(layers):
                raise PlanFormatError(f"plan layer_modes gives layers {sorted(seen & set(layers))} two treatments")
            seen |= set(layers)

    # --------------------------------------------------------------------------- serialisation

    def _hidden_written(self) -> bool:
        """Whether `to_json` writes hidden_communication: where something is hidden, and where it is empty but a
        file without it would be read as hiding the data axis's (`_hidden_communication`'s reading of older files)."""
        return bool(self.hidden_communication) or self.predicted.grad_sync_hidden_s != 0

    def to_json(self, indent: int | None = 1, *, timings: bool = False) -> str:
        """The plan file: deterministic, without the wall-clock figures unless `timings` (module docstring)."""
        d = {
            "format": "autopar-plan",
            "format_version": self.format_version,
            "model_name": self.model_name,
            "cluster": self.cluster.to_dict(),
            "mesh": self.mesh,
            "zero_stage": self.zero_stage,
            "num_microbatches": self.num_microbatches,
            "pipeline": self.pipeline,
            "recompute": self.recompute,
            "offload": self.offload,
            "layer_modes": {k: list(v) for k, v in self.layer_modes.items()},
            "activation_offload": self.activation_offload,
            "tensor_split": self.tensor_split,
            "layer_ops": list(self.layer_ops),
            **({"context_parallel": self.context_parallel} if self.context_parallel else {}),  # golden plans unchanged
            **({"expert_parallel": self.expert_parallel} if self.expert_parallel else {}),  # likewise
            "precision": self.precision,
            "grad_reduce": self.grad_reduce,
            "overlap": self.overlap,
            **({"prefetch_depth": self.prefetch_depth} if self.zero_stage >= 1 else {}),  # ZeRO-0 plans unchanged
            **({"max_grad_norm": self.max_grad_norm} if self.max_grad_norm is not None else {}),
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "num_parameters": self.num_parameters,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "predicted": asdict(self.predicted),
            "param_placements": self.param_placements,
            "node_output": self.node_output,
            "node_inputs": {k: list(v) for k, v in self.node_inputs.items()},
            "node_strategy": self.node_strategy,
            "alternatives": list(self.alternatives),
            "unruled_ops": list(self.unruled_ops),
            "stats": self.stats,
            "fusion": self.fusion,
            "time_breakdown": self.time_breakdown,
            # written only where something is hidden, or where a reader of an older file would make it up: plans
            # without overlap keep their old text
            **({"hidden_communication": self.hidden_communication} if self._hidden_written() else {}),
            "baselines": list(self.baselines),
            "comparisons": list(self.comparisons),
            "assumptions": self.assumptions,
        }
        return json.dumps(d if timings else without_wall_clock(d), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by `to_json`; PlanFormatError for anything else."""
        size = len(text) if isinstance(text, (str, bytes, bytearray)) else 0
        if size > PLAN_LIMIT_BYTES:
            raise PlanFormatError(
                f"not a plan file: {size} bytes, more than the {PLAN_LIMIT_BYTES} a plan file is read up to "
                f"(a plan of a 175B model is under a megabyte); write plans with `autopar plan --json`"
            )
        try:
            d = json.loads(text)
        except (ValueError, TypeError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise PlanFormatError(f"not a plan file: invalid JSON ({e}); write plans with `autopar plan --json`") from e
        if not isinstance(d, dict) or d.get("format") != "autopar-plan":
            raise PlanFormatError(
                "not an autopar plan (no 'format': 'autopar-plan' field); write plans with "
                "`autopar plan --json` or Plan.to_json()"
            )
        if "format_version" not in d:
            raise PlanFormatError(
                f"the plan has no format_version field (this autopar reads version "
                f"{FORMAT_VERSION}); re-run `autopar plan` to write a new plan"
            )
        ver = d["format_version"]
        if ver != FORMAT_VERSION or isinstance(ver, bool):
            raise PlanFormatError(
                f"plan format version {ver!r} is not supported (this autopar reads version "
                f"{FORMAT_VERSION}); re-run `autopar plan` to write a new plan"
            )
        _check_counts(d)
        try:
            plan = cls(
                model_name=d["model_name"],
                cluster=ClusterSpec.from_dict(d["cluster"]),
                mesh=dict(d["mesh"]),
                zero_stage=int(d["zero_stage"]),
                num_microbatches=int(d.get("num_microbatches", 1)),
                pipeline=dict(d.get("pipeline") or {}),
                recompute=str(d.get("recompute", "none")),
                offload=dict(d.get("offload") or {}),
                layer_modes={str(k): tuple(int(i) for i in v) for k, v in (d.get("layer_modes") or {}).items()},
                activation_offload=dict(d.get("activation_offload") or {}),
                tensor_split=dict(d.get("tensor_split") or {}),
                layer_ops=tuple(d.get("layer_ops") or ()),
                context_parallel=dict(d.get("context_parallel") or {}),
                expert_parallel=dict(d.get("expert_parallel") or {}),
                precision=d["precision"],
                grad_reduce=str(d.get("grad_reduce", "fp32")),
                overlap=bool(d.get("overlap", True)),
                prefetch_depth=int(d.get("prefetch_depth", 1)),
                max_grad_norm=float(d["max_grad_norm"]) if d.get("max_grad_norm") is not None else None,
                global_batch_size=int(d["global_batch_size"]),
                tokens_per_step=int(d["tokens_per_step"]),
                num_parameters=int(d["num_parameters"]),
                model_flops_per_step=float(d["model_flops_per_step"]),
                hardware_flops_per_step=float(d["hardware_flops_per_step"]),
                predicted=Predicted(**d["predicted"]),
                param_placements=dict(d["param_placements"]),
                node_output=dict(d["node_output"]),
                node_inputs={k: tuple(v) for k, v in d["node_inputs"].items()},
                node_strategy=dict(d["node_strategy"]),
                alternatives=tuple(d.get("alternatives", ())),
                unruled_ops=tuple(d.get("unruled_ops", ())),
                stats=dict(d.get("stats", {})),
                fusion=dict(d.get("fusion") or {}),
                time_breakdown=dict(d.get("time_breakdown") or {}),
                hidden_communication=_hidden_communication(d),
                baselines=tuple(d.get("baselines") or ()),
                comparisons=tuple(d.get("comparisons") or ()),
                assumptions=dict(d.get("assumptions") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, ZeroDivisionError) as e:
            if isinstance(e, PlanFormatError):
                raise
            raise PlanFormatError(
                f"corrupt plan file: {type(e).__name__}: {e}; re-run `autopar plan` to write a new plan"
            ) from e
        return plan

    @classmethod
    def from_file(cls, path) -> Plan:
        """Read a plan file (`from_json` of its text), refusing one past PLAN_LIMIT_BYTES before reading it."""
        from pathlib import Path

        try:
            with open(Path(path), "rb") as f:
                raw = f.read(PLAN_LIMIT_BYTES + 1)
        except OSError as e:
            raise PlanFormatError(f"cannot read plan file {path}: {e.strerror}") from e
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            raise PlanFormatError(f"{path} is not a plan file: not UTF-8 text ({e})") from e
        return cls.from_json(text)

    # ------------------------------------------------------------------------------ reporting

    def explain(self, fmt: str = "markdown") -> str:
        """A report of what was chosen and why: Markdown, or a self-contained HTML page (fmt="html").
        PlanFormatError when the plan's report records (free-form, as read from a file) cannot be rendered."""
        if fmt not in ("markdown", "md", "html"):
            raise ValueError(f"unknown report format {fmt!r}: expected 'markdown' or 'html'")
        with _rendering("report"):
            return render_html(self) if fmt == "html" else render_markdown(self)

    def summary(self) -> str:
        """One line: the layout, the program that runs it, the predicted step, throughput and memory."""
        with _rendering("summary"):
            return self._summary()

    def _summary(self) -> str:
        p = self.predicted
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        if (ep := self.expert_parallel.get("degree", 1)) > 1:  # carved from dp, not a factor of the mesh
            mesh += f" (ep={ep} within dp)"
        accum = (
            f", {self.num_microbatches} micro-batches of {self.micro_batch_size}" if self.num_microbatches > 1 else ""
        )
        if self.layer_modes:
            accum += ", " + ", ".join(f"{_TREATMENT_WORDS[m]} in {len(v)} layers" for m, v in self.layer_modes.items())
        elif self.recompute != "none":
            accum += f", {self.recompute} recompute"
        if self.offload:
            accum += f", {self.offload['optimizer_fraction']:.0%} of optimizer states on the host"
        if self.pipeline:
            v = self.pipeline.get("virtual_stages", 1)
            accum += f", {self.pipeline.get('schedule')}" + (f" x{v} virtual stages" if v > 1 else "")
        return (
            f"{self.model_name} on {self.cluster.describe()}: mesh {mesh}, ZeRO-{self.zero_stage}{accum}, "
            f"runs as the {self.program} program, "
            f"step {p.step_time_s * 1e3:.1f} ms, {format_flops_rate(p.tflops_per_device)}/device, MFU {p.mfu:.1%}, "
            f"peak memory {p.peak_memory_bytes / GIB:.2f} GiB/device" + self._tensor_split_words()
        )

    def _tensor_split_words(self) -> str:
        """What the tensor axis splits and, grouped by reason, what it keeps whole ("" without a tensor axis)."""
        ts = self.tensor_split
        if not ts:
            return ""
        words = (
            f"; the tensor axis splits {ts['split_fraction']:.0%} of the parameters "
            f"({ts['layer_matmul_split_fraction']:.0%} of the layer matmul weights)"
        )
        by_reason: dict[str, list[str]] = {}
        for name, reason in ts.get("replicated", {}).items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            words += f"; kept whole ({reason}): {shown}"
        return words


def _hidden_communication(d: dict) -> dict:
    """The plan file's hidden communication per axis; files written before the field carried only the data axis's,
    as predicted.grad_sync_hidden_s."""
    if "hidden_communication" in d:
        return {str(k): float(v) for k, v in d["hidden_communication"].items()}
    return hidden_terms(grad_sync_hidden_s=float(d["predicted"].get("grad_sync_hidden_s", 0.0)))


_TREATMENT_WORDS = {"offload": "activations offloaded", "full": "full recompute", "selective": "selective recompute"}


@contextmanager
def _rendering(what: str):
    """Rendering a plan's free-form records: a record of the wrong shape (a damaged or edited plan file) is a
    PlanFormatError, not a KeyError from deep inside the report."""
    try:
        yield
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, ZeroDivisionError) as e:
        raise PlanFormatError(
            f"the plan's {what} cannot be rendered: a record of it is corrupt ({type(e).__name__}: {e}); a plan "
            f"file that was edited or damaged: re-run `autopar plan` to write a new one"
        ) from e


def _check_counts(d: dict) -> None:
    """Refuse a plan document nested deeper than PLAN_MAX_DEPTH, or whose counts (devices, micro-batches,
    virtual stages, batch) are not positive or past MAX_DEVICES / MAX_COUNT, before a Plan is made of it."""
    stack = [(d, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= PLAN_MAX_DEPTH:
                raise PlanFormatError(f"corrupt plan file: nested more than {PLAN_MAX_DEPTH} deep")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    cluster, pipeline = d.get("cluster"), d.get("pipeline") or {}
    counts = {
        "global_batch_size": (d.get("global_batch_size"), MAX_COUNT),
        "num_microbatches": (d.get("num_microbatches", 1), MAX_COUNT),
        "pipeline virtual_stages": (pipeline.get("virtual_stages", 1) if isinstance(pipeline, dict) else 1, MAX_COUNT),
    }
    if isinstance(cluster, dict):
        counts["cluster num_nodes"] = (cluster.get("num_nodes"), MAX_DEVICES)
        counts["cluster devices_per_node"] = (cluster.get("devices_per_node"), MAX_DEVICES)
    mesh = d.get("mesh")
    if isinstance(mesh, dict):
        counts |= {f"mesh {k}": (v, MAX_DEVICES) for k, v in mesh.items()}
    for name, (value, limit) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise PlanFormatError(
                f"corrupt plan file: {name} is {str(value)[:40]}, expected a whole number from 1 to {limit}; "
                f"re-run `autopar plan` to write a new plan"
            )
    nodes, per_node = counts.get("cluster num_nodes", (1, 0))[0], counts.get("cluster devices_per_node", (1, 0))[0]
    if nodes * per_node > MAX_DEVICES:
        raise PlanFormatError(f"corrupt plan file: a cluster of {nodes} x {per_node} devices, past {MAX_DEVICES}")
